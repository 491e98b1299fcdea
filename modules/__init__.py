"""The torch runtime: model stages, pipeline schedule, data-parallel sync, data, checkpoints."""
