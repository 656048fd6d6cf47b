"""Paged attention on CPU, per layer: the C++ kernel against the torch reference it
replaced (decodes), and torch's flash kernel against the C++ loop (long prefill chunks,
which kernels/cpu_kernels.py routes to flash).

    python -m loadtest.bench_cpu_attention     # from the repository root (it reuses the tests' paged batches)

Shapes are SmolLM2-135M's (9 query / 3 KV heads x 64), bf16, blocks of 16 scattered over
the cache. Decodes run on one thread and report CPU time (robust to other load); prefill
chunks run on torch's default threads and report wall time and GFLOP/s (4 x q x ctx x
heads x head_dim). Best of a few repeats; both sides alternate in this one process.
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels import cpu_kernels, reference
from tests.kernels.paged_batches import make_batch

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def _batch(seqs: list[tuple[int, int]]):
    return make_batch(seqs, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=16,
                      dtype=torch.bfloat16, block_order="shuffled")


def _best(fn, clock, repeats: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t) / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if cpu_kernels.load() is None:
        raise SystemExit(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    threads = torch.get_num_threads()

    print("Decodes, one thread, CPU time per layer:\n")
    print("| batch | C++ kernel | torch reference | speed-up |")
    print("|---|---:|---:|---:|")
    torch.set_num_threads(1)
    for bs, ctx in [(1, 190), (1, 2000), (64, 190)]:
        b = _batch([(ctx, 1)] * bs)
        cpp = _best(lambda: cpu_kernels.paged_attention(*b.args(), b.scale), time.process_time, args.repeats, 10)
        ref = _best(lambda: reference.paged_attention(*b.args(), b.scale), time.process_time, args.repeats, 10)
        print(f"| {bs} x {ctx} tokens | {cpp * 1e6:.0f} us | {ref * 1e6:.0f} us | {ref / cpp:.1f}x |")

    torch.set_num_threads(threads)
    print(f"\nOne prefill chunk after cached tokens, {threads} threads, wall time per layer:\n")
    print("| chunk x context | flash (the route taken) | C++ loop |")
    print("|---|---:|---:|")
    ext = cpu_kernels.load()
    for q_len, ctx in [(150, 7000), (512, 4000)]:
        b = _batch([(ctx, q_len)])
        out = torch.empty_like(b.query)
        flash = _best(lambda: cpu_kernels.paged_attention(*b.args(), b.scale, out), time.perf_counter, 3, 1)
        loop = _best(lambda: ext.paged_attention(out, *b.args(), b.scale, 0, cpu_kernels.Q_CHUNK, 0),
                     time.perf_counter, 3, 1)
        flops = 4 * q_len * ctx * HEADS * HEAD_DIM
        print(f"| {q_len} x {ctx} | {flash * 1e3:.1f} ms ({flops / flash / 1e9:.0f} GFLOP/s) | "
              f"{loop * 1e3:.1f} ms ({flops / loop / 1e9:.0f} GFLOP/s) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
