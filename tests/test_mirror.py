"""The mirror data plane (tpassrun/mirror/__init__.py): the store's rules, the authenticated server/client, the ring."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Any

import pytest

from tpassrun import mirror as M
from tpassrun.mirror import net as N
from tpassrun.transfer.auth import ACCEPT, HELLO, AuthError, ConnectorHandshake, TransferAuth

pytestmark = pytest.mark.timeout(60)

KEY = b"k" * 32


# ---------------------------------------------------------------------------------------------- store
def test_store_keeps_the_newest_two_versions_and_replaces_a_version_it_holds():
    s = M.MirrorStore(1 << 20)
    assert s.put(3, "light", 10, b"a" * 10)
    assert s.put(3, "light", 11, b"b" * 11)
    assert s.put(3, "light", 12, b"c" * 12)
    assert s.versions(3, "light") == (11, 12)
    assert not s.put(3, "light", 9, b"old")           # older than both: not kept
    assert s.versions(3, "light") == (11, 12)
    assert s.put(3, "light", 12, b"C" * 5)             # rewritten in place (a second backward re-seals)
    assert s.get(3, "light").data == b"C" * 5 and s.get(3, "light", 11).data == b"b" * 11
    assert s.get(3, "light", 10) is None and s.get(4, "light") is None
    assert s.nbytes == s.bytes_held() == 16 == s.bytes_held(owner=3, kind="light")
    assert s.usage() == [M.MirrorEntry(3, "light", 0, (11, 12), 16)]


def test_store_epochs_a_newer_one_replaces_an_older_one_is_refused():
    s = M.MirrorStore(1 << 20)
    s.put(1, "light", 5, b"x" * 8, epoch=1)
    s.put(1, "light", 6, b"x" * 8, epoch=1)
    assert s.put(1, "light", 0, b"y", epoch=2)         # a restart: step 0 of the new epoch
    assert s.versions(1, "light") == (0,) and s.get(1, "light").epoch == 2
    assert s.get(1, "light", epoch=1) is None and s.versions(1, "light", epoch=2) == (0,)
    with pytest.raises(M.MirrorFull, match="stale epoch"):
        s.put(1, "light", 7, b"z", epoch=1)
    assert s.nbytes == 1


def test_store_is_bounded_evicts_older_epochs_first_and_never_half_keeps():
    s = M.MirrorStore(100)
    s.put(1, "light", 1, b"a" * 40, epoch=1)
    s.put(2, "light", 1, b"b" * 40, epoch=2)
    s.put(3, "light", 1, b"c" * 40, epoch=2)          # evicts rank 1's epoch-1 copy
    assert [e.owner for e in s.usage()] == [2, 3] and s.nbytes == 80
    with pytest.raises(M.MirrorFull, match="does not fit"):
        s.put(4, "light", 1, b"d" * 40, epoch=2)
    assert s.nbytes == 80 and s.get(4, "light") is None
    assert s.put(2, "light", 1, b"B" * 50, epoch=2)   # replacing frees the old copy first: 90 fits
    assert s.put(2, "light", 2, b"e" * 10, epoch=2)
    assert s.nbytes == 100
    assert s.drop(owner=2) == 60 and s.nbytes == 40
    assert s.drop(below_epoch=3) == 40 and s.usage() == []


# ---------------------------------------------------------------------------------------------- ring
def test_buddy_ring_is_a_pure_function_of_the_members():
    assert M.buddy_ring(("a",)) == {} and M.copies_of("a", ("a",)) is None
    assert M.buddy_ring(("a", "b")) == {"a": "b", "b": "a"}
    assert M.buddy_ring(("a", "b", "c")) == {"a": "b", "b": "c", "c": "a"}
    assert M.ring_nodes(("a", "b", "c"), holders=("z", "b"), lost=("b",)) == ("a", "c", "z")
    assert M.copies_of("c", M.ring_nodes(("a", "b", "c"), lost=("a",))) == "b"


def test_the_mirror_key_is_drawn_once_per_run_and_shared():
    class FakeStore:
        def __init__(self) -> None:
            self.kv: dict[str, Any] = {}

        async def create_json(self, key: str, value: dict) -> bool:
            if key in self.kv:
                return False
            self.kv[key] = value
            return True

        async def get_json(self, key: str) -> tuple[Any, int]:
            return self.kv.get(key), 1

    store = FakeStore()
    a = asyncio.run(M.ensure_mirror_key(store, "/p/mirror_key"))
    b = asyncio.run(M.ensure_mirror_key(store, "/p/mirror_key"))
    assert a == b and len(a) == 32


# ---------------------------------------------------------------------------------------------- server
class _Served:
    """A MirrorServer on its own event loop thread (as in an agent), for blocking clients in the test."""

    def __init__(self, max_bytes: int = 1 << 26, max_item: int | None = None, *, key: bytes = KEY, run_id: str = "run-1",
                 encrypt: bool = False) -> None:
        self.store = M.MirrorStore(max_bytes)
        self.loop = asyncio.new_event_loop()
        self.server = M.MirrorServer(self.store, key, host="127.0.0.1", run_id=run_id, max_item_bytes=max_item,
                                     encrypt=encrypt)
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self.server.start())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()
        ready.wait(10)

    def call(self, fn: Any) -> Any:
        async def run() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(10)

    def client(self, key: bytes = KEY, run_id: str = "run-1") -> M.MirrorClient:
        return M.MirrorClient("127.0.0.1", self.server.port, key, run_id=run_id, timeout=5)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def served():
    s = _Served()
    yield s
    s.close()


def test_put_get_versions_list_drop_over_the_wire(served):
    with served.client() as c:
        assert c.put(2, "light", 7, b"seven", epoch=3)
        assert c.put(2, "light", 8, [b"ei", memoryview(b"ght")], epoch=3)   # pieces: sent as they are
        assert not c.put(2, "light", 1, b"old", epoch=3)
        item = c.get(2, "light")
        assert (item.version, item.epoch, item.data) == (8, 3, b"eight")
        assert c.get(2, "light", 7).data == b"seven" and c.get(2, "light", 1) is None
        assert c.get(2, "light", epoch=2) is None and c.get(5, "shard/opt") is None
        assert c.versions(2, "light") == (7, 8) and c.versions(9, "light") == ()
        assert c.list() == [M.MirrorEntry(2, "light", 3, (7, 8), 10)]
        assert c.drop(owner=2) == 10 and c.list() == []
    assert served.call(lambda: served.store.nbytes) == 0


def test_a_large_payload_streams_in_pieces_and_long_listings_fit(served):
    big = bytes(range(256)) * (40_000)                    # ~10 MB, several chunks, MAC off the loop
    with served.client() as c:
        assert c.put(0, "shard/opt", 1, [memoryview(big)[:3_000_001], memoryview(big)[3_000_001:]])
        assert c.get(0, "shard/opt").data == big
        for owner in range(1, 2000):                      # a LIST answer over 64 KiB of JSON
            c.put(owner, "light", 1, b"x")
        assert len(c.list()) == 2000
    assert served.server.bytes_in >= len(big)


def test_a_client_with_another_key_or_run_is_refused_and_gets_nothing(served):
    with served.client() as c:
        c.put(1, "light", 1, b"secret state")
    for key, run in ((b"x" * 32, "run-1"), (KEY, "run-2")):
        with pytest.raises(AuthError):
            served.client(key, run).connect()
    assert served.server.strangers == 2
    with served.client() as c:                            # still serving the job
        assert c.get(1, "light").data == b"secret state"


def test_a_stranger_gets_a_nonce_and_nothing_is_allocated_for_it(served):
    with socket.create_connection(("127.0.0.1", served.server.port), timeout=5) as s:
        hello = s.recv(HELLO.size)
        assert hello[:4] == b"TPNC"
        s.sendall(b"TPAU" + b"\0" * 64 + struct.pack("<4sBBHQQ", b"TPMR", 1, 0, 10, 1 << 40, 0))
        assert s.recv(100) == b""                          # dropped: no answer, no allocation
    assert served.server.strangers == 1 and served.call(lambda: served.store.reserved) == 0


def _raw_authenticated(served: _Served) -> tuple[socket.socket, Any]:
    s = socket.create_connection(("127.0.0.1", served.server.port), timeout=5)
    shake = ConnectorHandshake(TransferAuth(KEY, "run-1", -1, purpose="mirror"))
    s.sendall(shake.prove(s.recv(HELLO.size)))
    return s, shake.verify(s.recv(ACCEPT.size))


def test_a_writer_dying_mid_put_leaves_the_previous_version_intact(served):
    with served.client() as c:
        c.put(4, "light", 10, b"complete ten")
    s, base = _raw_authenticated(served)
    meta = b'{"owner":4,"kind":"light","version":11,"epoch":0}'
    s.sendall(struct.pack("<4sBBHQQ", b"TPMR", N.OP_PUT, 0, len(meta), 1000, 0) + meta + b"half" * 100)
    s.close()                                              # dies with 600 bytes and the tag missing
    with served.client() as c:
        assert c.versions(4, "light") == (10,) and c.get(4, "light").data == b"complete ten"
    assert served.call(lambda: served.store.reserved) == 0


def test_a_tampered_frame_is_not_kept(served):
    s, base = _raw_authenticated(served)
    meta = b'{"owner":4,"kind":"light","version":11,"epoch":0}'
    head = struct.pack("<4sBBHQQ", b"TPMR", N.OP_PUT, 0, len(meta), 5, 0)
    mac = N._mac_of(base, b"C", head, meta)
    mac.feed(b"hello")
    s.sendall(head + meta + b"jello" + mac.tag())          # one byte changed on the way
    assert s.recv(100) == b""
    s.close()
    with served.client() as c:
        assert c.get(4, "light") is None


def test_puts_carry_a_gmac_payload_tag_and_a_tampered_one_is_not_kept(served):
    with served.client() as c:                            # the server offered it: the client's PUTs use it
        assert c.put(3, "shard/state", 5, [b"fast ", memoryview(bytearray(b"tag"))])
        assert c._gmac and c.get(3, "shard/state").data == b"fast tag"
    s, base = _raw_authenticated(served)
    meta = b'{"owner":4,"kind":"light","version":11,"epoch":0}'
    head = struct.pack("<4sBBHQQ", b"TPMR", N.OP_PUT, N.PAYLOAD_GMAC, len(meta), 5, 0)
    tag = N._payload_tag(N._mac_of(base, b"C", head, meta), [b"hello"])
    s.sendall(head + meta + b"jello" + tag)               # one byte changed on the way
    assert s.recv(100) == b""
    s.close()
    with served.client() as c:
        assert c.get(4, "light") is None


def test_a_put_under_an_older_tpassruns_poly1305_tag_is_refused_and_not_kept(served):
    """Status byte 1 was the Poly1305 payload tag of tpassrun before issue 42: refused (BAD_REQUEST, one line)."""
    s, base = _raw_authenticated(served)
    meta = b'{"owner":4,"kind":"light","version":11,"epoch":0}'
    head = struct.pack("<4sBBHQQ", b"TPMR", N.OP_PUT, 1, len(meta), 5, 0)
    s.sendall(head + meta + b"hello" + bytes(32))
    reply = s.recv(4096)
    s.close()
    assert reply[:4] == b"TPMR" and reply[5] == N.BAD_REQUEST and b"older tpassrun's Poly1305 tag" in reply
    with served.client() as c:
        assert c.get(4, "light") is None


def test_a_put_over_the_bound_is_refused_whole_and_the_connection_goes_on():
    served = _Served(max_bytes=1000, max_item=600)
    try:
        with served.client() as c:
            c.put(1, "light", 1, b"a" * 500)
            with pytest.raises(M.MirrorFull, match="item limit"):
                c.put(2, "light", 1, b"b" * 700)
            with pytest.raises(M.MirrorFull, match="does not fit"):
                c.put(2, "light", 1, b"b" * 550)
            assert c.put(2, "light", 1, b"b" * 450)
            assert [e.owner for e in c.list()] == [1, 2]
    finally:
        served.close()


def test_a_client_reconnects_after_the_server_dropped_it(served):
    c = served.client().connect()
    c.put(1, "light", 1, b"one")
    assert c._sock is not None
    c._sock.close()                                        # the connection broke under it
    c._sock = socket.socket()
    with pytest.raises(M.MirrorError):
        c.get(1, "light")
    assert c.get(1, "light").data == b"one"               # the next call reconnects
    c.close()


# ---------------------------------------------------------------------------------------------- the light mirror
def _frame(tag: bytes) -> bytes:
    import zlib

    body = b"TPL1" + tag * 40
    return body + b"TPLE" + zlib.crc32(body).to_bytes(4, "little")


def test_light_frames_are_read_whole_or_not_at_all(tmp_path):
    from tpassrun.channel import ChannelFile, Field
    from tpassrun.swapper.mirrorplane import light_frame_ok, read_light_frames

    ch = ChannelFile.create(str(tmp_path / "chan"), 2)
    assert read_light_frames(ch, 0) == []
    ch.write_light(0, _frame(b"a"), 5)
    ch.write_light(0, _frame(b"b"), 6)
    assert read_light_frames(ch, 0) == [(5, _frame(b"a")), (6, _frame(b"b"))]
    assert light_frame_ok(_frame(b"x")) and not light_frame_ok(_frame(b"x")[:-1] + b"\0")
    ch.set(0, Field.LIGHT_STEP_1, -1)           # a buffer being written has no step: it is left out
    assert read_light_frames(ch, 0) == [(6, _frame(b"b"))]
    off = ch._light_offset(0, 0) + 8            # torn bytes under a published step: look again later
    ch._mm[off + 4] ^= 0xFF
    assert read_light_frames(ch, 0) is None
    ch.close()


def test_the_agent_pushes_what_changed_to_its_buddy_and_nothing_else(tmp_path):
    """MirrorPlane's pusher against a real channel file and a real buddy server (the agent's port faked)."""
    from types import SimpleNamespace

    from tpassrun.channel import ChannelFile
    from tpassrun.swapper.mirrorplane import LIGHT, MirrorPlane

    served = _Served()
    ch = ChannelFile.create(str(tmp_path / "chan"), 3)
    slots = [SimpleNamespace(index=i, rank=r, state=st, managed=True)
             for i, (r, st) in enumerate([(4, "running"), (None, "spare"), (5, "running")])]
    events: list[tuple[str, dict]] = []
    port = SimpleNamespace(node_id="a", addr="127.0.0.1", spawned_generation=lambda: 7, epoch=lambda: 7,
                           slots=SimpleNamespace(channel=ch, slots=slots),
                           events=SimpleNamespace(write=lambda e, **f: events.append((e, f))))
    plane = MirrorPlane(port, "run-1")       # type: ignore[arg-type]
    plane.key = KEY
    plane.buddy = M.MirrorTarget("b", "127.0.0.1", served.server.port, KEY, "run-1", 7)

    async def tick() -> None:
        batch = plane._changed_frames()
        if batch:
            await plane._push(batch)

    try:
        ch.write_light(0, _frame(b"a"), 10)
        ch.write_light(0, _frame(b"b"), 11)
        ch.write_light(2, _frame(b"c"), 10)
        asyncio.run(tick())
        assert plane.pushes == 3
        asyncio.run(tick())
        assert plane.pushes == 3                               # nothing changed: nothing sent
        ch.write_light(0, _frame(b"d"), 12)                    # rank 4's next step
        asyncio.run(tick())
        assert plane.pushes == 4
        ch.rewrite_light(0, _frame(b"e"), 12)                  # a later backward of the same step re-seals
        asyncio.run(tick())
        assert plane.pushes == 5
        with served.client() as c:
            assert c.versions(4, LIGHT) == (11, 12) and c.get(4, LIGHT).data == _frame(b"e")
            assert c.versions(5, LIGHT) == (10,) and c.get(5, LIGHT).epoch == 7
            assert c.list(kind=LIGHT) and {e.owner for e in c.list()} == {4, 5}
        assert plane.held([4, 5, 6]) == {}                     # this node's own store holds none of them
    finally:
        plane._close_client()
        ch.close()
        served.close()
