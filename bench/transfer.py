"""Handoff transfer benchmark: raw loopback TCP vs send_bundle/recv_bundle, and the light snapshot.

    python bench/transfer.py [--mb 300] [--rounds 3]
    python bench/transfer.py --auth-only [--rounds 5] [--pin auto|off|N]   # raw TCP vs the authenticated stream
    python bench/transfer.py --auth-only --serve [--bind ADDR] [--port P]   # host B: the receivers of --to
    python bench/transfer.py --auth-only --to B[:P] [--rounds 5]           # host A: the same table, across hosts

Prints, in one run:
  * raw TCP throughput: sendall / recv_into of one buffer between two processes;
  * handoff throughput: ``connect_and_send`` / ``accept_and_recv`` of a model + AdamW state of
    about the same size between two processes (checksummed, acknowledged, fresh receive tensors);
  * the same, authenticated as every transfer between processes is (handshake, a GMAC tag on every frame), into a
    spare's pre-faulted arena: what a swap actually pays;
  * their ratios to raw TCP (target >= 0.70), authenticated / checksummed, and CPU seconds per GB (both ends);
  * the same, encrypted (``encrypt=True``: ``--rdzv-conf encrypt=true``, AES-256-GCM frames), GB/s and CPU per GB;
  * ``capture_rng()`` + ``capture`` + ``encode_small`` per call (target < 100 us), with a breakdown.

``--auth-only [--chunk-mb 8] [--pin auto|off|N]``: raw TCP, the authenticated stream into a spare's arena (GMAC
frames, the one frame MAC), and the encrypted one (AES-256-GCM frames), alternating within each round (A/B/C,
A/B/C, ...): GB/s medians, the ratio to raw (target >= 0.9), CPU-s per GB both ends (median, best, the sender's
share), raw's CPU per GB over each one's (what the ratio would be if the cores were the limit), and the load
average. A receiver's CPU stops when it has the verified state (the joiner keeps it: freeing it is not the
transfer's).

``--pin``: each end on cores of its own (``sched_setaffinity``, what ``taskset -c`` does): the sender (this
process, with its MAC threads) on the first N of the cores it may use, every receiver on the next N, so the two ends
never compete for a core as they do unpinned on a small host. ``auto`` (the default): N = half the cores when there
are at least 4, else unpinned; ``N``: N cores per end (needs 2N; ``--pin 1`` on a 2-core host: one core each);
``off``: unpinned. The MAC threads follow the affinity (``tpassrun.transfer.seal.mac_threads``).

``--serve`` / ``--to``: the same ``--auth-only`` table between two hosts. Host B serves (one TCP port, default
29610: a control connection of JSON lines, then each round's transfers, one at a time); host A connects, proves the
bench key, and sends. B reports its own CPU seconds per transfer over the control connection. The key (>= 16
bytes) is read from ``$TPASSRUN_BENCH_KEY`` or from ``--key-file PATH`` on both hosts, never from the command line.

Raw and handoff rounds alternate so that background load hits both alike. The last line is JSON.
Figures only, no assertions: this is not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import hmac
import json
import multiprocessing as mp
import os
import resource
import socket
import statistics
import time
from typing import Any, Callable

import torch

from tpassrun.transfer.handoff import (
    TransferAuth,
    accept_and_recv,
    capture,
    capture_rng,
    connect_and_send,
    decode_small,
    encode_small,
    listen_for_bundle,
)
from tpassrun.transfer.wire import HandoffError, accept_one, reserve_receive_arena

CHUNK = 8 << 20


# ---------------------------------------------------------------------------------------------
# receivers (child processes)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def raw_receiver(nbytes: int, rounds: int, ports: Any) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ports.put(listener.getsockname()[1])
    buffer = bytearray(nbytes)  # touched once, reused: the best case for raw TCP
    view = memoryview(buffer)
    with listener:
        for _ in range(rounds):
            conn, _ = listener.accept()
            cpu_before = cpu_seconds()
            recv_raw(conn, view)
            ports.put(cpu_seconds() - cpu_before)


def recv_raw(conn: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``conn``, confirm, close."""
    with conn:
        got = 0
        while got < len(view):
            n = conn.recv_into(view[got:got + CHUNK])
            if n == 0:
                raise RuntimeError("sender went away")
            got += n
        conn.sendall(b"k")  # the sender's clock stops on this, as send_bundle's does on its ack


