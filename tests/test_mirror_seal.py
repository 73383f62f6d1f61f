"""Mirror traffic under ``--rdzv-conf encrypt=true`` (issue 27 item 8, tpassrun/mirror/seal.py).

Before, a run that asked for encryption had its state transfers sealed but its mirror snapshots (light snapshots
pushed to the buddy, sharded state mirrored by the workers, copies read back by a joiner) travelled authenticated
and in clear: the tensor bytes were readable in a capture. Now a mirror server whose run encrypts says so in its
hello and every frame both ways has its meta and payload under AES-256-GCM; a client whose run encrypts sends
nothing to a server that would not decrypt. Real sockets, with a recording relay between the ends (what a
capture sees), and the real server on its own event loop as in an agent.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from typing import Any

import pytest
from netrelay import pump
from test_mirror import _Served as _Base

from tpassrun import mirror as M
from tpassrun.mirror import net as N
from tpassrun.mirror.client import PushStream
from tpassrun.mirror.seal import PAYLOAD_AEAD, FrameSeal
from tpassrun.transfer.auth import ACCEPT, FLAG_ENCRYPT, HELLO, ConnectorHandshake, TransferAuth

pytestmark = pytest.mark.timeout(60)
pytest.importorskip("cryptography", reason="the 'encrypt' extra (cryptography >= 44)")

KEY = b"m" * 32
MARK = b"TPASSRUN-MIRROR-PLAINTEXT!"       # a payload made of it is easy to find in a capture
KIND = "shard/secret-kind-name"


class _Served(_Base):
    """A MirrorServer on its own event loop thread (as in an agent) behind a relay that records both directions."""

    def __init__(self, encrypt: bool) -> None:
        super().__init__(key=KEY, run_id="run-e", encrypt=encrypt)
        self.captured = bytearray()
        self._lock = threading.Lock()
        self.front = socket.socket()
        self.front.bind(("127.0.0.1", 0))
        self.front.listen(8)
        self.port = self.front.getsockname()[1]
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        while True:
            try:
                conn, _ = self.front.accept()
            except OSError:
                return
            back = socket.create_connection(("127.0.0.1", self.server.port))
            threading.Thread(target=pump, args=(back, conn, self._record), daemon=True).start()
            threading.Thread(target=pump, args=(conn, back, self._record), daemon=True).start()

    def _record(self, data: bytes) -> None:
        with self._lock:
            self.captured.extend(data)

    def seen(self, needle: bytes) -> bool:
        with self._lock:
            return needle in self.captured

    def client(self, encrypt: bool | None = None) -> M.MirrorClient:
        return M.MirrorClient("127.0.0.1", self.port, KEY, run_id="run-e", timeout=5, encrypt=encrypt)

    def close(self) -> None:
        self.front.close()
        super().close()


@pytest.fixture
def sealed():
    s = _Served(encrypt=True)
    yield s
    s.close()


@pytest.fixture
def clear():
    s = _Served(encrypt=False)
    yield s
    s.close()


def _wait(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 20
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_every_request_and_answer_is_ciphertext_on_the_wire_and_round_trips(sealed):
    big = MARK * 200_000                                    # ~5 MB: decrypted off the server's event loop
    with sealed.client() as c:
        assert c._seals is not None
        assert c.put(1, KIND, 7, [memoryview(MARK * 1000)[:13_000], memoryview(MARK * 1000)[13_000:]], epoch=2)
        assert c.put(2, KIND, 1, big)
        assert c.get(1, KIND).data == MARK * 1000 and c.get(2, KIND, 1).data == big
        assert c.get(3, KIND) is None
        assert c.versions(1, KIND) == (7,)
        for owner in range(10, 300):                        # a LIST answer over 64 KiB of JSON (its long form)
            c.put(owner, "k" * 250, 1, b"x")
        assert len(c.list()) == 292
        assert c.drop(owner=2) == len(big)
    assert sealed.call(lambda: sealed.store.nbytes) == 26_000 + 290
    assert len(sealed.captured) > len(big) + 26_000
    assert not sealed.seen(MARK[:16]) and not sealed.seen(KIND.encode()) and not sealed.seen(b'"owner"')


def test_pushed_snapshots_are_ciphertext_too(sealed):
    stream = PushStream("127.0.0.1", sealed.port, KEY, run_id="run-e").connect()
    try:
        assert stream._seal is not None
        for version in range(3):
            assert stream.push(5, "light", version, 0, MARK * 400) is None
        _wait(lambda: sealed.call(lambda: sealed.server.puts) == 3, "the pushes never landed")
    finally:
        stream.close()
    assert sealed.call(lambda: sealed.store.get(5, "light").data) == MARK * 400
    assert not sealed.seen(MARK[:16]) and not sealed.seen(b'"light"')


def test_without_encryption_the_capture_shows_the_bytes(clear):
    """What the issue found (a run that does not encrypt): authenticated, readable."""
    with clear.client(encrypt=False) as c:
        assert c._seals is None
        c.put(1, KIND, 1, MARK * 10)
    assert clear.seen(MARK)


def test_a_client_whose_run_encrypts_sends_nothing_to_a_server_in_clear_and_a_clear_one_follows(clear, sealed):
    with pytest.raises(M.MirrorError, match="does not decrypt"):
        clear.client(encrypt=True).put(1, KIND, 1, MARK * 10)
    with pytest.raises(M.MirrorError, match="does not decrypt"):
        PushStream("127.0.0.1", clear.port, KEY, run_id="run-e", encrypt=True).connect()
    assert not clear.seen(MARK) and clear.call(lambda: clear.store.nbytes) == 0
    with sealed.client(encrypt=False) as c:                 # the server's run encrypts: the client follows it
        assert c.put(1, KIND, 1, MARK * 10)
    assert not sealed.seen(MARK[:16])
    target = M.MirrorTarget("n", "127.0.0.1", 1, KEY, "run-e", 3, encrypt=True)
    assert M.MirrorTarget.from_json(target.to_json()) == target and target.client().encrypt


def _raw_sealed(served: _Served) -> tuple[socket.socket, FrameSeal]:
    s = socket.create_connection(("127.0.0.1", served.port), timeout=5)
    shake = ConnectorHandshake(TransferAuth(KEY, "run-e", -1, purpose="mirror"))
    hello = s.recv(HELLO.size)
    assert struct.unpack("<4sHH32s", hello)[2] & FLAG_ENCRYPT
    s.sendall(shake.prove(hello))
    return s, FrameSeal(shake.verify(s.recv(ACCEPT.size)), b"C")


def _put_frame(seal: FrameSeal, seq: int, payload: bytes, flags: int = PAYLOAD_AEAD) -> bytearray:
    meta = b'{"owner":4,"kind":"light","version":11,"epoch":0}'
    head = struct.pack("<4sBBHQQ", b"TPMR", N.OP_PUT, flags, len(meta), len(payload), seq)
    return bytearray(b"".join(seal.seal(head, meta, [payload])))


@pytest.mark.parametrize("where", ["payload", "tag", "meta", "head"])
def test_a_tampered_sealed_frame_is_refused_and_nothing_kept(sealed, where):
    s, seal = _raw_sealed(sealed)
    frame = _put_frame(seal, 0, MARK * 4)
    at = {"payload": len(frame) - 20, "tag": len(frame) - 1, "meta": 30, "head": 6}[where]   # head: the flags byte
    frame[at] ^= 0x01
    s.sendall(frame)
    assert s.recv(100) == b""                               # dropped, no answer
    s.close()
    with sealed.client() as c:
        assert c.get(4, "light") is None
    assert sealed.call(lambda: sealed.store.reserved) == 0


def test_a_replayed_frame_and_a_frame_in_clear_are_refused(sealed):
    s, seal = _raw_sealed(sealed)
    frame = _put_frame(seal, 0, MARK * 4)
    s.sendall(frame)
    reply = s.recv(N._HEAD.size)
    assert N._HEAD.unpack(reply)[2] == N.OK
    s.recv(1 << 16)                                         # the sealed answer's meta and (empty) payload
    s.sendall(frame)                                        # the same frame again: its sequence number is stale
    while s.recv(1 << 16):
        pass
    s.close()
    s, _seal = _raw_sealed(sealed)
    meta = b'{"owner":6,"kind":"light","version":1,"epoch":0}'
    s.sendall(struct.pack("<4sBBHQQ", b"TPMR", N.OP_PUT, 0, len(meta), 4, 0) + meta + b"data" + b"\0" * 32)
    assert s.recv(100) == b""
    s.close()
    with sealed.client() as c:
        assert c.versions(4, "light") == (11,) and c.get(6, "light") is None
