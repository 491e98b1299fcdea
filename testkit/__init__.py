"""Support for tests and benchmarks (not part of the runtime): single-process references of
the distributed run and the kill-trial harness."""
