"""Training data: corpus files, tokenizers, the token cache, and the windows a rank trains on."""
