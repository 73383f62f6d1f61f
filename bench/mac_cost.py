"""What each frame MAC the transfer could use costs per GB on this CPU, and whether it lets other threads run
(issue 27 item 7: authentication at line rate).

    python bench/mac_cost.py [--mb 256] [--frame-mb 1] [--repeats 3]

For every candidate (``cryptography``'s GMAC as AES-GCM over associated data only, through ``Cipher`` and through
the one-shot ``AESGCM``, and :func:`tpassrun.transfer.gmac.tag` itself, the frame MAC; its Poly1305 and
ChaCha20-Poly1305 over associated data; HMAC-SHA256; keyed BLAKE2b/BLAKE2s; AES-256-GCM encryption and a plain
copy for scale): CPU seconds per GB on one thread (``time.thread_time``, so a loaded host reads about the same as
an idle one), over frames of ``--frame-mb`` from a buffer that stays in cache (hot: the receiver's case, just
written by ``recv_into``) and from ``--mb`` of memory the caches cannot hold (cold: a sender's tensors); and
``gil``: the fraction of its CPU a spinning Python thread still got while another thread ran the MAC over the
cold buffer (about the same as alone: the MAC releases the GIL; near 0: it holds it, and a socket thread would
wait on it). Figures only; the last line is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import threading
import time
from typing import Any, Callable

from common import print_json

KEY = bytes(range(32))
NONCE = bytes(12)


def candidates() -> dict[str, Callable[[memoryview], Any]]:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives import hmac as chmac
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    from tpassrun.transfer import gmac

    aesgcm, chacha = AESGCM(KEY), ChaCha20Poly1305(KEY)

    def gmac_cipher(frame: memoryview) -> bytes:
        ctx = Cipher(algorithms.AES(KEY), modes.GCM(NONCE)).encryptor()
        ctx.authenticate_additional_data(frame)
        ctx.finalize()
        return bytes(ctx.tag)

    def poly_crypto(frame: memoryview) -> bytes:
        mac = Poly1305(KEY)
        mac.update(frame)
        return mac.finalize()

    def hmac_crypto(frame: memoryview) -> bytes:
        mac = chmac.HMAC(KEY, hashes.SHA256())
        mac.update(frame)
        return mac.finalize()

    out: dict[str, Callable[[memoryview], Any]] = {
        "gmac (cryptography Cipher, AAD)": gmac_cipher,
        "gmac (cryptography AESGCM, AAD)": lambda frame: aesgcm.encrypt(NONCE, b"", frame),
        "gmac (tpassrun.transfer.gmac.tag: the frame MAC)": lambda frame: gmac.tag(KEY, 0, [frame]),
        "poly1305 (cryptography)": poly_crypto,
        "chacha20-poly1305 (cryptography, AAD)": lambda frame: chacha.encrypt(NONCE, b"", frame),
        "hmac-sha256 (cryptography)": hmac_crypto,
        "hmac-sha256 (hashlib)": lambda frame: hmac.new(KEY, frame, hashlib.sha256).digest(),
        "blake2b keyed (hashlib)": lambda frame: hashlib.blake2b(frame, key=KEY, digest_size=16).digest(),
        "blake2s keyed (hashlib)": lambda frame: hashlib.blake2s(frame, key=KEY, digest_size=16).digest(),
        "aes-256-gcm encrypt (cryptography)": lambda frame: aesgcm.encrypt(NONCE, frame, b"data"),
        "copy (bytes(frame))": lambda frame: bytes(frame),
    }
    return out


def cpu_per_gb(fn: Callable[[memoryview], Any], buffer: memoryview, frame: int, total: int) -> float:
    """Thread CPU seconds per 10**9 bytes of ``fn`` over ``total`` bytes of ``buffer`` in frames of ``frame``."""
    done = 0
    started = time.thread_time()
    while done < total:
        for offset in range(0, len(buffer), frame):
            fn(buffer[offset:offset + frame])
            done += frame
            if done >= total:
                break
    return (time.thread_time() - started) / done * 1e9


def gil_share(fn: Callable[[memoryview], Any], buffer: memoryview, frame: int) -> float:
    """CPU a spinning Python thread got per wall second while another thread ran ``fn`` over ``buffer``, relative
    to what it got alone over the same wall time (1: the MAC never held it back; near 0: it held the GIL)."""
    def spin(seconds: float) -> float:
        began, cpu = time.perf_counter(), time.thread_time()
        while time.perf_counter() - began < seconds:
            pass
        return (time.thread_time() - cpu) / seconds

    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            for offset in range(0, len(buffer), frame):
                fn(buffer[offset:offset + frame])

    alone = spin(0.3)
    thread = threading.Thread(target=worker)
    thread.start()
    try:
        together = spin(0.6)
    finally:
        stop.set()
        thread.join()
    return together / alone if alone > 0 else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256, help="cold buffer, MiB (beyond the caches)")
    parser.add_argument("--frame-mb", type=float, default=1.0, help="frame size, MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="comma-separated substrings of candidate names")
    args = parser.parse_args()
    frame = int(args.frame_mb * (1 << 20))
    cold = memoryview(bytearray(b"\x5a" * (args.mb << 20)))
    hot = memoryview(bytearray(b"\xa5" * frame))
    import os

    print(f"frames of {frame >> 10} KiB; hot: one frame over and over; cold: {args.mb} MiB; best of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    results: dict[str, dict[str, float]] = {}
    wanted = [w for w in args.only.split(",") if w]
    for name, fn in candidates().items():
        if wanted and not any(w in name for w in wanted):
            continue
        hot_cost = min(cpu_per_gb(fn, hot, frame, 256 << 20) for _ in range(args.repeats))
        cold_cost = min(cpu_per_gb(fn, cold, frame, len(cold)) for _ in range(args.repeats))
        share = statistics.median(gil_share(fn, cold, frame) for _ in range(args.repeats))
        results[name] = {"hot_cpu_s_per_gb": round(hot_cost, 4), "cold_cpu_s_per_gb": round(cold_cost, 4),
                         "hot_gb_per_cpu_s": round(1 / hot_cost, 1), "gil_share": round(share, 2)}
        print(f"  {name:40s} hot {hot_cost:.4f} CPU-s/GB ({1 / hot_cost:5.1f} GB/s), cold {cold_cost:.4f} "
              f"({1 / cold_cost:5.1f} GB/s); a Python thread beside it kept {share:.2f} of its CPU", flush=True)
    print_json({"frame_bytes": frame, "cold_mib": args.mb, "macs": results})


if __name__ == "__main__":
    main()
