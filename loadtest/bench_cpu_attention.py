"""Paged attention on CPU, per layer: the C++ kernel against the torch reference it
replaced and against its own one-pass loop (decodes), and the routes of prefill chunks
(kernels/cpu_kernels.py): the C++ blocked loop (bf16 chunks of more than BLOCK_MIN_ROWS
query rows) against the few-row loop and torch's flash kernel that took such chunks before,
for prompts without cached tokens and for a chunk after cached tokens. The "invariant"
column is the `--batch-invariant` bf16 route (`attention_invariant`: every chunk, batch- and
chunk-invariant); the others are the default routes. The last table times decodes with the KV
caches on 4 KB pages against the engine's huge-page caches (engine/kv_cache.py).

    python -m loadtest.bench_cpu_attention     # from the repository root (it reuses the tests' paged batches)
    python -m loadtest.bench_cpu_attention --quick   # fewer, smaller shapes (the smoke test)
    python -m loadtest.bench_cpu_attention --baseline-rev main   # only: this tree's decodes vs main's

Shapes are SmolLM2-135M's (9 query / 3 KV heads x 64), bf16, blocks of 16 scattered over
the cache. Single-thread decodes report CPU time (robust to other load); the rest run
on torch's default threads and report wall time. "30 layers" tables call each layer's own
cache in turn, as a model step does, so K/V come from memory, not from a cache level the
previous call warmed. GFLOP/s count the causal products only (4 x heads x head dim per
query-key pair a row sees). Best of a few repeats; every pair alternates in this one process.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
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


def _layers(seqs: list[tuple[int, int]], layers: int):
    """`layers` batches with the same shape and block tables, each its own cache tensors."""
    first = _batch(seqs)
    rest = [_batch(seqs) for _ in range(layers - 1)]
    return [first, *[dataclasses.replace(first, key_cache=b.key_cache, value_cache=b.value_cache) for b in rest]]


def _cpp(batch, out, *, few_rows: int, q_chunk: int | None = None, block: bool = False) -> None:
    """The C++ kernel on every chunk (no flash route): with its blocked loop for chunks of
    more than BLOCK_MIN_ROWS query rows (`block`), its few-row loop for items of up to
    FEW_ROWS rows (`few_rows`), the one-pass loop for the rest."""
    few = cpu_kernels.few_rows_q_chunk(batch.query, KV_HEADS) if few_rows else None
    cpu_kernels.load().paged_attention(out, *batch.args(), batch.scale, 0, q_chunk or few or cpu_kernels.Q_CHUNK, 0,
                                       few_rows, cpu_kernels.BLOCK_MIN_ROWS if block else 0, 0)


def _invariant(batch, out) -> None:
    """The batch-invariant route (`--batch-invariant`, bf16)."""
    cpu_kernels.paged_attention(*batch.args(), batch.scale, out, invariant=True)


def _flash(batch, out) -> None:
    """torch's flash kernel, one call per sequence (the route of long bf16 chunks before)."""
    starts, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    for i in range(len(lens)):
        cpu_kernels._attend_long_chunk(out, batch.query, batch.key_cache, batch.value_cache, batch.block_tables[i],
                                       lens[i], starts[i], starts[i + 1], batch.scale)


