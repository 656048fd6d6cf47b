"""What batch invariance costs: the default engine (batch-invariant: `batch_invariant=True`)
against the same commit's non-invariant paths, in alternating rounds in one process:
"fast" (`--no-batch-invariant`: the same C++ bf16 linear kernel, attention on its
thread-split, few-row and blocked routes, which follow the step's composition) and
"onednn" (that plus `PAGODA_CPU_GEMV=0`: oneDNN's packed GEMM for every bf16 linear, the
linears of the default path before the C++ kernel served every row count).

    python -m loadtest.bench_invariance                 # bf16: 1 and 32 streams, one long prompt (~8 min on 2 idle cores)
    python -m loadtest.bench_invariance --rounds 7 --input-len 128 --output-len 64

The engines are loaded side by side (each idle while the others run). Each round runs, for
each engine in turn (the order rotating between rounds): one request of `--input-len`
random prompt tokens and `--output-len` greedy tokens (1 stream), then `--streams` such
requests at once (prefill chunks and decode steps of up to 32 rows, the serving case the
issue budgets), then one prompt of `--long-input-len` tokens with 16 output tokens (where
the invariant attention route's prefill is slower). The figure per engine and load is output
tokens / wall time of the generate call, prefill included; the median over rounds is
reported, with the ratio invariant / fast (>= 0.95 is the issue's budget: at most 5% slower).
This VM's memory bandwidth drifts by up to 2x over minutes, so only the same round's figures
are compared and the ratio of medians is the one quoted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def output_tok_s(llm, prompts: list[list[int]], params) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--long-input-len", type=int, default=2048, help="0: no long-prompt load")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="GiB of KV cache per engine (default: the engine's); three engines are up at once")
    args = parser.parse_args()

    from engine import LLM, SamplingParams

    cache = {} if args.kv_cache_memory is None else {"kv_cache_memory": args.kv_cache_memory}
    engines = {
        "invariant": LLM(dtype=args.dtype, batch_invariant=True, enable_prefix_caching=False, **cache),
        "fast": LLM(dtype=args.dtype, batch_invariant=False, enable_prefix_caching=False, **cache),
    }
    before = os.environ.get("PAGODA_CPU_GEMV")
    os.environ["PAGODA_CPU_GEMV"] = "0"  # read when the engine packs its weights
    try:
        engines["onednn"] = LLM(dtype=args.dtype, batch_invariant=False, enable_prefix_caching=False, **cache)
    finally:
        if before is None:
            os.environ.pop("PAGODA_CPU_GEMV")
        else:
            os.environ["PAGODA_CPU_GEMV"] = before
    vocab = engines["fast"].engine_core.worker.args.vocab_size
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    long_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    loads = {"1 stream": (1, args.input_len), f"{args.streams} streams": (args.streams, args.input_len)}
    if args.long_input_len:
        loads[f"1 x {args.long_input_len}-token prompt, 16 tokens"] = (1, args.long_input_len)
    for llm in engines.values():  # warm-up: first calls build scratch buffers and caches
        llm.generate([torch.randint(100, vocab, (args.input_len,), generator=g).tolist()],
                     SamplingParams(max_tokens=4, ignore_eos=True))
    figures: dict[tuple[str, str], list[float]] = {(e, load): [] for e in engines for load in loads}
    names = list(engines)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for load, (n, length) in loads.items():
            prompts = [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]
            for name in order:
                figures[(name, load)].append(output_tok_s(engines[name], prompts,
                                                          params if length == args.input_len else long_params))
        print(f"round {r + 1}: " + ", ".join(f"{name} {load} {figures[(name, load)][-1]:.1f} tok/s"
                                              for load in loads for name in engines), flush=True)
    print()
    print(f"bf16 batch invariance, {args.input_len}-token prompts, {args.output_len} greedy tokens each, "
          f"{args.rounds} alternating rounds (median output tok/s, prefill included):")
    print("| load | default (batch-invariant) | --no-batch-invariant | ratio | rounds where invariant >= 0.95x "
          "| oneDNN linears, not invariant | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for load in loads:
        inv, fast, onednn = figures[("invariant", load)], figures[("fast", load)], figures[("onednn", load)]
        ok = sum(a / b >= 0.95 for a, b in zip(inv, fast))
        med = statistics.median
        print(f"| {load} | {med(inv):.1f} | {med(fast):.1f} | {med(inv) / med(fast):.3f}x | {ok} of {len(inv)} | "
              f"{med(onednn):.1f} | {med(inv) / med(onednn):.3f}x |")


if __name__ == "__main__":
    main()
