"""The formats every layer shares: cluster/1 and plan/1 files, model specs, user errors and
atomic file writing. The planner (`scheduler/`), the runtime (`modules/`, `dist_runner.py`) and
the scripts import these; this package imports nothing of theirs (no torch, no planner code).
"""