def _causal_flops(seqs: list[tuple[int, int]]) -> float:
    """QK^T and PV products of the pairs each query row sees: a chunk of q tokens after c
    cached ones sees q x c + q (q + 1) / 2."""
    return sum(4 * HEADS * HEAD_DIM * ((ctx - q) * q + q * (q + 1) / 2) for ctx, q in seqs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="small shapes and 4 layers: a smoke test")
    ap.add_argument("--baseline-rev", default=None,
                    help="only the table of this tree's decodes against git revision REV's kernels")
    args = ap.parse_args(argv)
    if args.baseline_rev:
        _baseline_table(args)
        return 0
    if cpu_kernels.load() is None:
        raise SystemExit(f"the CPU kernels are not available: {cpu_kernels.unavailable_reason()}")
    if not cpu_kernels.bf16_gemv_available():
        print("note: no AVX512-BF16 here: the few-row loop does not run, both C++ columns are the one-pass loop\n")
    threads = torch.get_num_threads()
    layers = 4 if args.quick else 30
    few = cpu_kernels.FEW_ROWS

    print("Decodes, one thread, CPU time per layer:\n")
    print("| batch | C++ few-row loop (the route taken) | C++ one-pass loop (before) | torch reference (gather + SDPA) |")
    print("|---|---:|---:|---:|")
    torch.set_num_threads(1)
    for bs, ctx in [(1, 190), (8, 190)] if args.quick else [(1, 190), (1, 2000), (64, 190)]:
        b = _batch([(ctx, 1)] * bs)
        out = torch.empty_like(b.query)
        new = _best(lambda: _cpp(b, out, few_rows=few), time.process_time, args.repeats, 10)
        old = _best(lambda: _cpp(b, out, few_rows=0), time.process_time, args.repeats, 10)
        ref = _best(lambda: reference.paged_attention(*b.args(), b.scale), time.process_time, args.repeats, 10)
        print(f"| {bs} x {ctx} tokens | {new * 1e6:.0f} us | {old * 1e6:.0f} us ({old / new:.2f}x) | "
              f"{ref * 1e6:.0f} us ({ref / new:.1f}x) |")

    torch.set_num_threads(threads)
    print(f"\nDecodes, {layers} layers, {threads} threads, wall time per layer:\n")
    print("| batch | --batch-invariant | C++ few-row loop (default) | C++ one-pass loop (before) | speed-up |")
    print("|---|---:|---:|---:|---:|")
    for bs, ctx in [(8, 100)] if args.quick else [(1, 1000), (32, 200), (64, 190), (8, 1000)]:
        batches = _layers([(ctx, 1)] * bs, layers)
        out = torch.empty_like(batches[0].query)
        inv = _best(lambda: [_invariant(b, out) for b in batches], time.perf_counter, args.repeats, 1) / layers
        new = _best(lambda: [_cpp(b, out, few_rows=few) for b in batches], time.perf_counter, args.repeats, 1) / layers
        old = _best(lambda: [_cpp(b, out, few_rows=0) for b in batches], time.perf_counter, args.repeats, 1) / layers
        print(f"| {bs} x {ctx} tokens | {inv * 1e6:.0f} us ({inv / new:.2f}x) | {new * 1e6:.0f} us | {old * 1e6:.0f} us | "
              f"{old / new:.2f}x |")

    print(f"\nPrompts without cached tokens, {layers} layers, {threads} threads, wall time per layer:\n")
    print("| prompts | --batch-invariant | C++ blocked loop (default) | C++ few-row loop (before, up to "
          "1024 tokens) | flash kernel, per prompt (before, longer) |")
    print("|---|---:|---:|---:|---:|")
    for bs, n in [(2, 64)] if args.quick else [(4, 128), (2, 512), (1, 2048)]:
        batches = _layers([(n, n)] * bs, layers)
        out = torch.empty_like(batches[0].query)
        flops = _causal_flops([(n, n)] * bs)
        blocked = _best(lambda: [_cpp(b, out, few_rows=few, block=True) for b in batches], time.perf_counter,
                        args.repeats, 1) / layers
        rows = _best(lambda: [_cpp(b, out, few_rows=few) for b in batches], time.perf_counter, args.repeats, 1) / layers
        flash = _best(lambda: [_flash(b, out) for b in batches], time.perf_counter, args.repeats, 1) / layers
        inv = _best(lambda: [_invariant(b, out) for b in batches], time.perf_counter, args.repeats, 1) / layers
        print(f"| {bs} x {n} tokens | {_fmt(inv, flops)} ({inv / blocked:.2f}x) | {_fmt(blocked, flops)} | "
              f"{_fmt(rows, flops)} ({rows / blocked:.2f}x) | "
              f"{_fmt(flash, flops)} ({flash / blocked:.2f}x) |")

    print(f"\nOne prefill chunk after cached tokens, {threads} threads, wall time per layer:\n")
    print("| chunk x context | --batch-invariant | C++ blocked loop (default) | flash, query heads "
          "folded per KV head (before) |")
    print("|---|---:|---:|---:|")
    for q_len, ctx in [(40, 1200)] if args.quick else [(50, 7000), (150, 7000), (512, 4000)]:
        b = _batch([(ctx, q_len)])
        out = torch.empty_like(b.query)
        flops = _causal_flops([(ctx, q_len)])
        blocked = _best(lambda: _cpp(b, out, few_rows=few, block=True), time.perf_counter, 3, 1)
        flash = _best(lambda: _flash(b, out), time.perf_counter, 3, 1)
        inv = _best(lambda: _invariant(b, out), time.perf_counter, 3, 1)
        print(f"| {q_len} x {ctx} | {_fmt(inv, flops)} ({inv / blocked:.2f}x) | {_fmt(blocked, flops)} | "
              f"{_fmt(flash, flops)} ({flash / blocked:.2f}x) |")

    _pages_table(args)
    return 0


