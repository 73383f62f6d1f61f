"""tpassrun.plan."""
