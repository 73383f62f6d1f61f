"""The agent <-> worker protocol (tpassrun/channel/protocol.py): every message round-trips, bad lines are one typed error."""

from __future__ import annotations

import pytest

from tpassrun.channel import protocol as P

WORLD = P.WorldSpec(rank=3, world_size=4, role_rank=3, role_world_size=4, group_rank=1, local_world_size=2,
                    group_world_size=2)
MESSAGES = [
    P.Resume(), P.SendState(addr="10.0.0.1", port=29400, swap_id="s-1", key="ab" * 32, rank=3, replicated_only=True, rng=False),
    P.Reform(world=WORLD.with_store("10.0.0.1", 29500, "/tpassrun/s-1/0/", 7), rollback=True), P.Exit(code=3),
    P.Raise(reason="no recovery"), P.Assign(world=WORLD, swap_id="s-1", key="cd" * 32, listen_host="10.0.0.2", timeout=5.0, accept_timeout=15.0,
             max_bytes=1 << 20),
    P.Light(data="AAAA", step=None), P.Light(data="AAAA", step=17), P.Reserve(nbytes=1 << 30), P.Abort(), P.AbortJoin(prefix="/tpassrun/u-a-1-0/0/"),
    P.Hello(pid=12, spare=True), P.Done(step=99),
    P.Replicas(ranks=(1, 3), alone=""), P.Replicas(ranks=(2,), alone="FSDP without dp_replicate"),
    P.Failed(step=4, error="DistNetworkError: peer gone", error_type="torch.distributed.DistNetworkError"),
    P.Listening(port=4000, swap_id="s-1"), P.Received(ok=False, swap_id="s-1", error="checksum mismatch"),
    P.Received(ok=True, swap_id="s-1", nbytes=10, seconds=0.5, checksum="x", step=17),
    P.Stranger(swap_id="s-1", error="no key"),
    P.LightOk(ok=True, nbytes=10, step=17), P.Reformed(ok=True, rank=3, world_size=4, generation=7, join_s=0.25),
    P.Failed(step=4, error="RuntimeError: x", error_type="builtins.RuntimeError", failure="collective"),
    P.Raised(step=4, error="RuntimeError: Connection reset by peer", error_type="builtins.RuntimeError"),
    P.MirrorInfoRequest(), P.MirrorInfo(buddy={"node": "n2", "addr": "h", "port": 1}, local=None), P.MirrorInfo(),
    P.SendState(addr="h", port=1, swap_id="s-2", key="ab" * 32, rank=0, replicated_only=True, without_sharded=True),
    P.Assign(world=WORLD, swap_id="s-2", key="cd" * 32, listen_host="h",
             mirror_from=P.MirrorSource(target={"node": "n2", "addr": "h", "port": 7}, owner=3, step=40)),
    P.Received(ok=True, swap_id="s-2", nbytes=10, step=40, mirrored=True),
    P.ShardRollback(step=40), P.ShardRolledBack(ok=False, step=40, error="no copy of step 40"),
    P.Watch(pid=7), P.Break(reason="node n3 was declared lost"), P.Break(),
    P.CatchUp(swap_id="n-x", key="ef" * 32, rank=1, listen_host="10.0.0.3", step=41),
    P.ReplicasChecked(step=12, ok=True, ranks=4, groups=1, nbytes=1 << 20, seconds=0.01),
    P.ReplicasChecked(step=12, ok=False, action="repair", differ={"1": {"tensors": ["model.w"], "source": 0}},
                      detail="rank 1 differs in model.w: takes model from rank 0"),
]


def _table(msg):
    return P.COMMANDS if type(msg) in P.COMMANDS.values() else P.REPLIES


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    line = P.encode(msg, slot=2)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert P.decode(line, _table(msg)) == (msg, 2)
    if _table(msg) is P.COMMANDS:
        assert P.decode_command(line) == msg
    else:
        assert P.decode_reply(line) == (msg, 2)


def test_each_direction_has_its_own_table_and_both_are_complete():
    """A question and its answer may share a kind (mirror_info); no other kind is in both directions."""
    assert set(P.COMMANDS) & set(P.REPLIES) == {"mirror_info"}
    assert P.COMMANDS["mirror_info"] is P.MirrorInfo and P.REPLIES["mirror_info"] is P.MirrorInfoRequest
    assert {type(m) for m in MESSAGES} == set(P.COMMANDS.values()) | set(P.REPLIES.values())
    for dead in ("rollback", "rolled_back", "paused", "sent", "reserved"):      # nothing sends or awaits them
        assert dead not in P.COMMANDS and dead not in P.REPLIES
    with pytest.raises(P.ProtocolError):
        P.decode_command(P.encode(P.Hello(pid=1)))      # a worker's message is no command
    with pytest.raises(P.ProtocolError):
        P.decode_reply(P.encode(P.Resume()))


@pytest.mark.parametrize("line", [
    b"not json\n", b"[1]\n", b'{"kind": "rollback"}\n', b'{"kind": "exit", "code": "0"}\n',
    b'{"kind": "listening"}\n', b'{"kind": "assign", "swap_id": "s", "key": "", "listen_host": "h", "world": 5}\n',
    b'{"kind": "assign", "swap_id": "s", "key": "", "listen_host": "h", "world": {"rank": "1", "world_size": 2}}\n',
    b'{"kind": "received", "ok": 1}\n', b'{"kind": "reserve", "nbytes": true}\n',
    b'{"kind": "replicas", "ranks": 3}\n', b'{"kind": "replicas", "ranks": [1, "2"]}\n',
    b'{"kind": "replicas_checked", "step": 1, "ok": true, "differ": []}\n',
    b'{"kind": "assign", "swap_id": "s", "key": "", "listen_host": "h", "world": {"rank": 1, "world_size": 2},'
    b' "mirror_from": {"target": {}, "owner": 1}}\n', b'{"kind": "shard_rollback", "step": null}\n',
])
def test_a_bad_line_is_one_protocol_error(line):
    for table in (P.COMMANDS, P.REPLIES):
        with pytest.raises(P.ProtocolError):
            P.decode(line, table)


def test_a_survivors_world_leaves_what_it_does_not_say_alone(monkeypatch):
    import os

    from tpassrun.settings import envnames as E
    from tpassrun.worker.world import set_rank_env

    for name, value in ((E.RANK, "0"), (E.WORLD_SIZE, "3"), (E.GROUP_RANK, "5"), (E.TPASSRUN_GENERATION, "1")):
        monkeypatch.setenv(name, value)     # restored after the test
    set_rank_env(P.WorldSpec(rank=1, world_size=4).with_store("h", 1, "/p/", 2))
    assert [os.environ[n] for n in (E.RANK, E.WORLD_SIZE, E.GROUP_RANK, E.TPASSRUN_GENERATION)] == ["1", "4", "5", "2"]
