"""The agent <-> worker protocol (tpassrun/protocol.py): every message round-trips, bad lines are one typed error."""

from __future__ import annotations

import pytest

from tpassrun import protocol as P

WORLD = P.WorldSpec(rank=3, world_size=4, role_rank=3, role_world_size=4, group_rank=1, local_world_size=2,
                    group_world_size=2)
MESSAGES = [
    P.Resume(), P.SendState(addr="10.0.0.1", port=29400, swap_id="s-1", key="ab" * 32, rank=3, replicated_only=True, rng=False),
    P.Reform(world=WORLD.with_store("10.0.0.1", 29500, "/tpassrun/s-1/0/", 7), rollback=True), P.Exit(code=3),
    P.Raise(reason="no recovery"), P.Assign(world=WORLD, swap_id="s-1", key="cd" * 32, listen_host="10.0.0.2", timeout=5.0, accept_timeout=15.0,
             max_bytes=1 << 20),
    P.Light(data="AAAA", step=None), P.Light(data="AAAA", step=17), P.Reserve(nbytes=1 << 30), P.Abort(),
    P.Hello(pid=12, spare=True), P.Done(step=99),
    P.Replicas(ranks=(1, 3), alone=""), P.Replicas(ranks=(2,), alone="FSDP without dp_replicate"),
    P.Failed(step=4, error="DistNetworkError: peer gone", error_type="torch.distributed.DistNetworkError"),
    P.Listening(port=4000, swap_id="s-1"), P.Received(ok=False, swap_id="s-1", error="checksum mismatch"),
    P.Received(ok=True, swap_id="s-1", nbytes=10, seconds=0.5, checksum="x", step=17),
    P.Stranger(swap_id="s-1", error="no key"),
    P.LightOk(ok=True, nbytes=10, step=17), P.Reformed(ok=True, rank=3, world_size=4, generation=7, join_s=0.25),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.KIND)
def test_every_message_round_trips(msg):
    line = P.encode(msg, slot=2)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert P.decode(line) == (msg, 2)


def test_commands_and_replies_are_disjoint_and_complete():
    assert not set(P.COMMANDS) & set(P.REPLIES)
    assert {type(m).KIND for m in MESSAGES} == set(P.COMMANDS) | set(P.REPLIES)
    for dead in ("rollback", "rolled_back", "paused", "sent", "reserved"):      # nothing sends or awaits them
        assert dead not in P.COMMANDS and dead not in P.REPLIES


@pytest.mark.parametrize("line", [
    b"not json\n", b"[1]\n", b'{"kind": "rollback"}\n', b'{"kind": "exit", "code": "0"}\n',
    b'{"kind": "listening"}\n', b'{"kind": "assign", "swap_id": "s", "key": "", "listen_host": "h", "world": 5}\n',
    b'{"kind": "assign", "swap_id": "s", "key": "", "listen_host": "h", "world": {"rank": "1", "world_size": 2}}\n',
    b'{"kind": "received", "ok": 1}\n', b'{"kind": "reserve", "nbytes": true}\n',
    b'{"kind": "replicas", "ranks": 3}\n', b'{"kind": "replicas", "ranks": [1, "2"]}\n',
])
def test_a_bad_line_is_one_protocol_error(line):
    with pytest.raises(P.ProtocolError):
        P.decode(line)


def test_world_spec_env_fields_leave_unknowns_alone():
    survivor = P.WorldSpec(rank=1, world_size=4).with_store("h", 1, "/p/", 2)
    assert survivor.env_fields() == {"rank": 1, "world_size": 4, "addr": "h", "port": 1, "prefix": "/p/",
                                     "generation": 2}
