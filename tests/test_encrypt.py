"""Encryption on request (issue 27 item 8): ``--rdzv-conf encrypt=true`` puts state transfers under AES-256-GCM.

Before, model and optimizer state travelled authenticated but in clear: the raw tensor bytes were readable in a
capture. Now a run that asks for encryption has every worker's transfers encrypted (the head's meta and every
frame; the GCM tag is the frame's tag), both ends agree through the run's setting, and a sender of such a run
sends nothing to a receiver that would not decrypt. Tested on real sockets with a recording relay between the
ends (what a capture sees).
"""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from netrelay import pump

from tpassrun.launch.workerenv import check_encrypt_conf, encrypt_requested
from tpassrun.transfer.auth import AEAD_NAME, ChecksumError, FrameCipher
from tpassrun.transfer.handoff import StateBundle, TransferAuth, accept_and_recv, connect_and_send, listen_for_bundle
from tpassrun.transfer.wire import HandoffError

pytestmark = pytest.mark.timeout(300)

AUTH = TransferAuth(b"e" * 32, "s-enc", 1)
MARK = b"TPASSRUN-PLAINTEXT-MARK!"        # 24 bytes: a tensor made of it is easy to find in a capture


def _bundle() -> StateBundle:
    marked = torch.frombuffer(bytearray(MARK * 40000), dtype=torch.uint8)
    return StateBundle({"step": 5, "note": "meta-secret-NOTE"}, [marked, torch.arange(100_003, dtype=torch.float64)])


def _relay(target_port: int, captured: bytearray) -> tuple[socket.socket, int]:
    """A listener that forwards one connection to ``target_port``, recording what the sender sends."""
    front = socket.socket()
    front.bind(("127.0.0.1", 0))
    front.listen(1)

    def serve() -> None:
        conn, _ = front.accept()
        back = socket.create_connection(("127.0.0.1", target_port))
        threading.Thread(target=pump, args=(back, conn), daemon=True).start()
        pump(conn, back, captured.extend)

    threading.Thread(target=serve, daemon=True).start()
    return front, front.getsockname()[1]


def _transfer(send_encrypt: bool, recv_encrypt: bool, captured: bytearray) -> tuple[object, object]:
    listener, port = listen_for_bundle("127.0.0.1")
    front, front_port = _relay(port, captured)
    got: dict[str, object] = {}

    def receive() -> None:
        try:
            got["r"] = accept_and_recv(listener, timeout=60, auth=AUTH, encrypt=recv_encrypt)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            got["r"] = exc

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sent: object = connect_and_send("127.0.0.1", front_port, _bundle(), timeout=60, auth=AUTH,
                                        encrypt=send_encrypt, chunk_bytes=256 << 10)
    except HandoffError as exc:
        sent = exc
    thread.join(90)
    listener.close()
    front.close()
    return sent, got["r"]


def test_an_encrypted_transfer_shows_no_tensor_or_meta_bytes_to_a_capture_and_arrives_equal():
    captured = bytearray()
    sent, received = _transfer(True, True, captured)
    assert sent.checksum.startswith(AEAD_NAME + ":")
    bundle, _stats = received
    assert all(torch.equal(a, b) for a, b in zip(bundle.tensors, _bundle().tensors))
    assert bundle.meta["note"] == "meta-secret-NOTE"
    assert len(captured) > 960_000
    assert MARK not in captured and b"meta-secret-NOTE" not in captured


def test_without_encryption_the_capture_shows_the_bytes():
    """What the issue found (the run did not ask for encryption): authenticated, readable."""
    captured = bytearray()
    _sent, received = _transfer(False, False, captured)
    assert isinstance(received, tuple)
    assert MARK in captured


def test_both_ends_follow_the_run_and_a_sender_that_encrypts_never_sends_in_clear():
    captured = bytearray()
    sent, received = _transfer(True, False, captured)
    assert isinstance(sent, HandoffError) and "does not decrypt" in str(sent)
    assert MARK not in captured and not isinstance(received, tuple)
    captured.clear()
    sent, received = _transfer(False, True, captured)     # the receiver's run encrypts: the sender follows it
    assert isinstance(received, tuple) and MARK not in captured


def test_an_altered_encrypted_frame_is_refused():
    cipher = FrameCipher(b"k" * 32)
    out = bytearray(len(MARK) + 16)
    cipher.seal_into(3, b"label", MARK, out)
    plain = bytearray(len(MARK))
    cipher.open_into(3, b"label", out, plain)
    assert bytes(plain) == MARK
    for index, label, data in ((4, b"label", out), (3, b"other", out), (3, b"label", bytes([out[0] ^ 1]) + out[1:])):
        with pytest.raises(ChecksumError):
            cipher.open_into(index, label, data, bytearray(len(MARK)))


def test_the_rdzv_conf_setting():
    assert encrypt_requested({"encrypt": "true"}) and encrypt_requested({"encrypt": "1"})
    assert not encrypt_requested({}) and not encrypt_requested({"encrypt": "false"})
    assert check_encrypt_conf({"encrypt": "maybe"}, None) == "--rdzv-conf encrypt='maybe': expected true or false"
    assert "not installed" in check_encrypt_conf({"encrypt": "true"}, "the 'cryptography' package is not installed")
    assert check_encrypt_conf({"encrypt": "true"}, None) is None


@pytest.mark.e2e
def test_a_planned_swap_of_a_run_that_encrypts_is_encrypted_and_bit_exact(tmp_path, etcd_server, run_id,
                                                                          reference_run):
    """The whole path: ``--rdzv-conf encrypt=true`` on the agent, TPASSRUN_ENCRYPT in every worker, the leaver's
    state sealed to the joiner; the job ends equal to torchrun's (and its workers formed every world through the
    workers' store's authenticated door, tpassrun.store)."""
    from faults import Job, assert_bit_exact, faults_env, hold_at, taint

    baseline = reference_run(4, 40)
    hold = hold_at(str(tmp_path), 12)
    job = Job.tpassrun(str(tmp_path / "job"), endpoint=etcd_server.endpoint, run_id=run_id, nproc=4, spares=1,
                       steps=40, step_sleep=0.05, extra=["--rdzv-conf", "encrypt=true"],
                       env=faults_env(hold.fault)).start()
    try:
        hold.wait_reached(job)
        assert taint(etcd_server.endpoint, run_id, rank=1, reason="encrypted swap") == 0
        hold.release_after(job, "swap_boundary")
        assert job.wait(240) == 0, job.log()[-3000:]
    finally:
        job.kill()
    assert_bit_exact(job, baseline, 4)
    ends = [e for e in job.events() if e["event"] == "swap_transfer_end"]
    assert ends and all(e["checksum"].startswith(AEAD_NAME + ":") for e in ends), ends
