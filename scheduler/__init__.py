"""Planner: cluster and model descriptions, cost models, search, simulator, plan files."""
