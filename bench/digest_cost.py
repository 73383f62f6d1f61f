"""What the replica check after a swap or recovery costs a rank (tpassrun/worker/digest.py): the digest of its
replicated state, on a realistic model, once per recovery (never per step).

    python bench/digest_cost.py [--layers 12] [--hidden 768] [--vocab 50257] [--repeats 2] [--compare]

The default is GPT-2 small's shape (124 M parameters: embeddings, 12 blocks of attention and MLP linears) with
AdamW's state after a step (two moments and a step count per parameter): 1.5 GB of fp32 tensors, plain ``torch.nn``
modules on the CPU. Measured: :func:`tpassrun.worker.digest.state_digest` over model, optimizer and
scheduler, as a rank computes it after a recovery (each tensor's row and column sums, the non-tensor values as
JSON, BLAKE2b); with ``--compare``, BLAKE2b and crc32 over the same raw bytes. Best of ``--repeats``, in CPU seconds
(one torch thread by default: the cost on one core, however loaded the machine) and wall seconds; figures only.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import time
import zlib
from typing import Any, Callable

import torch
from common import print_json

from tpassrun.worker import digest


def gpt2_like(layers: int, hidden: int, vocab: int) -> torch.nn.Module:
    """GPT-2's parameter shapes, without torch's initialisation (the digest reads bytes, whatever they are)."""
    skip = torch.nn.utils.skip_init
    blocks = []
    for _ in range(layers):
        blocks += [skip(torch.nn.LayerNorm, hidden), skip(torch.nn.Linear, hidden, 3 * hidden),
                   skip(torch.nn.Linear, hidden, hidden), skip(torch.nn.LayerNorm, hidden),
                   skip(torch.nn.Linear, hidden, 4 * hidden), skip(torch.nn.Linear, 4 * hidden, hidden)]
    return torch.nn.Sequential(skip(torch.nn.Embedding, vocab, hidden), skip(torch.nn.Embedding, 1024, hidden),
                               *blocks, skip(torch.nn.LayerNorm, hidden))


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    """(best CPU seconds, best wall seconds): CPU time is what the digest costs on a core of its own, whatever else
    the machine runs (with one torch thread, as here by default, the two match on an idle machine)."""
    cpu, wall = [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - t0)
    return min(cpu), min(wall)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the digest's reductions)")
    p.add_argument("--compare", action="store_true", help="also time BLAKE2b and crc32 over the same raw bytes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = gpt2_like(args.layers, args.hidden, args.vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for prm in model.parameters():       # AdamW's state after a step, as its state_dict() then holds it
        prm.detach().uniform_()          # (written: untouched pages would all read the one zero page)
        opt.state[prm] = {"step": torch.tensor(1.0), "exp_avg": torch.rand_like(prm), "exp_avg_sq": torch.rand_like(prm)}
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    objects = {"model": model, "optimizer": opt, "scheduler": sched}
    params = sum(prm.numel() for prm in model.parameters())
    got = digest.state_digest(objects)
    tensors = [t for name, obj in objects.items() for _, t in digest.named_tensors(name, obj)[1]]
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors]
    gb = got.nbytes / 1e9
    best, wall = timed(lambda: digest.state_digest(objects), args.repeats)
    print(f"state: {params / 1e6:.1f} M parameters, {len(tensors)} tensors, {gb:.2f} GB (model + AdamW state)")
    print(f"state_digest: {best:.3f} CPU s ({gb / best:.2f} GB/s per core; wall {wall:.3f} s), "
          f"torch threads {torch.get_num_threads()}", flush=True)
    b2_best = crc_best = float("nan")
    if args.compare:
        b2_best, _ = timed(lambda: [hashlib.blake2b(r, digest_size=16).digest() for r in raw], args.repeats)
        crc_best, _ = timed(lambda: [zlib.crc32(r) for r in raw], args.repeats)
        print(f"for comparison over the same bytes: blake2b {b2_best:.3f} CPU s ({gb / b2_best:.2f} GB/s), "
              f"crc32 {crc_best:.3f} CPU s ({gb / crc_best:.2f} GB/s)")
    print_json({"params": params, "tensors": len(tensors), "bytes": got.nbytes, "digest_cpu_s": round(best, 4),
                "digest_wall_s": round(wall, 4), "blake2b_cpu_s": round(b2_best, 4),
                "crc32_cpu_s": round(crc_best, 4), "threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
