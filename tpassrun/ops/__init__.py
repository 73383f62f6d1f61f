"""tpassrun.ops."""
