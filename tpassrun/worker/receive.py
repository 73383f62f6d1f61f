"""The receiving end of a state transfer, a joiner's (``Assign``, :mod:`tpassrun.worker.spare`) and a survivor's
catching up across a mixed commit (``CatchUp``, :mod:`tpassrun.worker.catchup`): waiting for the sender the agent
announced behind the handshake gate, the swap's transfer key, and reading a received bundle piece by piece (the
joiner loads each object as the script tracks it).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from tpassrun.channel import Light, Message, Received, Reserve, Stranger
from tpassrun.transfer import Throttle, held_note
from tpassrun.worker.link import AgentLink

log = logging.getLogger("tpassrun.worker")
_STRANGER_LINES = Throttle()     # a flood of strangers: one warning line per source a minute, with the count


def _next_command(link: AgentLink, pending: list[Message]) -> bool:
    """While a joiner waits for its sender: take the agent's commands that are there. False once one came that
    ends the wait (it is appended to ``pending`` for the dispatcher); the unplanned swap's ``Light`` arrives while
    the donor streams and is kept in ``pending``, answered after the state, in the order the agent expects."""
    while link.waiting():
        msg = link.recv()
        if isinstance(msg, Reserve):
            continue   # too late to pre-fault for this transfer
        pending.append(msg)
        if not isinstance(msg, Light):
            return False
    return True


def _receive_state(listener: socket.socket, link: AgentLink, msg: Any, auth: Any, pending: list[Message],
                   reply: bool = True) -> tuple[Any, Any] | None:
    """Wait for the sender the agent announced and receive its state, and the dead rank's mirrored shard when
    the assignment names one: (bundle, (shard bundle, light) or None); None if none came, or it failed.
    Every connection's handshake runs at once, each within its own deadline (:class:`~tpassrun.transfer.gate.
    HandshakeGate`): a stranger that connects first, says nothing or drips its proof a byte at a time neither
    delays the sender nor gets anything applied; each one dropped is reported (``Stranger``). The wait stays
    responsive: an abort or a new assignment is served at once, not after the accept timeout. ``msg``: an
    ``Assign`` (or a survivor's ``CatchUp``, with ``reply=False``: then (bundle, transfer stats), and the caller
    says Received once it checked and loaded the state). Every reply names the swap and its attempt."""
    from tpassrun.transfer import HandshakeGate, encryption_wanted, handoff, listener_flags

    swap_id, attempt = msg.swap_id, msg.attempt
    accept_s = float(msg.accept_timeout)
    max_bytes = getattr(msg, "max_bytes", None) or None
    deadline = time.monotonic() + accept_s
    strangers = 0
    encrypted = encryption_wanted()    # the run's --rdzv-conf encrypt=true: the hello says so, the stream is sealed
    with HandshakeGate(listener, auth, listener_flags(encrypted), watch=(link.sock,)) as gate:
        while True:
            if not _next_command(link, pending):
                return None   # an abort or a new assignment came first: the dispatcher handles it
            left = deadline - time.monotonic()
            if left <= 0:
                link.send(Received(ok=False, swap_id=swap_id, attempt=attempt, error=f"HandoffError: no sender "
                                   f"connected within {accept_s} s" + (f" ({strangers} unauthenticated connections "
                                                                        "dropped)" if strangers else "")))
                return None
            proved = gate.poll(left)
            for source, why in gate.take_dropped():
                strangers += 1
                held = _STRANGER_LINES.check(source)
                if held is not None:
                    log.warning("spare: dropped a connection from %s that did not prove the swap key: %s%s", source,
                                why, held_note(held, _STRANGER_LINES.window))
                link.send(Stranger(swap_id=swap_id, attempt=attempt, error=f"{source}: {why}"[:200]))
            if proved is not None:
                break
    with proved.sock as conn:
        conn.settimeout(float(msg.timeout))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            bundle, stats = handoff.recv_bundle(conn, mac=proved.mac, max_bytes=max_bytes, encrypt=encrypted)
        except (OSError, handoff.HandoffError) as exc:
            link.send(Received(ok=False, error=f"{type(exc).__name__}: {exc}"[:300], swap_id=swap_id,
                               attempt=attempt))
            return None
        extra = bundle.meta.get("extra")
        sent_for = extra.get("swap_id") if isinstance(extra, dict) else None
        if sent_for != swap_id:   # authenticated, so a bug rather than an attack: still never apply it
            link.send(Received(ok=False, swap_id=swap_id, attempt=attempt,
                               error=f"HandoffError: the state is for swap {sent_for!r}, not {swap_id!r}"))
            return None
        if not reply:
            return bundle, stats
        mirrored, nbytes = None, stats.nbytes
        if msg.mirror_from is not None:
            # the dead rank's sharded state is in its buddy's mirror, not on any live rank (tpassrun/worker/shards.py)
            source = msg.mirror_from
            try:
                from tpassrun.worker.shards import fetch_mirrored

                shard, shard_light, _ = fetch_mirrored(source.target, source.owner, source.step)
            except Exception as exc:  # noqa: BLE001 - reported: the agent retries or gives the recovery up
                link.send(Received(ok=False, swap_id=swap_id, attempt=attempt,
                                   error=f"fetching rank {source.owner}'s shard of step {source.step} from its "
                                         f"mirror failed: {type(exc).__name__}: {exc}"[:300]))
                return None
            mirrored, nbytes = (shard, shard_light), nbytes + shard.nbytes
        link.send(Received(ok=True, nbytes=nbytes, seconds=stats.seconds, checksum=stats.checksum,
                           swap_id=swap_id, attempt=attempt, step=_bundle_step(bundle), mirrored=mirrored is not None))
        return bundle, mirrored


def _transfer_auth(key: str, swap_id: str, rank: int) -> Any:
    """The swap's transfer key and identity from the agent's command (never from the network): a transfer
    without one is refused on both ends."""
    from tpassrun.transfer import handoff

    try:
        return handoff.TransferAuth(bytes.fromhex(key), swap_id, rank)
    except (TypeError, ValueError) as exc:
        raise handoff.HandoffError(f"the agent gave no usable transfer key for this swap ({exc})") from exc


# --- reading a received bundle piece by piece (the joiner loads each object as the script tracks it) ---

def _object_names(bundle: Any) -> list[str]:
    return sorted(bundle.meta.get("objects", {}))


def _has_object(bundle: Any, name: str) -> bool:
    return name in bundle.meta.get("objects", {})


def _apply_one(bundle: Any, name: str, obj: Any) -> None:
    from tpassrun.transfer import decode_tree

    obj.load_state_dict(decode_tree(bundle.meta["objects"].pop(name), bundle.tensors))


def _bundle_rng(bundle: Any) -> Any:
    from tpassrun.transfer import decode_tree

    tree = bundle.meta.get("rng")
    return None if tree is None else decode_tree(tree, bundle.tensors)


def _bundle_step(bundle: Any) -> int:
    return int(bundle.meta.get("step", 0)) if bundle is not None else 0
