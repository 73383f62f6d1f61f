"""One schema for everything tpassrun keeps as JSON (the control-plane records, the rendezvous's state, the agent
<-> worker messages): each declared once, as a frozen dataclass, and written and read by one codec
(:mod:`tpassrun.schema.codec`). Imports only the standard library."""

from __future__ import annotations

from tpassrun.schema.codec import (
                                   Address,
                                   Max,
                                   Min,
                                   NonNegative,
                                   OneOf,
                                   Port,
                                   Positive,
                                   Record,
                                   Schema,
                                   SchemaError,
                                   dump,
                                   load,
                                   wire,
)

__all__ = ["Address", "Max", "Min", "NonNegative", "OneOf", "Port", "Positive", "Record", "Schema", "SchemaError",
           "dump", "load", "wire"]
