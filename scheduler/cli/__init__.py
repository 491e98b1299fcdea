"""The planner's command line, one module per subcommand (scenario, plan, evaluate, simulate,
explain); scheduler/scheduler.py is the entry point that builds the parser and dispatches.

Shared parts: `fields` (flags generated from the library fields' declarations), `perf_model`
(the simulated objective's performance-model flags), `inputs` (cluster and plan files), `clock`
(when the command started)."""
