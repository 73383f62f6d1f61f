"""The agent <-> worker protocol: one frozen type per command and per reply, encoded and decoded here only.

Transport (``tpassrun/channel/__init__.py``): one JSON object per line over the agent's unix socket, ``{"kind": ...,
"slot": ..., <fields>}``. The worker sends :class:`Hello` from ``tpassrun.init()``; the agent sends commands only
to a worker that is paused at a step boundary, failed in a collective, or a spare. Replies the agent waits for:
``Listening``, ``Received``, ``LightOk``, ``Reformed``; ``Hello``, ``Done``, ``Failed`` and ``Raised`` reach the
agent's supervisor as events. The step boundary itself is signalled through shared memory, not by a message.

This module imports nothing of tpassrun but the one codec (:mod:`tpassrun.schema`, the standard library only): the
worker side (``import tpassrun`` in the user's script) pays for it only that. Each message is declared once, as a
frozen dataclass; its fields are its keys, after ``kind`` (and the sender's ``slot``).

Every message crosses the socket as one of these types: the agent (``tpassrun/channel/slots.py``: ``send``/``expect``,
``tpassrun/swapper/__init__.py``, ``tpassrun/swapper/mirrorplane.py``) builds and reads them, the worker
(``tpassrun/worker/link.py``) decodes commands and
one dispatcher (``tpassrun/worker/commands.py``) obeys them, whether the worker holds a rank or is a spare. Messages
nothing sent or awaited are gone: ``rollback``, ``rolled_back``, ``paused`` (the shared-memory phase says it),
``sent`` and ``reserved``.

Each direction has its own table (:data:`COMMANDS` from the agent, :data:`REPLIES` from the worker) and its own
decoder (:func:`decode_command`, :func:`decode_reply`): a question and its answer may share a kind
(``mirror_info``).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Union, cast

from tpassrun import schema

# --------------------------------------------------------------------------------------------- the world


class ProtocolError(schema.SchemaError):
    """A channel line that is not one of the messages below (wrong kind, missing or mistyped field)."""


@dataclass(frozen=True)
class WorldSpec:
    """A rank's place in a world: what a joiner is assigned, and what every rank re-forms into.

    ``None`` fields are left as the worker has them (a survivor keeps its group rank and local world size).
    The store fields (``addr``, ``port``, ``prefix``, ``generation``) are filled for ``Reform`` only.
    """

    rank: int
    world_size: int
    role_rank: int | None = None
    role_world_size: int | None = None
    group_rank: int | None = None
    local_world_size: int | None = None
    group_world_size: int | None = None
    addr: str = ""
    port: int = 0
    prefix: str = ""
    generation: int | None = None

    def with_store(self, addr: str, port: int, prefix: str, generation: int) -> "WorldSpec":
        return dataclasses.replace(self, addr=addr, port=port, prefix=prefix, generation=generation)


@dataclass(frozen=True)
class MirrorSource:
    """Where a joiner fetches the dead rank's sharded state itself: that rank's (``owner``) copy of ``step`` in
    the mirror at ``target`` (a ``tpassrun.mirror.MirrorTarget`` as JSON, with the run's key)."""

    target: dict[str, Any]
    owner: int
    step: int


# --------------------------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Message:
    KIND: ClassVar[str] = ""
    SCHEMA: ClassVar[schema.Schema] = schema.Schema(error=ProtocolError)   # named by its class in errors


# agent -> worker: commands
@dataclass(frozen=True)
class Resume(Message):
    """Carry on (up to the shared-memory ``run_until``)."""

    KIND: ClassVar[str] = "resume"


@dataclass(frozen=True)
class SendState(Message):
    """Stream this rank's state to the joiner listening at ``addr:port`` (the leaver, or a donor replica)."""

    KIND: ClassVar[str] = "send_state"
    addr: str
    port: int
    swap_id: str
    key: str                          # hex: this attempt's transfer key (from the plan's secret)
    rank: int                         # the rank whose state this is (authenticated with the key)
    replicated_only: bool = False     # a donor: only what every data-parallel replica holds alike
    without_sharded: bool = False     # leave the sharded objects out: the joiner fetches them from a mirror
    rng: bool = True                  # the leaver's own RNG goes along (a donor's would be wrong)
    timeout: float = 60.0


@dataclass(frozen=True)
class Reform(Message):
    """Leave the old world and join ``world`` (a survivor; a joiner that received its state)."""

    KIND: ClassVar[str] = "reform"
    world: WorldSpec
    rollback: bool = False            # unplanned: the failed step is re-run; restore what it consumed
    resume: int | None = None         # unplanned: the step everyone resumes at (the plan's boundary)


@dataclass(frozen=True)
class Exit(Message):
    KIND: ClassVar[str] = "exit"
    code: int = 0


@dataclass(frozen=True)
class Raise(Message):
    """Re-raise the collective failure (nothing recovers it): the ordinary failure path takes over."""

    KIND: ClassVar[str] = "raise"
    reason: str = ""


@dataclass(frozen=True)
class Assign(Message):
    """A spare takes ``world.rank``: listen for its state and reply ``Listening``."""

    KIND: ClassVar[str] = "assign"
    world: WorldSpec
    swap_id: str
    key: str                          # hex: this attempt's transfer key; a sender that cannot prove it is dropped
    listen_host: str                  # the agent's advertised address (never 0.0.0.0)
    attempt: int = 0                  # the swap's attempt: every reply names it (a late one is never paired anew)
    timeout: float = 120.0            # receiving, once a sender connected
    accept_timeout: float = 120.0     # waiting for the sender to connect
    max_bytes: int | None = None      # the most the transfer may announce (nothing larger is allocated)
    mirror_from: MirrorSource | None = None   # the dead rank's sharded state: fetched from this mirror


@dataclass(frozen=True)
class Light(Message):
    """Unplanned swap: the dead rank's light snapshot (RNG, step, per-rank objects), base64."""

    KIND: ClassVar[str] = "light"
    data: str
    step: int | None = None


@dataclass(frozen=True)
class Reserve(Message):
    """An idle spare pre-faults a receive arena of ``nbytes`` (no reply)."""

    KIND: ClassVar[str] = "reserve"
    nbytes: int


@dataclass(frozen=True)
class Abort(Message):
    """A spare drops an assignment (the swap was given up)."""

    KIND: ClassVar[str] = "abort"


@dataclass(frozen=True)
class AbortJoin(Message):
    """Give up the world being re-formed (a rank died on its way into it): a rank stays at its resume step, a
    joiner keeps the state it received, both without a process group, for the recovery that replaces the dead
    rank. Answered by a :class:`Reformed` with ``ok=False`` (from a worker that was still joining)."""

    KIND: ClassVar[str] = "abort_join"
    prefix: str = ""                  # the given-up world's store prefix (a late one never stops the next join)


@dataclass(frozen=True)
class ShardRollback(Message):
    """A survivor loads its own local copy of ``step``'s start (sharded state; the dead rank's newest mirrored
    shard is older than where the survivors stopped). Answered by :class:`ShardRolledBack`."""

    KIND: ClassVar[str] = "shard_rollback"
    step: int


@dataclass(frozen=True)
class MirrorInfo(Message):
    """The answer to :class:`MirrorInfoRequest`: where this rank's redundant copies go (its node's buddy mirror,
    None without one) and its own node's mirror, each a ``tpassrun.mirror.MirrorTarget`` as JSON."""

    KIND: ClassVar[str] = "mirror_info"
    buddy: dict[str, Any] | None = None
    local: dict[str, Any] | None = None


@dataclass(frozen=True)
class CatchUp(Message):
    """A mixed commit (a survivor failed inside step ``step - 1`` that others completed): listen (reply
    ``Listening``) for a survivor that completed it, receive its replicated state (model, optimizer, schedulers:
    reply ``Received``), load it; at ``Reform`` resume at ``step`` from this rank's own seal of ``step`` (its
    per-rank state, sealed before it contributed to the step's all-reduce)."""

    KIND: ClassVar[str] = "catch_up"
    swap_id: str
    key: str                          # hex: this attempt's transfer key; a sender that cannot prove it is dropped
    rank: int                         # this rank (the sender proves the key for it)
    listen_host: str
    step: int                         # the step everyone resumes at
    timeout: float = 120.0
    accept_timeout: float = 120.0
    attempt: int = 0                  # the swap's attempt: every reply names it


@dataclass(frozen=True)
class Break(Message):
    """Sent on a worker's *watch* connection (never the command one): a node this rank shares collectives with
    was declared lost, and a collective blocked on it may never fail by itself (a partition resets nothing):
    shut this process's process-group sockets now, so the step fails and the recovery can go on."""

    KIND: ClassVar[str] = "break"
    reason: str = ""


# worker -> agent: replies and news
@dataclass(frozen=True)
class Watch(Message):
    """The first line of a worker's second connection, its *watch* connection: a thread of the worker blocks
    on it (costing nothing per step) for a :class:`Break`."""

    KIND: ClassVar[str] = "watch"
    pid: int


@dataclass(frozen=True)
class Hello(Message):
    KIND: ClassVar[str] = "hello"
    pid: int
    spare: bool = False


@dataclass(frozen=True)
class Done(Message):
    KIND: ClassVar[str] = "done"
    step: int


@dataclass(frozen=True)
class Failed(Message):
    """A collective failed at ``step``; the worker waits for ``Reform`` or ``Raise``.

    ``error_type`` is the exception's qualified class name (e.g. ``torch.distributed.DistNetworkError``): the
    typed signal failure classification uses, instead of guessing from the message text."""

    KIND: ClassVar[str] = "failed"
    step: int
    error: str = ""
    error_type: str = ""
    failure: str = ""                 # the worker's StepFailure value (dist_error, collective, backward)


@dataclass(frozen=True)
class Raised(Message):
    """Step ``step`` raised an exception the worker cannot prove distributed (``error_type``: its qualified class
    name). The worker is parked PENDING, its collectives still open, until the agent writes its ``Verdict`` into
    the shared-memory field VERDICT: a casualty of a peer's failure, or its own error."""

    KIND: ClassVar[str] = "raised"
    step: int
    error: str = ""
    error_type: str = ""


@dataclass(frozen=True)
class Replicas(Message):
    """Declared once by a framework adapter (``Session.declare_replicas``): the ranks, this one included, that
    hold exactly this rank's model and optimizer state (its replica group under HSDP; itself alone under pure
    FSDP or ZeRO >= 1). An unplanned recovery of this rank takes its state from one of them; ``alone`` says why
    no other rank holds it. The slot table keeps it; no reply."""

    KIND: ClassVar[str] = "replicas"
    ranks: tuple[int, ...]
    alone: str = ""


@dataclass(frozen=True)
class ReplicasChecked(Message):
    """Said by rank 0 of a re-formed world at its first step (``tpassrun/worker/replicas.py``): whether the ranks that
    must hold identical state do, by an exact digest of it (``tpassrun/worker/digest.py``). ``action``: "" (they agree),
    "repair" (``differ``: rank -> the tensors that differ and the rank it takes its state from), "restart"
    (``detail``: why no replica can be trusted); ``recheck``: the check after a repair. No reply: the agent logs
    it, and restarts the group on "restart"."""

    KIND: ClassVar[str] = "replicas_checked"
    step: int
    ok: bool
    action: str = ""
    ranks: int = 0                  # ranks compared (in replica groups of 2 or more)
    groups: int = 0
    nbytes: int = 0                 # tensor bytes rank 0 digested
    seconds: float = 0.0            # ... in this long
    differ: dict[str, Any] = dataclasses.field(default_factory=dict)
    detail: str = ""
    recheck: bool = False


@dataclass(frozen=True)
class Listening(Message):
    KIND: ClassVar[str] = "listening"
    port: int
    swap_id: str = ""
    attempt: int = 0


@dataclass(frozen=True)
class Received(Message):
    KIND: ClassVar[str] = "received"
    ok: bool
    swap_id: str = ""
    attempt: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    checksum: str = ""
    error: str = ""
    step: int | None = None           # the step of the state received (checked against the swap's boundary)
    mirrored: bool = False            # the dead rank's sharded state came from its mirror too


@dataclass(frozen=True)
class Stranger(Message):
    """A connection to the joiner's listener that could not prove the key was dropped (it keeps listening)."""

    KIND: ClassVar[str] = "stranger"
    swap_id: str = ""
    attempt: int = 0
    error: str = ""


@dataclass(frozen=True)
class LightOk(Message):
    KIND: ClassVar[str] = "light_ok"
    ok: bool
    nbytes: int = 0
    step: int = 0


@dataclass(frozen=True)
class ShardRolledBack(Message):
    KIND: ClassVar[str] = "shard_rolled_back"
    ok: bool
    step: int
    error: str = ""


@dataclass(frozen=True)
class MirrorInfoRequest(Message):
    """Where do my copies go? Answered by :class:`MirrorInfo` (the same kind, the other direction)."""

    KIND: ClassVar[str] = "mirror_info"


@dataclass(frozen=True)
class Reformed(Message):
    KIND: ClassVar[str] = "reformed"
    ok: bool = True
    rank: int | None = None
    world_size: int | None = None
    generation: int | None = None
    error: str = ""
    leave_s: float | None = None
    join_s: float | None = None
    callbacks_s: float | None = None

    def timings(self) -> dict[str, float]:
        return {k: v for k, v in (("leave_s", self.leave_s), ("join_s", self.join_s),
                                  ("callbacks_s", self.callbacks_s)) if v is not None}


Command = Union[Resume, SendState, Reform, Exit, Raise, Assign, Light, Reserve, Abort, ShardRollback, MirrorInfo,
                Break, CatchUp, AbortJoin]
Reply = Union[Hello, Done, Failed, Raised, Replicas, Listening, Received, Stranger, LightOk, Reformed, ShardRolledBack,
              MirrorInfoRequest, Watch, ReplicasChecked]
COMMANDS: dict[str, type[Message]] = {c.KIND: c for c in (Resume, SendState, Reform, Exit, Raise, Assign, Light,
                                                             Reserve, Abort, ShardRollback, MirrorInfo, Break,
                                                             CatchUp, AbortJoin)}
REPLIES: dict[str, type[Message]] = {c.KIND: c for c in (Hello, Done, Failed, Raised, Replicas, Listening, Received,
                                                            Stranger, LightOk, Reformed, ShardRolledBack,
                                                            MirrorInfoRequest, Watch, ReplicasChecked)}

# --------------------------------------------------------------------------------------------- encoding

def encode(msg: Message, *, slot: int | None = None) -> bytes:
    doc: dict[str, Any] = {"kind": msg.KIND}
    if slot is not None:
        doc["slot"] = slot
    doc.update(schema.dump(msg))
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def decode(line: bytes | str, table: Mapping[str, type[Message]]) -> tuple[Message, int | None]:
    """One channel line -> (message of ``table``, the sender's slot if it said so). Raises :class:`ProtocolError`."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"not JSON: {line!r:.80}") from exc
    if not isinstance(doc, dict) or doc.get("kind") not in table:
        raise ProtocolError(f"unknown channel message: {line!r:.80}")
    slot = doc.get("slot")
    return schema.load(table[doc["kind"]], doc), slot if isinstance(slot, int) and not isinstance(slot, bool) else None


def decode_command(line: bytes | str) -> Message:
    """The worker's side: one line from its agent -> a :data:`Command`."""
    return decode(line, COMMANDS)[0]


def decode_reply(line: bytes | str) -> tuple[Reply, int | None]:
    """The agent's side: one line from a worker -> (a :data:`Reply`, the worker's slot if it said so)."""
    msg, slot = decode(line, REPLIES)
    return cast("Reply", msg), slot


__all__ = ["Abort", "AbortJoin", "Assign", "Break", "COMMANDS", "CatchUp", "Command", "Done", "Exit", "Failed",
           "Hello", "Light", "LightOk",
           "Listening", "Message", "MirrorInfo", "MirrorInfoRequest", "ProtocolError", "REPLIES", "Raise",
           "MirrorSource", "Received",
           "Reform", "Reformed", "Replicas", "ReplicasChecked", "Reply", "ShardRollback", "ShardRolledBack",
           "Reserve", "Resume", "SendState", "Stranger", "Watch", "WorldSpec", "decode",
           "decode_command", "decode_reply", "encode"]
