"""The outside world: runners of the built llama.cpp tools (the only place that starts them), host probes,
generated test models, datasets."""