AUTH = TransferAuth(b"bench-transfer-key-0123456789abcdef", "s-bench", 1)


def bundle_receiver(rounds: int, arena_bytes: int, ports: Any, auth: bool = False, encrypt: bool = False) -> None:
    """``arena_bytes`` > 0: like a warm spare, fault in a receive arena before each transfer (not timed)."""
    listener, port = listen_for_bundle("127.0.0.1")
    ports.put(port)
    with listener:
        for _ in range(rounds):
            if arena_bytes:
                reserve_receive_arena(arena_bytes)
            cpu_before = cpu_seconds()
            bundle, _stats = accept_and_recv(listener, timeout=600, auth=AUTH if auth else None, encrypt=encrypt)
            ports.put(cpu_seconds() - cpu_before)   # the joiner keeps the state: freeing it is not the transfer's
            del bundle


def start_receiver(target: Callable, *args: Any, cores: list[int] | None = None, **kwargs: Any) -> tuple[Any, Any, int]:
    """A receiver in a process of its own (on ``cores`` only, when given: see ``--pin``)."""
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=_pinned, args=(target, cores, *args, ports), kwargs=kwargs, daemon=True)
    proc.start()
    return proc, ports, ports.get(timeout=600)


def _pinned(target: Callable, cores: list[int] | None, *args: Any, **kwargs: Any) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    target(*args, **kwargs)


def pin_plan(pin: str, cores: list[int]) -> tuple[list[int], list[int]] | None:
    """(the sender's cores, the receivers') for ``--pin`` over the ``cores`` this process may use; None: unpinned."""
    if pin == "off":
        return None
    if pin == "auto":
        per = len(cores) // 2 if len(cores) >= 4 else 0
    else:
        try:
            per = int(pin)
        except ValueError:
            raise BenchError(f"--pin {pin!r}: auto, off or a number of cores per end") from None
        if per < 1 or 2 * per > len(cores):
            raise BenchError(f"--pin {per}: needs {2 * per} cores, this process may use {len(cores)} ({cores})")
    return (cores[:per], cores[per:2 * per]) if per else None


# ---------------------------------------------------------------------------------------------
# senders (this process)


def send_raw(port: int, payload: memoryview, host: str = "127.0.0.1") -> float:
    started = time.perf_counter()
    with socket.create_connection((host, port)) as sock:
        for offset in range(0, len(payload), CHUNK):
            sock.sendall(payload[offset:offset + CHUNK])
        if sock.recv(1) != b"k":
            raise RuntimeError("raw receiver did not confirm")
    return time.perf_counter() - started


