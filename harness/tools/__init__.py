"""The outside world: runners of the built llama.cpp tools (the only subprocesses), test models, datasets."""
