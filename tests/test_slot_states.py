"""The agent's slot states (tpassrun/channel/slots.py): one transition table, every assignment checked against it."""

from __future__ import annotations

import json
import logging

from tpassrun.channel.slots import SLOT_TRANSITIONS, Slot, SlotState


def test_every_state_has_a_row_and_the_table_names_only_states():
    assert set(SLOT_TRANSITIONS) == set(SlotState)
    for targets in SLOT_TRANSITIONS.values():
        assert targets <= set(SlotState)


def test_the_lifecycles_the_agent_drives_are_legal(caplog):
    caplog.set_level(logging.WARNING, logger="tpassrun.channel")
    paths = [
        ["idle", "running", "done", "idle"],                       # a rank that finished, next generation
        ["idle", "running", "dead", "quarantined", "spare"],       # unplanned: retired, untainted: a spare again
        ["idle", "spare", "running", "leaving", "quarantined"],    # a joiner that later left (planned)
        ["idle", "spare", "dead"],                                 # a spare lost
        ["idle", "running", "idle"], ["idle", "spare", "idle"],    # stopped (restart, fencing)
        ["done", "quarantined"], ["idle", "dead"],                 # health-aware restart; a spawn that failed
    ]
    for path in paths:
        slot = Slot(index=0, state=SlotState(path[0]))
        for state in path[1:]:
            slot.state = SlotState(state)
        assert slot.state == SlotState(path[-1])
    assert caplog.records == []


def test_an_illegal_transition_is_logged_not_fatal(caplog):
    caplog.set_level(logging.WARNING, logger="tpassrun.channel")
    slot = Slot(index=3, state=SlotState.DONE)
    slot.state = SlotState.SPARE
    assert slot.state is SlotState.SPARE
    assert "slot 3: illegal state transition done -> spare" in caplog.text


def test_a_state_reads_as_its_value_everywhere():
    """Events, status rows and console lines show "running", as the plain strings did."""
    assert f"{SlotState.RUNNING}" == str(SlotState.RUNNING) == "running"
    assert json.dumps({"state": SlotState.RUNNING}) == '{"state": "running"}'
    assert Slot(index=0, state="spare").state is SlotState.SPARE
