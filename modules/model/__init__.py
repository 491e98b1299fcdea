"""The model the runtime trains: a GPT/LLaMA-style decoder split into pipeline stages
(decoder.py). Below modules.pipeline and modules.train, which both build on it."""
