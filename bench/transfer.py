"""Handoff transfer benchmark: raw loopback TCP vs send_bundle/recv_bundle, and the light snapshot.

    python bench/transfer.py [--mb 300] [--rounds 3]
    python bench/transfer.py --auth-only [--rounds 5]     # raw TCP vs the authenticated stream, frame MAC by frame MAC

Prints, in one run:
  * raw TCP throughput: sendall / recv_into of one buffer between two processes;
  * handoff throughput: ``connect_and_send`` / ``accept_and_recv`` of a model + AdamW state of
    about the same size between two processes (checksummed, acknowledged, fresh receive tensors);
  * the same, authenticated as every transfer between processes is (handshake, a tag on every frame: Poly1305
    where the host's OpenSSL has it, the default), into a spare's pre-faulted arena: what a swap actually pays;
  * the same with HMAC-SHA256 frame tags (the fallback, and what every transfer paid before Poly1305);
  * their ratios to raw TCP (target >= 0.70), authenticated / checksummed, and CPU seconds per GB (both ends);
  * the same, encrypted (``encrypt=True``: ``--rdzv-conf encrypt=true``, AES-256-GCM frames), GB/s and CPU per GB;
  * ``capture_rng()`` + ``capture`` + ``encode_small`` per call (target < 100 us), with a breakdown.

``--auth-only [--macs gmac-aes-256,poly1305,hmac-sha256] [--chunk-mb 8]``: raw TCP, the authenticated stream into
a spare's arena with each frame MAC asked for (GMAC, the default where ``cryptography`` is installed), and the
encrypted one (AES-256-GCM frames), alternating within each round (A/B/C, A/B/C, ...): GB/s medians, the ratio to
raw (target >= 0.9), CPU-s per GB both ends (median, best, the sender's share), raw's CPU per GB over each one's
(what the ratio would be if the cores were the limit), and the load average. A receiver's CPU stops when it
has the verified state (the joiner keeps it: freeing it is not the transfer's).

Raw and handoff rounds alternate so that background load hits both alike. The last line is JSON.
Figures only, no assertions: this is not a test.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import socket
import statistics
import time
from typing import Any, Callable

import torch

from tpassrun.transfer.wire import reserve_receive_arena
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
            with conn:
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view[got:got + CHUNK])
                    if n == 0:
                        raise RuntimeError("sender went away")
                    got += n
                conn.sendall(b"k")  # the sender's clock stops on this, as send_bundle's does on its ack
            ports.put(cpu_seconds() - cpu_before)


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


def start_receiver(target: Callable, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    ctx = mp.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, ports), kwargs=kwargs, daemon=True)
    proc.start()
    return proc, ports, ports.get(timeout=600)


# ---------------------------------------------------------------------------------------------
# senders (this process)


def send_raw(port: int, payload: memoryview) -> float:
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
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


def auth_only(nbytes: int, rounds: int, macs: list[str], chunk_bytes: int) -> None:
    """Raw TCP, the authenticated stream (each frame MAC in ``macs``) and the encrypted one, alternating within each
    round (A/B/C/A/B/C...): GB/s, the ratio to raw, CPU-s per GB both ends (medians and best), the load average."""
    import os

    model, opt = model_and_optimizer(nbytes)
    bundle = capture({"model": model, "opt": opt}, step=1, rng=capture_rng())
    payload = memoryview(bytearray(b"\x5a" * nbytes))
    names = ["raw", *macs, "encrypted"]
    load = [os.getloadavg()[0]]
    print(f"state: {bundle.nbytes / 1e6:.0f} MB in {len(bundle.tensors)} tensors; raw {nbytes / 1e6:.0f} MB; {rounds} "
          f"rounds of {', '.join(names)} (alternating); frames of {chunk_bytes >> 10} KiB; load average {load[0]:.1f}",
          flush=True)
    arena = bundle.nbytes + (16 << 20)
    recv = {"raw": start_receiver(raw_receiver, nbytes, rounds),
            **{m: start_receiver(bundle_receiver, rounds, arena, auth=True) for m in macs},
            "encrypted": start_receiver(bundle_receiver, rounds, arena, auth=True, encrypt=True)}
    gbps: dict[str, list[float]] = {m: [] for m in names}
    cpu: dict[str, list[float]] = {m: [] for m in names}
    send_cpu: dict[str, list[float]] = {m: [] for m in names}
    try:
        for round_no in range(rounds):
            for name in names:
                before = cpu_seconds()
                if name == "raw":
                    gbps[name].append(nbytes / send_raw(recv[name][2], payload) / 1e9)
                    size = nbytes
                else:
                    stats = connect_and_send("127.0.0.1", recv[name][2], bundle, timeout=600, auth=AUTH,
                                             chunk_bytes=chunk_bytes, frame_mac=None if name == "encrypted" else name,
                                             encrypt=name == "encrypted")
                    gbps[name].append(stats.gbps)
                    size = bundle.nbytes
                sent = cpu_seconds() - before
                send_cpu[name].append(sent / size * 1e9)
                cpu[name].append((sent + recv[name][1].get(timeout=600)) / size * 1e9)
            load.append(os.getloadavg()[0])
            print(f"  round {round_no}: " + ", ".join(f"{m} {gbps[m][-1]:.2f} GB/s ({cpu[m][-1]:.3f} cpu-s/GB)"
                                                      for m in names) + f"; load {load[-1]:.1f}", flush=True)
    finally:
        for proc, _, _ in recv.values():
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    raw_median = statistics.median(gbps["raw"])
    raw_cpu = statistics.median(cpu["raw"])
    summary: dict[str, Any] = {"load": [round(x, 1) for x in load], "chunk_bytes": chunk_bytes}
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
                        help="with --auth-only: the frame MACs to measure (comma-separated: gmac-aes-256, poly1305, "
                             "hmac-sha256)")
    parser.add_argument("--chunk-mb", type=float, default=CHUNK / (1 << 20),
                        help="with --auth-only: the sender's frame size, MiB")
    args = parser.parse_args()
    nbytes = args.mb * 10**6
    if args.auth_only:
        auth_only(nbytes, args.rounds, [m for m in args.macs.split(",") if m], int(args.chunk_mb * (1 << 20)))
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
    hmac_proc, hmac_reports, hmac_port = start_receiver(bundle_receiver, args.rounds, bundle.nbytes + (16 << 20),
                                                        auth=True)
    enc_proc, enc_reports, enc_port = start_receiver(bundle_receiver, args.rounds, bundle.nbytes + (16 << 20),
                                                     auth=True, encrypt=True)
    enc_gbps, enc_cpu = [], []
    raw_gbps, bundle_gbps, raw_cpu, bundle_cpu, arena_gbps, arena_cpu = [], [], [], [], [], []
    auth_gbps, auth_cpu, hmac_gbps, hmac_cpu = [], [], [], []
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
            hstats = connect_and_send("127.0.0.1", hmac_port, bundle, timeout=600, auth=AUTH, frame_mac="hmac-sha256")
            hmac_cpu.append((cpu_seconds() - cpu_before, hmac_reports.get(timeout=600)))
            hmac_gbps.append(hstats.gbps)
            cpu_before = cpu_seconds()
            estats = connect_and_send("127.0.0.1", enc_port, bundle, timeout=600, auth=AUTH, encrypt=True)
            enc_cpu.append((cpu_seconds() - cpu_before, enc_reports.get(timeout=600)))
            enc_gbps.append(estats.gbps)
            print(f"  round {round_no}: encrypted ({estats.checksum.split(':')[0]}) {estats.gbps:.2f} GB/s "
                  f"(cpu s: send {enc_cpu[-1][0]:.3f}, recv {enc_cpu[-1][1]:.3f})")
            print(f"  round {round_no}: handoff into a spare's pre-faulted arena {astats.gbps:.2f} GB/s "
                  f"(cpu s: send {arena_cpu[-1][0]:.3f}, recv {arena_cpu[-1][1]:.3f}); authenticated "
                  f"{sstats.gbps:.2f} GB/s (cpu s: send {auth_cpu[-1][0]:.3f}, recv {auth_cpu[-1][1]:.3f}; "
                  f"{sstats.chunks} frames, {sstats.checksum}); with HMAC-SHA256 frames {hstats.gbps:.2f} GB/s "
                  f"(cpu s: send {hmac_cpu[-1][0]:.3f}, recv {hmac_cpu[-1][1]:.3f})")
            print(f"  round {round_no}: raw {raw_gbps[-1]:.2f} GB/s (cpu s: send {raw_cpu[-1][0]:.3f}, "
                  f"recv {raw_cpu[-1][1]:.3f}), handoff {stats.gbps:.2f} GB/s (cpu s: send {bundle_cpu[-1][0]:.3f}, "
                  f"recv {bundle_cpu[-1][1]:.3f}; {stats.nbytes / 1e6:.0f} MB, {stats.chunks} chunks, {stats.checksum})")
    finally:
        for proc in (raw_proc, bundle_proc, arena_proc, auth_proc, hmac_proc, enc_proc):
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
    hmac_ratio = statistics.median(hmac_gbps) / statistics.median(raw_gbps)
    hmac_vs_arena = statistics.median(hmac_gbps) / statistics.median(arena_gbps)
    print(f"hmac       best {max(hmac_gbps):.2f} GB/s, median {statistics.median(hmac_gbps):.2f} GB/s; ratio to raw "
          f"median/median {hmac_ratio:.2f}; HMAC-SHA256 frames / checksummed {hmac_vs_arena:.2f}")
    enc_ratio = statistics.median(enc_gbps) / statistics.median(raw_gbps)
    enc_vs_auth = statistics.median(enc_gbps) / statistics.median(auth_gbps)
    print(f"encrypted  best {max(enc_gbps):.2f} GB/s, median {statistics.median(enc_gbps):.2f} GB/s; ratio to raw "
          f"median/median {enc_ratio:.2f}; encrypted / authenticated {enc_vs_auth:.2f} (AES-256-GCM frames)")
    cost = lambda cpu, n: min(send + recv for send, recv in cpu) / n * 1e9   # noqa: E731
    enc_cost = cost(enc_cpu, bundle.nbytes)
    raw_cost, bundle_cost, arena_cost = cost(raw_cpu, nbytes), cost(bundle_cpu, bundle.nbytes), cost(arena_cpu, bundle.nbytes)
    auth_cost, hmac_cost = cost(auth_cpu, bundle.nbytes), cost(hmac_cpu, bundle.nbytes)
    print(f"cpu cost   raw {raw_cost:.3f} s/GB, handoff {bundle_cost:.3f}, arena {arena_cost:.3f}, authenticated "
          f"{auth_cost:.3f}, HMAC-SHA256 frames {hmac_cost:.3f} s/GB (both ends; a load-independent view on a "
          f"shared host): raw/handoff {raw_cost / bundle_cost:.2f}, arena/authenticated {arena_cost / auth_cost:.2f}, "
          f"arena/HMAC {arena_cost / hmac_cost:.2f}; encrypted {enc_cost:.3f} s/GB")

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
        "hmac_gbps": hmac_gbps, "hmac_vs_checksum_median": round(hmac_vs_arena, 3),
        "cpu_s_per_gb_hmac": round(hmac_cost, 3), "enc_gbps": enc_gbps, "enc_ratio_median": round(enc_ratio, 3),
        "enc_vs_auth_median": round(enc_vs_auth, 3), "cpu_s_per_gb_enc": round(enc_cost, 3), "cpu_s_per_gb_arena": round(arena_cost, 3),
        "ratio_median": round(ratio_median, 3), "cpu_s_per_gb": {"raw": round(raw_cost, 3), "handoff": round(bundle_cost, 3)},
        "state_mb": round(bundle.nbytes / 1e6, 1),
        "light_bytes": len(light), "light_us": {k: round(v[0], 1) for k, v in timings.items()},
    }))


if __name__ == "__main__":
    main()
