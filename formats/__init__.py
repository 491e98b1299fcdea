"""The formats every layer shares: cluster files (cluster/1, compact cluster/2), plan/1 and
plan/2 (shard groups), model specs, user errors, input checks and atomic file writing. The
planner (`scheduler/`), the runtime (`modules/`, `dist_runner.py`) and the scripts import
these; this package imports nothing of theirs (no torch, no planner code).
"""