def model_and_optimizer(target_bytes: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A stack of 2048x2048 linears whose params + AdamW exp_avg + exp_avg_sq weigh ~target_bytes."""
    width = 2048
    layers = max(1, round(target_bytes / (12 * (width * width + width))))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # materialises exp_avg / exp_avg_sq / step
    for p in model.parameters():
        p.grad = None
    return model, opt


def per_call_us(fn: Callable[[], Any], calls: int = 2000, repeats: int = 5) -> tuple[float, float]:
    """(best, median) microseconds per call over ``repeats`` batches of ``calls``."""
    for _ in range(200):
        fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return min(samples), statistics.median(samples)


class Sampler:
    """A light object like the ones in the per-step snapshot: a position and an epoch."""

    def __init__(self) -> None:
        self.position, self.epoch = 1234, 2

    def state_dict(self) -> dict:
        return {"position": self.position, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.epoch = state["position"], state["epoch"]


# ---------------------------------------------------------------------------------------------
# across hosts: ``--serve`` on host B, ``--to B[:P]`` on host A


KEY_ENV = "TPASSRUN_BENCH_KEY"       # the bench's shared key (or --key-file PATH): never on a command line
SERVE_PORT = 29610                   # the one TCP port of --serve: the control connection, then every transfer
CONTROL_TIMEOUT_S = 600.0


class BenchError(Exception):
    """A one-line reason the bench cannot run (bad target, key, address, or the other end)."""


def parse_target(text: str, default_port: int = SERVE_PORT) -> tuple[str, int]:
    """``HOST``, ``HOST:PORT``, ``[V6]``, ``[V6]:PORT`` or a bare IPv6 address -> (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise BenchError(f"bad --to {text!r}: expected [IPV6] or [IPV6]:PORT")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, None   # a name, an IPv4 address, or a bare IPv6 address
    if not host:
        raise BenchError(f"bad --to {text!r}: no host (expected HOST[:PORT])")
    if port_text is None:
        return host, default_port
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise BenchError(f"bad --to {text!r}: the port must be a number in 1..65535")
    return host, int(port_text)


def read_key(key_file: str | None, environ: dict[str, str] | os._Environ[str] = os.environ) -> bytes:
    """The bench key: the file's bytes (a trailing newline dropped), else ``$TPASSRUN_BENCH_KEY``."""
    if key_file:
        try:
            with open(key_file, "rb") as f:
                key = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise BenchError(f"cannot read the key file {key_file}: {exc.strerror or exc}") from exc
        where = key_file
    else:
        key, where = environ.get(KEY_ENV, "").encode(), f"${KEY_ENV}"
        if not key:
            raise BenchError(f"no bench key: set ${KEY_ENV} or give --key-file PATH (the same key on both hosts)")
    if len(key) < 16:
        raise BenchError(f"the bench key in {where} is {len(key)} bytes: it needs at least 16")
    return key


def bench_auth(key: bytes) -> TransferAuth:
    return TransferAuth(key, "s-bench-hosts", 1)


def control_proof(key: bytes, nonce: bytes) -> str:
    return hmac.new(key, b"tpassrun-bench-transfer/" + nonce, hashlib.sha256).hexdigest()


class Control:
    """JSON lines over one TCP connection."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(CONTROL_TIMEOUT_S)
        self.sock, self.lines = sock, sock.makefile("rb")

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self) -> dict[str, Any]:
        line = self.lines.readline()
        if not line:
            raise BenchError("the other end closed the control connection")
        message = json.loads(line)
        if "error" in message:
            raise BenchError(f"the receiver host says: {message['error']}")
        return message

    def close(self) -> None:
        self.lines.close()
        self.sock.close()


class LocalReceivers:
    """Today's receivers: one child process per kind on 127.0.0.1, each reporting its CPU on a queue."""

    host = "127.0.0.1"

    def __init__(self, nbytes: int, rounds: int, macs: list[str], arena: int, cores: list[int] | None = None) -> None:
        self.procs = {"raw": start_receiver(raw_receiver, nbytes, rounds, cores=cores),
                      **{m: start_receiver(bundle_receiver, rounds, arena, auth=True, cores=cores) for m in macs},
                      "encrypted": start_receiver(bundle_receiver, rounds, arena, auth=True, encrypt=True,
                                                  cores=cores)}

    def ready(self, name: str) -> int:
        return self.procs[name][2]

    def cpu(self, name: str) -> float:
        return float(self.procs[name][1].get(timeout=600))

    def close(self) -> None:
        for proc, _, _ in self.procs.values():
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()


class RemoteReceivers:
    """A ``--serve`` on another host: its control connection says when each transfer may start (its arena is
    faulted in) and how many CPU seconds it took there."""

    def __init__(self, to: tuple[str, int], key: bytes) -> None:
        """Connect and prove the key (before the state is built: a wrong address or key fails at once)."""
        self.host, self.port, self.key = *to, key
        try:
            sock = socket.create_connection(to, timeout=30)
        except OSError as exc:   # gaierror (a bad name), refused, unreachable, timed out
            raise BenchError(f"cannot reach the --serve at {self.host}:{self.port}: {exc}") from exc
        self.control = Control(sock)
        nonce = bytes.fromhex(self.control.recv()["nonce"])
        self.control.send({"proof": control_proof(key, nonce)})
        self.hello = self.control.recv()

    def start(self, nbytes: int, rounds: int, names: list[str], arena: int) -> None:
        self.control.send({"nbytes": nbytes, "rounds": rounds, "names": names, "arena": arena})
        print(f"receiver: {self.hello['host']} ({self.hello['cpus']} cpus, load average {self.hello['load']:.1f}) "
              f"at {self.host}:{self.port}", flush=True)

    def ready(self, name: str) -> int:
        said = self.control.recv().get("ready")
        if said != name:
            raise BenchError(f"the receiver host is ready for {said!r}, not {name!r}")
        return self.port

    def cpu(self, name: str) -> float:
        return float(self.control.recv()["cpu"])

    def close(self) -> None:
        self.control.close()


def serve(bind: str, port: int, key: bytes, once: bool) -> None:
    """Host B: serve ``--to`` sessions one at a time on ``bind``:``port`` (until interrupted, or one)."""
    try:
        listener = socket.create_server((bind, port), family=socket.AF_INET6 if ":" in bind else socket.AF_INET)
    except (OSError, OverflowError) as exc:
        raise BenchError(f"cannot listen on {bind}:{port}: {exc}") from exc
    print(f"serving --auth-only --to on {bind}:{port}{' (one session)' if once else ' (Ctrl-C stops)'}", flush=True)
    with listener:
        while True:
            listener.settimeout(None)
            conn, peer = listener.accept()
            control = Control(conn)
            try:
                serve_session(listener, control, key)
                print(f"session from {peer[0]} done", flush=True)
            except (BenchError, HandoffError, OSError, RuntimeError, ValueError, KeyError) as exc:
                print(f"session from {peer[0]} failed: {exc}", flush=True)
                with contextlib.suppress(OSError):
                    control.send({"error": str(exc)})
                if once:
                    raise SystemExit(1) from None
            finally:
                control.close()
            if once:
                return


def serve_session(listener: socket.socket, control: Control, key: bytes) -> None:
    """One sender's rounds: prove the key, then per transfer: fault in the arena, "ready", receive, its CPU s."""
    nonce = os.urandom(16)
    control.send({"nonce": nonce.hex()})
    if not hmac.compare_digest(str(control.recv().get("proof", "")), control_proof(key, nonce)):
        raise BenchError("the sender did not prove the bench key (a different key on the two hosts?)")
    control.send({"host": socket.gethostname(), "cpus": os.cpu_count(), "load": os.getloadavg()[0]})
    config = control.recv()
    nbytes, rounds, arena, names = int(config["nbytes"]), int(config["rounds"]), int(config["arena"]), config["names"]
    auth = bench_auth(key)
    view = memoryview(bytearray(nbytes))   # touched once, reused: the best case for raw TCP
    for _ in range(rounds):
        for name in names:
            if name != "raw":
                reserve_receive_arena(arena)
            control.send({"ready": name})
            if name == "raw":
                conn = accept_one(listener, CONTROL_TIMEOUT_S)
                conn.settimeout(CONTROL_TIMEOUT_S)
                cpu_before = cpu_seconds()
                recv_raw(conn, view)
                control.send({"cpu": cpu_seconds() - cpu_before})
            else:
                cpu_before = cpu_seconds()
                bundle, _stats = accept_and_recv(listener, timeout=CONTROL_TIMEOUT_S, auth=auth,
                                                 encrypt=name == "encrypted")
                control.send({"cpu": cpu_seconds() - cpu_before})   # the joiner keeps the state: freeing is not timed
                del bundle


def auth_only(nbytes: int, rounds: int, macs: list[str], chunk_bytes: int, to: tuple[str, int] | None = None,
              key: bytes | None = None, pin: str = "off") -> None:
    """Raw TCP, the authenticated stream (each frame MAC in ``macs``) and the encrypted one, alternating within each
    round (A/B/C/A/B/C...): GB/s, the ratio to raw, CPU-s per GB both ends (medians and best), the load average.
    ``to``: the receivers are a ``--serve`` on that (host, port), proved with ``key``; else local child processes
    (each end on its own cores per ``pin``, see ``--pin``)."""
    remote = RemoteReceivers(to, key) if to is not None and key is not None else None
    plan = pin_plan(pin, sorted(os.sched_getaffinity(0))) if remote is None else None
    if plan is not None:
        os.sched_setaffinity(0, plan[0])     # this process: the sender and its MAC threads
    model, opt = model_and_optimizer(nbytes)
    bundle = capture({"model": model, "opt": opt}, step=1, rng=capture_rng())
    payload = memoryview(bytearray(b"\x5a" * nbytes))
    names = ["raw", *macs, "encrypted"]
    load = [os.getloadavg()[0]]
    print(f"state: {bundle.nbytes / 1e6:.0f} MB in {len(bundle.tensors)} tensors; raw {nbytes / 1e6:.0f} MB; {rounds} "
          f"rounds of {', '.join(names)} (alternating); frames of {chunk_bytes >> 10} KiB; load average {load[0]:.1f}; "
          + (f"pinned: sender on cores {plan[0]}, receivers on {plan[1]}" if plan else
             f"unpinned ({os.cpu_count()} cores shared by both ends)"), flush=True)
    arena = bundle.nbytes + (16 << 20)
    recv: LocalReceivers | RemoteReceivers
    if remote is None:
        recv, auth = LocalReceivers(nbytes, rounds, macs, arena, plan[1] if plan else None), AUTH
    else:
        remote.start(nbytes, rounds, names, arena)
        recv, auth = remote, bench_auth(remote.key)
    gbps: dict[str, list[float]] = {m: [] for m in names}
    cpu: dict[str, list[float]] = {m: [] for m in names}
    send_cpu: dict[str, list[float]] = {m: [] for m in names}
    try:
        for round_no in range(rounds):
            for name in names:
                before = cpu_seconds()
                port = recv.ready(name)
                if name == "raw":
                    gbps[name].append(nbytes / send_raw(port, payload, recv.host) / 1e9)
                    size = nbytes
                else:
                    stats = connect_and_send(recv.host, port, bundle, timeout=600, auth=auth,
                                             chunk_bytes=chunk_bytes, frame_mac=None if name == "encrypted" else name,
                                             encrypt=name == "encrypted")
                    gbps[name].append(stats.gbps)
                    size = bundle.nbytes
                sent = cpu_seconds() - before
                send_cpu[name].append(sent / size * 1e9)
                cpu[name].append((sent + recv.cpu(name)) / size * 1e9)
            load.append(os.getloadavg()[0])
            print(f"  round {round_no}: " + ", ".join(f"{m} {gbps[m][-1]:.2f} GB/s ({cpu[m][-1]:.3f} cpu-s/GB)"
                                                      for m in names) + f"; load {load[-1]:.1f}", flush=True)
    finally:
        recv.close()
    raw_median = statistics.median(gbps["raw"])
    raw_cpu = statistics.median(cpu["raw"])
    summary: dict[str, Any] = {"load": [round(x, 1) for x in load], "chunk_bytes": chunk_bytes,
                               "pinned": {"sender": plan[0], "receivers": plan[1]} if plan else None,
                               "cores": os.cpu_count()}
    if isinstance(recv, RemoteReceivers):
        summary["receiver"] = recv.hello
    for name in names:
        med, med_cpu = statistics.median(gbps[name]), statistics.median(cpu[name])
        per_round = [g / r for g, r in zip(gbps[name], gbps["raw"])]
        print(f"{name:13s} median {med:.2f} GB/s; / raw: median/median {med / raw_median:.2f}, per round "
              f"[{', '.join(f'{x:.2f}' for x in per_round)}]; cpu-s/GB both ends median {med_cpu:.3f} "
              f"(best {min(cpu[name]):.3f}; sender {statistics.median(send_cpu[name]):.3f}); raw cpu / this cpu "
              f"{raw_cpu / med_cpu:.2f}")
        summary[name] = {"gbps": [round(x, 3) for x in gbps[name]], "ratio_median": round(med / raw_median, 3),
                         "cpu_s_per_gb": [round(x, 3) for x in cpu[name]],
                         "cpu_s_per_gb_median": round(med_cpu, 3), "cpu_ratio": round(raw_cpu / med_cpu, 3),
                         "sender_cpu_s_per_gb_median": round(statistics.median(send_cpu[name]), 3)}
    print(json.dumps(summary))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300, help="size of the raw buffer and of the tracked state, MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--auth-only", action="store_true", help="raw TCP vs the authenticated stream per frame MAC")
    parser.add_argument("--macs", default="gmac-aes-256",
                        help="with --auth-only: the frame MACs to measure (there is one since issue 42: gmac-aes-256)")
    parser.add_argument("--pin", default="auto",
                        help="with --auth-only: each end on cores of its own: auto (half each when >= 4 cores), off, "
                             "or N cores per end")
    parser.add_argument("--chunk-mb", type=float, default=CHUNK / (1 << 20),
                        help="with --auth-only: the sender's frame size, MiB")
    parser.add_argument("--serve", action="store_true",
                        help="with --auth-only: this host receives for a --to on another host")
    parser.add_argument("--bind", default="0.0.0.0", help="with --serve: the address to listen on")
    parser.add_argument("--port", type=int, default=SERVE_PORT, help="with --serve: the one TCP port to listen on")
    parser.add_argument("--once", action="store_true", help="with --serve: serve one session, then exit")
    parser.add_argument("--to", metavar="HOST[:PORT]", help="with --auth-only: send to a --serve on HOST")
    parser.add_argument("--key-file", metavar="PATH",
                        help=f"with --serve/--to: the bench key's file (else ${KEY_ENV}; the same on both hosts)")
    args = parser.parse_args()
    nbytes = args.mb * 10**6
    if args.serve or args.to:
        try:
            if not args.auth_only:
                raise BenchError("--serve and --to go with --auth-only")
            if args.serve and args.to:
                raise BenchError("--serve (host B) and --to (host A) are for different hosts")
            to = parse_target(args.to) if args.to else None
            key = read_key(args.key_file)
            if args.serve:
                serve(args.bind, args.port, key, args.once)
            else:
                auth_only(nbytes, args.rounds, [m for m in args.macs.split(",") if m], int(args.chunk_mb * (1 << 20)),
                          to=to, key=key)
        except (BenchError, HandoffError, OSError) as exc:   # a transfer or the control connection failed
            raise SystemExit(f"transfer.py: {exc}") from None
        except KeyboardInterrupt:
            raise SystemExit(130) from None
        return
    if args.auth_only:
        try:
            auth_only(nbytes, args.rounds, [m for m in args.macs.split(",") if m], int(args.chunk_mb * (1 << 20)),
                      pin=args.pin)
        except BenchError as exc:
            raise SystemExit(f"transfer.py: {exc}") from None
        return

    model, opt = model_and_optimizer(nbytes)
    bundle = capture({"model": model, "opt": opt}, step=1, rng=capture_rng())
    payload = memoryview(bytearray(b"\x5a" * nbytes))
    print(f"state: {bundle.nbytes / 1e6:.0f} MB in {len(bundle.tensors)} tensors; raw buffer {nbytes / 1e6:.0f} MB; "
          f"{args.rounds} alternating rounds, torch threads {torch.get_num_threads()}")

    raw_proc, raw_reports, raw_port = start_receiver(raw_receiver, nbytes, args.rounds)
    bundle_proc, bundle_reports, bundle_port = start_receiver(bundle_receiver, args.rounds, 0)
    arena_proc, arena_reports, arena_port = start_receiver(bundle_receiver, args.rounds,
                                                           bundle.nbytes + (16 << 20))
    auth_proc, auth_reports, auth_port = start_receiver(bundle_receiver, args.rounds, bundle.nbytes + (16 << 20),
                                                        auth=True)
    enc_proc, enc_reports, enc_port = start_receiver(bundle_receiver, args.rounds, bundle.nbytes + (16 << 20),
                                                     auth=True, encrypt=True)
    enc_gbps, enc_cpu = [], []
    raw_gbps, bundle_gbps, raw_cpu, bundle_cpu, arena_gbps, arena_cpu = [], [], [], [], [], []
    auth_gbps, auth_cpu = [], []
    try:
        for round_no in range(args.rounds):
            cpu_before = cpu_seconds()
            raw_gbps.append(nbytes / send_raw(raw_port, payload) / 1e9)
            raw_cpu.append((cpu_seconds() - cpu_before, raw_reports.get(timeout=600)))
            cpu_before = cpu_seconds()
            stats = connect_and_send("127.0.0.1", bundle_port, bundle, timeout=600)
            bundle_cpu.append((cpu_seconds() - cpu_before, bundle_reports.get(timeout=600)))
            bundle_gbps.append(stats.gbps)
            cpu_before = cpu_seconds()
            astats = connect_and_send("127.0.0.1", arena_port, bundle, timeout=600)
            arena_cpu.append((cpu_seconds() - cpu_before, arena_reports.get(timeout=600)))
            arena_gbps.append(astats.gbps)
            cpu_before = cpu_seconds()
            sstats = connect_and_send("127.0.0.1", auth_port, bundle, timeout=600, auth=AUTH)
            auth_cpu.append((cpu_seconds() - cpu_before, auth_reports.get(timeout=600)))
            auth_gbps.append(sstats.gbps)
            cpu_before = cpu_seconds()
            estats = connect_and_send("127.0.0.1", enc_port, bundle, timeout=600, auth=AUTH, encrypt=True)
            enc_cpu.append((cpu_seconds() - cpu_before, enc_reports.get(timeout=600)))
            enc_gbps.append(estats.gbps)
            print(f"  round {round_no}: encrypted ({estats.checksum.split(':')[0]}) {estats.gbps:.2f} GB/s "
                  f"(cpu s: send {enc_cpu[-1][0]:.3f}, recv {enc_cpu[-1][1]:.3f})")
            print(f"  round {round_no}: handoff into a spare's pre-faulted arena {astats.gbps:.2f} GB/s "
                  f"(cpu s: send {arena_cpu[-1][0]:.3f}, recv {arena_cpu[-1][1]:.3f}); authenticated "
                  f"{sstats.gbps:.2f} GB/s (cpu s: send {auth_cpu[-1][0]:.3f}, recv {auth_cpu[-1][1]:.3f}; "
                  f"{sstats.chunks} frames, {sstats.checksum})")
            print(f"  round {round_no}: raw {raw_gbps[-1]:.2f} GB/s (cpu s: send {raw_cpu[-1][0]:.3f}, "
                  f"recv {raw_cpu[-1][1]:.3f}), handoff {stats.gbps:.2f} GB/s (cpu s: send {bundle_cpu[-1][0]:.3f}, "
                  f"recv {bundle_cpu[-1][1]:.3f}; {stats.nbytes / 1e6:.0f} MB, {stats.chunks} chunks, {stats.checksum})")
    finally:
        for proc in (raw_proc, bundle_proc, arena_proc, auth_proc, enc_proc):
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()

    raw_best, bundle_best = max(raw_gbps), max(bundle_gbps)
    ratio_best = bundle_best / raw_best
    ratio_median = statistics.median(bundle_gbps) / statistics.median(raw_gbps)
    print(f"raw TCP    best {raw_best:.2f} GB/s, median {statistics.median(raw_gbps):.2f} GB/s")
    print(f"handoff    best {bundle_best:.2f} GB/s, median {statistics.median(bundle_gbps):.2f} GB/s")
    print(f"ratio      best/best {ratio_best:.2f}, median/median {ratio_median:.2f} (fresh receive memory)")
    arena_ratio = statistics.median(arena_gbps) / statistics.median(raw_gbps)
    print(f"arena      best {max(arena_gbps):.2f} GB/s, median {statistics.median(arena_gbps):.2f} GB/s; "
          f"ratio best/best {max(arena_gbps) / raw_best:.2f}, median/median {arena_ratio:.2f} (target >= 0.70)")
    auth_ratio = statistics.median(auth_gbps) / statistics.median(raw_gbps)
    auth_vs_arena = statistics.median(auth_gbps) / statistics.median(arena_gbps)
    print(f"authed     best {max(auth_gbps):.2f} GB/s, median {statistics.median(auth_gbps):.2f} GB/s; ratio to raw "
          f"median/median {auth_ratio:.2f}; authenticated / checksummed (both into an arena) {auth_vs_arena:.2f} "
          f"({sstats.checksum.split(':')[0]} frames)")
    enc_ratio = statistics.median(enc_gbps) / statistics.median(raw_gbps)
    enc_vs_auth = statistics.median(enc_gbps) / statistics.median(auth_gbps)
    print(f"encrypted  best {max(enc_gbps):.2f} GB/s, median {statistics.median(enc_gbps):.2f} GB/s; ratio to raw "
          f"median/median {enc_ratio:.2f}; encrypted / authenticated {enc_vs_auth:.2f} (AES-256-GCM frames)")
    cost = lambda cpu, n: min(send + recv for send, recv in cpu) / n * 1e9   # noqa: E731
    enc_cost = cost(enc_cpu, bundle.nbytes)
    raw_cost, bundle_cost, arena_cost = cost(raw_cpu, nbytes), cost(bundle_cpu, bundle.nbytes), cost(arena_cpu, bundle.nbytes)
    auth_cost = cost(auth_cpu, bundle.nbytes)
    print(f"cpu cost   raw {raw_cost:.3f} s/GB, handoff {bundle_cost:.3f}, arena {arena_cost:.3f}, authenticated "
          f"{auth_cost:.3f} s/GB (both ends; a load-independent view on a shared host): raw/handoff "
          f"{raw_cost / bundle_cost:.2f}, arena/authenticated {arena_cost / auth_cost:.2f}; encrypted {enc_cost:.3f} s/GB")

    sampler = Sampler()
    rng = capture_rng()
    light = encode_small(capture({"sampler": sampler}, step=7, rng=rng))
    timings = {
        "capture_rng": per_call_us(capture_rng),
        "capture+encode_small (rng given)": per_call_us(lambda: encode_small(capture({"sampler": sampler}, step=7, rng=rng))),
        "capture_rng+capture+encode_small": per_call_us(
            lambda: encode_small(capture({"sampler": sampler}, step=7, rng=capture_rng()))),
        "decode_small": per_call_us(lambda: decode_small(light)),
    }
    print(f"light snapshot: {len(light)} bytes")
    for name, (best, median) in timings.items():
        print(f"  {name:36s} best {best:7.1f} us, median {median:7.1f} us")

    print(json.dumps({
        "raw_gbps": raw_gbps, "handoff_gbps": bundle_gbps, "arena_gbps": arena_gbps,
        "arena_ratio_median": round(arena_ratio, 3), "ratio_best": round(ratio_best, 3),
        "auth_gbps": auth_gbps, "auth_ratio_median": round(auth_ratio, 3),
        "auth_vs_checksum_median": round(auth_vs_arena, 3), "cpu_s_per_gb_auth": round(auth_cost, 3),
        "enc_gbps": enc_gbps, "enc_ratio_median": round(enc_ratio, 3),
        "enc_vs_auth_median": round(enc_vs_auth, 3), "cpu_s_per_gb_enc": round(enc_cost, 3), "cpu_s_per_gb_arena": round(arena_cost, 3),
        "ratio_median": round(ratio_median, 3), "cpu_s_per_gb": {"raw": round(raw_cost, 3), "handoff": round(bundle_cost, 3)},
        "state_mb": round(bundle.nbytes / 1e6, 1),
        "light_bytes": len(light), "light_us": {k: round(v[0], 1) for k, v in timings.items()},
    }))


if __name__ == "__main__":
    main()
