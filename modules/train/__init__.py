"""The training loop and what it holds: model, checkpoints, metrics, trackers."""
