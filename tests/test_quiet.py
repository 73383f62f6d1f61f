"""Stranger warnings are aggregated: one line per source per minute, with a count (pure, injected clock)."""

from __future__ import annotations

from tpassrun.transfer.quiet import Throttle, held_note


def test_one_line_per_source_per_window_with_the_count_held_back():
    now = [0.0]
    t = Throttle(window=60.0, clock=lambda: now[0])
    assert t.check("10.0.0.9") == 0                 # the first is said at once
    assert [t.check("10.0.0.9") for _ in range(347)] == [None] * 347
    assert t.check("10.0.0.7") == 0                 # another source is its own line
    now[0] = 61.0
    assert t.check("10.0.0.9") == 347               # a minute later: one line for the 347 held back
    assert held_note(347, 60.0) == " (and 347 more from it in the last 60 s)" and held_note(0, 60.0) == ""


def test_a_flood_of_sources_keeps_the_table_bounded():
    now = [0.0]
    t = Throttle(window=60.0, clock=lambda: now[0], max_sources=8)
    for i in range(100):
        assert t.check(f"src{i}") == 0
    assert len(t._sources) <= 8
