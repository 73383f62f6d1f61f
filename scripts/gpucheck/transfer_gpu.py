"""The transfer row of ``scripts/gpu_check.sh``: 1 GiB of GPU state to another process's GPU through the
handoff (what a swap's joiner receives: device-to-host, authenticated TCP, host-to-device), against torch's
own device copy and raw loopback TCP of as many bytes.

The receiver is this file run as a child (``--receive``), in the check's process group. The data is
verified: the sender puts an integer checksum of every tensor in the bundle, the receiver recomputes it on
its GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

import torch

TENSORS = 16
KEY_ENV = "GPUCHECK_TRANSFER_KEY"
CHUNK = 8 << 20


class Blob:
    """A Stateful holding the tensors as they are (a model's parameters would do the same)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return {f"t{i}": t for i, t in enumerate(self.tensors)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensors = list(state.values())


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    return [int(t.view(torch.int32).sum(dtype=torch.int64)) for t in tensors]


def _auth() -> Any:
    from tpassrun.transfer.handoff import TransferAuth

    return TransferAuth(bytes.fromhex(os.environ[KEY_ENV]), "gpucheck-transfer", 0)


def receive(device: str, nbytes: int, ports_file: str) -> None:
    from tpassrun.transfer.handoff import accept_and_recv, decode_tree, listen_for_bundle

    if device != "cpu":                                 # (cpu: the harness's rehearsal)
        torch.cuda.set_device(torch.device(device))
    torch.empty(1, device=device)                       # the CUDA context exists before anything is timed
    raw = socket.create_server(("127.0.0.1", 0))
    listener, port = listen_for_bundle("127.0.0.1")
    with open(ports_file + ".tmp", "w") as fh:
        json.dump({"raw": raw.getsockname()[1], "handoff": port}, fh)
    os.rename(ports_file + ".tmp", ports_file)
    buffer = bytearray(nbytes)
    view = memoryview(buffer)
    conn, _ = raw.accept()
    with conn:
        got = 0
        while got < nbytes:
            n = conn.recv_into(view[got:got + CHUNK])
            if n == 0:
                raise SystemExit("raw sender went away")
            got += n
        conn.sendall(b"k")
    del buffer, view
    bundle, _stats = accept_and_recv(listener, timeout=60, device=device, auth=_auth())
    _sync(device)
    done = time.time()
    state = decode_tree(bundle.meta["objects"]["blob"], bundle.tensors)
    tensors = list(state.values())
    sums = decode_tree(bundle.meta["extra"], bundle.tensors)["sums"]
    print(json.dumps({"done": done, "on": str(tensors[0].device),
                      "exact": checksums(tensors) == sums and all(str(t.device) == device for t in tensors)}),
          flush=True)


def measure(ctx: Any, nbytes: int) -> dict[str, Any]:
    """Returns GB/s figures: ``handoff`` (GPU to GPU, two processes), ``device`` (torch), ``tcp`` (raw)."""
    from support import Failed, until

    from tpassrun.transfer.handoff import capture, connect_and_send

    source = "cpu" if ctx.rehearse else "cuda:0"
    target = "cpu" if ctx.rehearse else "cuda:1" if ctx.gpus >= 2 else "cuda:0"
    ports_file = os.path.join(ctx.dir, "ports.json")
    env = {**os.environ, KEY_ENV: os.urandom(32).hex()}
    receiver = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--receive", "--device", target,
                                 "--nbytes", str(nbytes), "--ports-file", ports_file],
                                env=env, stdout=subprocess.PIPE, text=True)
    try:
        os.environ[KEY_ENV] = env[KEY_ENV]
        per = nbytes // TENSORS // 4
        gen = torch.Generator(device=source).manual_seed(29)
        tensors = [torch.randn(per, device=source, generator=gen) for _ in range(TENSORS)]
        _sync(source)
        t0 = time.perf_counter()
        copies = [t.to(target) if target != source else t.clone() for t in tensors]
        _sync(target)
        device_s = time.perf_counter() - t0
        del copies
        ports = until(lambda: _read_json(ports_file) or receiver.poll() is not None, 60, "the receiver to listen")
        if not isinstance(ports, dict):
            raise Failed(f"the receiver exited {receiver.returncode} before listening")
        payload = memoryview(bytearray(nbytes))
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", ports["raw"]), timeout=60) as sock:
            for offset in range(0, nbytes, CHUNK):
                sock.sendall(payload[offset:offset + CHUNK])
            if sock.recv(1) != b"k":
                raise Failed("the raw TCP receiver did not confirm")
        tcp_s = time.perf_counter() - t0
        del payload
        bundle = capture({"blob": Blob(tensors)}, step=0, extra={"sums": checksums(tensors)})
        started = time.time()
        connect_and_send("127.0.0.1", ports["handoff"], bundle, timeout=60, auth=_auth())
        out, _ = receiver.communicate(timeout=60)
        if receiver.returncode != 0 or not out.strip():
            raise Failed(f"the receiver exited {receiver.returncode}")
        result = json.loads(out.strip().splitlines()[-1])
        if not result["exact"]:
            raise Failed(f"the state received on {result['on']} differs from what was sent")
        handoff_s = result["done"] - started
    finally:
        if receiver.poll() is None:
            receiver.kill()
            receiver.wait(10)
    gb = nbytes / 1e9
    where = f"{source} -> {target} of another process" + (" (one GPU)" if target == "cuda:0" else "")
    ctx.say(f"handoff {handoff_s:.2f} s, device copy {device_s:.3f} s, raw TCP {tcp_s:.2f} s for {gb:.2f} GB")
    return {"handoff": gb / handoff_s, "device": gb / device_s, "tcp": gb / tcp_s, "where": where}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize(device)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--receive", action="store_true", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--nbytes", type=int, required=True)
    parser.add_argument("--ports-file", required=True)
    a = parser.parse_args()
    receive(a.device, a.nbytes, a.ports_file)
