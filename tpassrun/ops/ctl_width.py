"""``tpassctl``'s lines fit the terminal (80 columns too): wrapped at word boundaries, each continuation indented.

Off a terminal with no ``COLUMNS``, lines stay whole (a pipe to grep or a log file wants one line per event);
with ``COLUMNS`` set, or on a terminal, they fit its width. Nothing is cut: an id or a path longer than the width
is folded, never ellipsized (an id is what ``tpassctl untaint --id`` takes). :func:`wrap` is pure.
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

from tpassrun.settings import envnames as E

INDENT = "    "
MIN_WIDTH = 40


def columns(stream: Any, environ: Any = None) -> int | None:
    """The width to fit on ``stream``: ``COLUMNS`` when set, else the terminal's; ``None`` off a terminal."""
    env = os.environ if environ is None else environ
    text = env.get(E.COLUMNS, "")
    if text.strip().isdigit() and int(text) > 0:
        return max(MIN_WIDTH, int(text))
    try:
        if stream.isatty():
            return max(MIN_WIDTH, os.get_terminal_size(stream.fileno()).columns)
    except (AttributeError, OSError, ValueError):
        pass
    return None


def wrap(text: str, width: int | None, indent: str = INDENT) -> list[str]:
    """``text`` (one line) as lines of at most ``width`` characters; continuations start with ``indent`` plus the
    line's own leading spaces (a list item stays an item). ``width`` None: the line as it is."""
    if width is None or len(text) <= width:
        return [text]
    lead = text[: len(text) - len(text.lstrip(" "))]
    return textwrap.wrap(text, width=width, initial_indent="", subsequent_indent=lead + indent,
                         break_long_words=True, break_on_hyphens=False, drop_whitespace=True,
                         replace_whitespace=False) or [text[:width]]
