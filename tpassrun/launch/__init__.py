"""tpassrun.launch."""
