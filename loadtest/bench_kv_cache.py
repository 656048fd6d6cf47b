"""What an INT8 KV cache (`--kv-cache-dtype int8`) buys on CPU, against the bf16 cache, in one
process with both engines loaded side by side (each idle while the other runs), in rounds
whose order alternates:

    python -m loadtest.bench_kv_cache                      # all three (~15 min on 2 idle cores)
    python -m loadtest.bench_kv_cache --parts capacity itl --rounds 5

- capacity: blocks and tokens each engine's `--kv-cache-memory` holds (the issue: >= 1.9x);
- itl: batch-1 decode after `--itl-contexts` tokens of context (4096 and 8128): a random
  prompt of that length is prefilled once, then each round asks for it again (a prefix-cache
  hit: only its last partial block is recomputed) with 1 and with 33 greedy tokens; ITL =
  (t(33) - t(1)) / 32, the median over rounds (the issue: int8 <= 0.85x bf16);
- streams: `--streams` requests of `--stream-prompt-len` random prompt tokens and
  `--stream-output-len` greedy tokens at once (contexts growing to 2048), with a
  `--stream-kv-memory` the int8 cache holds all of them in and the bf16 cache about half
  (so the bf16 run is KV-bound: it admits fewer streams per step, and preempts). Reported:
  output tok/s over the whole run (prefill included: the same prompt work in both, plus the
  bf16 run's recomputations) and over its decode-only steps, the mean decode batch and the
  preemptions (the issue: >= 1.3x output tok/s).

This VM's memory bandwidth drifts by up to 2x over minutes: only the same round's figures
are compared, and the ratios quoted are of the medians over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _engine(kind: str, **args):
    from engine import LLM

    return LLM(dtype="bfloat16", kv_cache_dtype=kind, **args)


def capacity(memory_gib: float) -> dict[str, tuple[int, int]]:
    out = {}
    for kind in ("auto", "int8"):
        llm = _engine(kind, kv_cache_memory=memory_gib, max_model_len=2048)
        w = llm.engine_core.worker
        out[kind] = (w.num_blocks, w.num_blocks * w.kv_spec.block_size, w.kv_spec.bytes_per_token)
        llm.shutdown()
    return out


def itl_ms(llm, prompt: list[int]) -> float:
    from engine import SamplingParams

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t0

    one = min(timed(1), timed(1))  # a prefix-cache hit: the last partial block and one token
    full = timed(33)
    return 1000 * (full - one) / 32


class StepClock:
    """Times an engine's steps through `on_step`: the decode-only steps' tokens and seconds."""

    def __init__(self, llm) -> None:
        self.last = None
        self.decode_tokens = self.decode_rows = self.decode_steps = self.preemptions = 0
        self.decode_s = 0.0
        llm.engine_core.on_step = self

    def __call__(self, stats) -> None:
        now = time.perf_counter()
        self.preemptions += stats.num_preemptions
        if self.last is not None and stats.num_prompt_tokens == 0 and \
                stats.num_scheduled_tokens == stats.num_generation_tokens > 0:
            self.decode_tokens += stats.num_generation_tokens
            self.decode_rows += stats.num_scheduled_tokens
            self.decode_steps += 1
            self.decode_s += now - self.last
        self.last = now


def streams_run(llm, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    from engine import SamplingParams

    clock = StepClock(llm)
    clock.last = time.perf_counter()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    llm.engine_core.on_step = None
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tok_s": tokens / elapsed,
        "decode_tok_s": clock.decode_tokens / clock.decode_s if clock.decode_s else float("nan"),
        "batch": clock.decode_rows / max(1, clock.decode_steps),
        "preemptions": clock.preemptions,
        "seconds": elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["capacity", "itl", "streams"], choices=["capacity", "itl", "streams"])
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the ITL part")
    parser.add_argument("--stream-rounds", type=int, default=2)
    parser.add_argument("--capacity-memory", type=float, default=1.0, help="GiB")
    parser.add_argument("--itl-contexts", type=int, nargs="+", default=[4096, 8128])
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-prompt-len", type=int, default=1536)
    parser.add_argument("--stream-output-len", type=int, default=512)
    parser.add_argument("--stream-kv-memory", type=float, default=1.5, help="GiB")
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)

    def random_prompt(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    if "capacity" in args.parts:
        cap = capacity(args.capacity_memory)
        (b16, t16, p16), (b8, t8, p8) = cap["auto"], cap["int8"]
        print(f"\ncapacity at --kv-cache-memory {args.capacity_memory} GiB: bf16 {b16} blocks = {t16} tokens "
              f"({p16} bytes/token), int8 {b8} blocks = {t8} tokens ({p8} bytes/token): {t8 / t16:.3f}x", flush=True)

    if "itl" in args.parts:
        engines = {kind: _engine(kind, max_model_len=8192, enable_prefix_caching=True) for kind in ("auto", "int8")}
        prompts = {ctx: random_prompt(ctx) for ctx in args.itl_contexts}
        for llm in engines.values():
            for prompt in prompts.values():
                itl_ms(llm, prompt)  # the prompt prefilled and cached, the scratch buffers grown
        figures = {(k, c): [] for k in engines for c in prompts}
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for ctx, prompt in prompts.items():
                for kind in order:
                    figures[(kind, ctx)].append(itl_ms(engines[kind], prompt))
            print(f"round {r + 1}: " + ", ".join(f"{k} @{c} {figures[(k, c)][-1]:.2f} ms" for c in prompts for k in engines),
                  flush=True)
        print(f"\nbatch-1 decode ITL (median of {args.rounds} alternating rounds, ms):")
        print("| context | bf16 KV | int8 KV | int8 / bf16 | rounds int8 <= 0.85x |")
        print("|---:|---:|---:|---:|---:|")
        for ctx in prompts:
            a, b = figures[("auto", ctx)], figures[("int8", ctx)]
            ok = sum(y / x <= 0.85 for x, y in zip(a, b))
            print(f"| {ctx} | {statistics.median(a):.2f} | {statistics.median(b):.2f} | "
                  f"{statistics.median(b) / statistics.median(a):.3f}x | {ok} of {len(a)} |", flush=True)
        for llm in engines.values():
            llm.shutdown()

    if "streams" in args.parts:
        max_len = args.stream_prompt_len + args.stream_output_len
        engines = {kind: _engine(kind, kv_cache_memory=args.stream_kv_memory, max_model_len=max_len,
                                 enable_prefix_caching=False, max_num_seqs=args.streams) for kind in ("auto", "int8")}
        for kind, llm in engines.items():
            w = llm.engine_core.worker
            tokens = w.num_blocks * w.kv_spec.block_size
            print(f"{kind}: {tokens} KV tokens = {tokens / max_len:.1f} streams of {max_len} tokens", flush=True)
        runs = {k: [] for k in engines}
        for r in range(args.stream_rounds):
            prompts = [random_prompt(args.stream_prompt_len) for _ in range(args.streams)]
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for kind in order:
                runs[kind].append(streams_run(engines[kind], prompts, args.stream_output_len))
                f = runs[kind][-1]
                print(f"round {r + 1} {kind}: {f['tok_s']:.1f} output tok/s over {f['seconds']:.0f} s, decode steps "
                      f"{f['decode_tok_s']:.1f} tok/s at {f['batch']:.1f} rows, {f['preemptions']} preemptions", flush=True)
        med = statistics.median
        print(f"\n{args.streams} streams x ({args.stream_prompt_len} prompt + {args.stream_output_len} output) tokens, "
              f"--kv-cache-memory {args.stream_kv_memory} GiB (median of {args.stream_rounds} alternating rounds):")
        print("| KV cache | output tok/s (whole run) | decode-step tok/s | mean decode batch | preemptions |")
        print("|---|---:|---:|---:|---:|")
        for kind in engines:
            fs = runs[kind]
            print(f"| {'bf16' if kind == 'auto' else kind} | {med(f['tok_s'] for f in fs):.1f} | "
                  f"{med(f['decode_tok_s'] for f in fs):.1f} | {med(f['batch'] for f in fs):.1f} | "
                  f"{med(f['preemptions'] for f in fs):.0f} |")
        a, b = runs["auto"], runs["int8"]
        print(f"int8 / bf16: {med(f['tok_s'] for f in b) / med(f['tok_s'] for f in a):.3f}x whole run, "
              f"{med(f['decode_tok_s'] for f in b) / med(f['decode_tok_s'] for f in a):.3f}x decode steps")


if __name__ == "__main__":
    main()