def _pages_table(args) -> None:
    """Decodes of the 1B-class model's heads (32 query / 8 KV x 64) on the default route, their
    caches on 4 KB pages (torch.zeros) and on huge pages (engine/huge_pages.py,
    as the engine's CPU cache is), each layer its own cache, the two in
    turns: blocks packed at the cache's start, and spread over a 4096-block cache (the
    1B-class model's default 2 GiB) as a long-running server's free list leaves them."""
    from engine.huge_pages import copy_on_huge_pages, huge_pages_advisable, transparent_huge_pages

    layers = 4 if args.quick else 16
    print(f"\nDecodes of 32 query / 8 KV heads, {layers} layers, {torch.get_num_threads()} threads, wall time "
          f"per layer, the caches on 4 KB pages against huge pages (transparent huge pages: "
          f"`{transparent_huge_pages()}`):\n")
    if not huge_pages_advisable():
        print("(no huge pages to ask for here: both columns are 4 KB pages)\n")
    print("| batch x context | blocks | 4 KB pages | huge pages | huge / 4 KB |")
    print("|---|---|---:|---:|---:|")
    shapes = [(8, 64, 512)] if args.quick else [(32, 64, 0), (32, 64, 4096), (32, 512, 4096)]
    for bs, ctx, cache_blocks in shapes:
        seqs = [(ctx + i % 8, 1) for i in range(bs)]
        small = [make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16,
                            block_order="sequential" if not cache_blocks else "shuffled", seed=i,
                            num_blocks=cache_blocks or None) for i in range(layers)]
        huge = [dataclasses.replace(b, key_cache=copy_on_huge_pages(b.key_cache),
                                    value_cache=copy_on_huge_pages(b.value_cache)) for b in small]
        out = torch.empty_like(small[0].query)
        times = {"4k": [], "huge": []}
        for turn in range(2 * args.repeats):
            for name in ("4k", "huge") if turn % 2 == 0 else ("huge", "4k"):
                batches = small if name == "4k" else huge
                times[name].append(_best(lambda: [_invariant(b, out) for b in batches], time.perf_counter, 1, 3)
                                   / layers)
        four_k, on_huge = min(times["4k"]), min(times["huge"])
        where = f"spread over {cache_blocks}" if cache_blocks else "packed"
        print(f"| {bs} x {ctx} tokens | {where} | {four_k * 1e6:.0f} us | {on_huge * 1e6:.0f} us | "
              f"{on_huge / four_k:.2f}x |")


def _baseline_table(args) -> None:
    """Decodes with the 1B-class model's heads (32 query / 8 KV x 64), 32 sequences, each
    layer its own cache on huge pages (as the engine's), blocks spread over the cache, on the
    default route (`attention_invariant`) and on `--no-batch-invariant`'s few-row loop: this
    tree's kernels against `--baseline-rev`'s (loadtest/bench_linear.py revision_kernels),
    calls alternating in this one process, and whether their outputs are the same bits."""
    from engine.huge_pages import copy_on_huge_pages
    from loadtest.bench_linear import revision_kernels

    layers = 4 if args.quick else 16
    mods = {"this tree": cpu_kernels.load(), args.baseline_rev: revision_kernels(args.baseline_rev)}
    print(f"Decodes of 32 query / 8 KV heads, {layers} layers, {torch.get_num_threads()} threads, the caches on "
          f"huge pages: wall time of the {layers} layers, median of {2 * args.repeats} alternating turns each\n")
    print(f"| batch x context | route | this tree | {args.baseline_rev} | this / {args.baseline_rev} | same bits |")
    print("|---|---|---:|---:|---:|---|")
    for bs, ctx in [(4, 64)] if args.quick else [(32, 64), (32, 512)]:
        seqs = [(ctx + i % 8, 1) for i in range(bs)]
        batches = [make_batch(seqs, num_heads=32, num_kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16,
                              block_order="shuffled", seed=i) for i in range(layers)]
        batches = [dataclasses.replace(b, key_cache=copy_on_huge_pages(b.key_cache),
                                       value_cache=copy_on_huge_pages(b.value_cache)) for b in batches]
        few_chunk = cpu_kernels.few_rows_q_chunk(batches[0].query, 8) or cpu_kernels.Q_CHUNK
        routes = {  # paged_attention's routing arguments after the scale
            "default (invariant)": (0, cpu_kernels.INVARIANT_Q_CHUNK, 0, cpu_kernels.FEW_ROWS, 0, cpu_kernels.KEY_PART),
            "--no-batch-invariant few-row loop": (0, few_chunk, 0, cpu_kernels.FEW_ROWS, 0, 0),
        }
        for route, routing in routes.items():
            outs = {name: [torch.empty_like(b.query) for b in batches] for name in mods}

            def run(name: str) -> None:
                for b, out in zip(batches, outs[name]):
                    mods[name].paged_attention(out, *b.args(), b.scale, *routing)

            times = {name: [] for name in mods}
            for turn in range(2 * args.repeats):
                for name in list(mods) if turn % 2 == 0 else list(mods)[::-1]:
                    times[name].append(_best(lambda: run(name), time.perf_counter, 1, 3))
            same = all(torch.equal(a, b) for a, b in zip(*outs.values()))
            this, base = (statistics.median(times[name]) for name in mods)
            print(f"| {bs} x {ctx} tokens | {route} | {this * 1e3:.2f} ms | {base * 1e3:.2f} ms | {this / base:.3f}x | "
                  f"{'yes' if same else 'NO'} |")


def _fmt(seconds: float, flops: float) -> str:
    return f"{seconds * 1e3:.2f} ms ({flops / seconds / 1e9:.0f} GFLOP/s)"


if __name__ == "__main__":
    raise SystemExit(main())
