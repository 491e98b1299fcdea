"""The benchmarks: each script prints its ratios and writes results.json (docs/benchmarks.md)."""
