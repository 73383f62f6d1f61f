"""The local agent <-> worker channel.

Two parts, chosen so that a healthy rank pays nothing per step:

* a shared-memory file with one fixed 64-byte slot per local worker slot (active ranks and spares). The
  agent writes ``run_until`` there; the worker reads it once per step (an mmap load: no syscall, no
  network) and writes its step, phase and heartbeat back. Each slot also owns a small double-buffered area
  where the worker leaves its "light" state (RNG, data position) at every step start, so that if the worker
  dies mid-step its agent still holds what is needed to recover it bit-exact.
* a unix socket carrying JSON lines, used only when something happens: ``hello`` at start, commands while a
  worker is paused at a boundary, and the spare's assignment.

Both sides use :class:`ChannelFile` (:mod:`tpassrun.channel.shm`); what crosses the socket is declared, encoded and decoded in
:mod:`tpassrun.channel.protocol`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tpassrun.channel.failure import DETAIL_LOG, StepFailure, worker_log_file
from tpassrun.channel.protocol import (
    Abort,
    AbortJoin,
    Assign,
    Break,
    CatchUp,
    Command,
    Done,
    Exit,
    Failed,
    Hello,
    Light,
    LightOk,
    Listening,
    Message,
    MirrorInfo,
    MirrorInfoRequest,
    MirrorSource,
    ProtocolError,
    Raise,
    Raised,
    Received,
    Reform,
    Reformed,
    Replicas,
    ReplicasChecked,
    Reply,
    Reserve,
    Resume,
    SendState,
    ShardRollback,
    ShardRolledBack,
    Stranger,
    Watch,
    WorldSpec,
    decode_command,
    decode_reply,
    encode,
)
from tpassrun.channel.shm import (
    INT64_MAX,
    LIGHT_BYTES,
    SLOT_BYTES,
    SLOT_FIELDS,
    STOP_NOW,
    ChannelFile,
    Field,
    Verdict,
    WorkerPhase,
)

if TYPE_CHECKING:
    from tpassrun.channel.slots import LocalSlots, Slot, SlotState

# the agent's slot table, imported on first use: a worker enters by this door too and never needs it (nor the records it
# imports)
_LAZY = dict.fromkeys(("LocalSlots", "Slot", "SlotState"), "tpassrun.channel.slots")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = ["INT64_MAX", "LIGHT_BYTES", "SLOT_BYTES", "SLOT_FIELDS", "STOP_NOW", "ChannelFile", "Field", "Verdict",
           "WorkerPhase",
           # the messages (tpassrun.channel.protocol)
           "Abort", "AbortJoin", "Assign", "Break", "CatchUp", "Command", "Done", "Exit", "Failed", "Hello", "Light",
           "LightOk", "Listening", "Message", "MirrorInfo", "MirrorInfoRequest", "MirrorSource", "ProtocolError", "Raise",
           "Raised", "Received", "Reform", "Reformed", "Replicas", "ReplicasChecked", "Reply", "Reserve", "Resume",
           "SendState", "ShardRollback", "ShardRolledBack", "Stranger", "Watch", "WorldSpec", "decode_command",
           "decode_reply", "encode",
           # a failed step's kind and the worker's log file (tpassrun.channel.failure)
           "DETAIL_LOG", "StepFailure", "worker_log_file",
           # the agent's slot table (tpassrun.channel.slots)
           "LocalSlots", "Slot", "SlotState"]
