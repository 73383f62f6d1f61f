"""The event log's declared events (tpassrun.records.events) against the event logs of real runs
(tests/golden/events: a live recovery, a restart of a script with and without the worker API, a failure): each line of a
declared event reads back as its type and writes again as the same keys, in the same order, with the same values, so
``tpassctl events --json`` and the docs' field references stay true while writers move to the types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpassrun.records import (
    EVENTS,
    SlotRef,
    SpareReturned,
    SwapKind,
    SwapPlanSeen,
    SwapResumed,
    SwapTransferEnd,
    emit,
    read_event,
)
from tpassrun.records.events import ENVELOPE, Event
from tpassrun.records.swaps import Phase

GOLDEN = Path(__file__).resolve().parent / "golden" / "events"


def _lines() -> list[dict]:
    out = []
    for path in sorted(GOLDEN.glob("*.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def _written(event: Event) -> list[tuple[str, object]]:
    said: list[tuple[str, dict]] = []

    class Sink:
        def write(self, name: str, **fields: object) -> None:
            said.append((name, fields))

    emit(Sink(), event)
    (name, fields), = said
    return [("event", name), *json.loads(json.dumps(fields)).items()]


def test_real_event_logs_read_back_and_write_again_key_for_key():
    lines = [line for line in _lines() if line["event"] in EVENTS]
    assert len({line["event"] for line in lines}) >= 25     # the golden logs hold this many of the declared kinds
    for line in lines:
        event = read_event(line)
        assert event is not None
        assert _written(event) == [(k, v) for k, v in line.items() if k not in ENVELOPE[1:]], line


def test_an_undeclared_event_reads_as_none():
    assert read_event({"event": "scheduler_event", "time": 0.0, "mono": 0.0, "node": "n", "message": "m"}) is None


def test_a_field_only_some_writers_give_is_left_out():
    assert _written(SwapTransferEnd(swap_id="s-1", nbytes=3, seconds=0.5, checksum="ab")) == [
        ("event", "swap_transfer_end"), ("swap_id", "s-1"), ("nbytes", 3), ("seconds", 0.5), ("checksum", "ab")]
    assert _written(SwapTransferEnd(swap_id="s-1", rank=2, nbytes=3, seconds=0.5, checksum="ab"))[2] == ("rank", 2)
    assert _written(SpareReturned(slot=4)) == [("event", "spare_returned"), ("slot", 4)]
    assert [k for k, _ in _written(SwapResumed(swap_id="s", rank=1, seconds=1.0))] == ["event", "swap_id", "rank",
                                                                                         "seconds"]


def test_a_plan_phase_names_its_event():
    ref = SlotRef(node="n", slot=0, rank=1)
    seen = SwapPlanSeen(swap_id="s", kind=SwapKind.UNPLANNED, rank=1, leaver=ref, joiner=ref, boundary=None, attempt=0,
                        ranks=[1], lost_node=None, phase=Phase.TRANSFER)
    written = _written(seen)
    assert written[0] == ("event", "swap_transfer") and "phase" not in dict(written)
    assert read_event({"event": "swap_transfer", **dict(written[1:])}) == seen


def test_a_declared_event_with_a_wrong_field_is_refused():
    from tpassrun.schema import SchemaError

    with pytest.raises(SchemaError):
        read_event({"event": "swap_resumed", "swap_id": "s", "rank": "one", "seconds": 1.0})
