"""The training loop and its parts: checkpoints, metrics, trackers (the model: modules.model)."""
