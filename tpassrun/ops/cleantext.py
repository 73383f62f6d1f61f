"""Text from outside the launcher made safe for a terminal: ``clean``.

Taint reasons, node ids, health readings, a script's arguments and anything else read from etcd, an event log or
the command line may carry terminal control sequences (``\\x1b[2J`` clears the screen, an OSC sequence retitles the
window or writes the clipboard, ``\\r`` or ``\\n`` forge a log line). Every place that writes such text to a terminal
(the agent's console lines and its logging, ``tpassctl``, the live view) passes it through :func:`clean`, which
shows each control character as its escape (``\\x1b``), so it is seen and never interpreted. What is escaped: C0
(``\\n`` too, unless a block of lines is intended), DEL, C1, and the Unicode characters that reorder or break lines
(bidirectional overrides and isolates, the line and paragraph separators). A tab becomes a space.
"""

from __future__ import annotations

import json
from typing import Any

_CONTROL = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]
_UNICODE = [0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x2028, 0x2029]
_LINE = str.maketrans({**{c: f"\\x{c:02x}" for c in _CONTROL}, **{c: f"\\u{c:04x}" for c in _UNICODE},
                       0x09: " ", 0x0A: "\\n", 0x0D: "\\r"})
_BLOCK = str.maketrans({**{chr(k): v for k, v in _LINE.items()}, "\n": "\n"})


def clean(text: object, *, block: bool = False) -> str:
    """``text`` (any value: ``str()`` of it) with every control character shown as its escape; ``block``: keep
    newlines (a traceback, a multi-line message)."""
    text = str(text)
    # control, format and separator characters are all non-printable: the common case is decided in C
    return text if text.isprintable() else text.translate(_BLOCK if block else _LINE)


def clean_tree(value: Any) -> Any:
    """A JSON-like document (dicts, lists, strings, numbers) with every string, keys too, :func:`clean`; the
    document itself when there is nothing to escape (the common case, found in C: the live view cleans a
    512-node status document once per frame)."""
    try:
        blob = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        blob = None
    # json escapes C0 with a backslash; DEL, C1, format and separator characters stay and are not printable
    if blob is not None and "\\" not in blob and blob.isprintable():
        return value
    return _clean_tree(value)


def _clean_tree(value: Any) -> Any:
    if isinstance(value, str):
        return clean(value)
    if isinstance(value, dict):
        return {_clean_tree(k): _clean_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean_tree(v) for v in value]
    return value
