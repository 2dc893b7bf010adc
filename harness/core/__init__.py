"""Bottom layer: the user-facing error, sizes, where things are (project root, pin, builds), JSON Lines records."""
