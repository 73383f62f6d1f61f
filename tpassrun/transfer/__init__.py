"""tpassrun.transfer."""
