"""Prefix-caching benchmark: shared system prompt vs none, caching on vs off, one run.

    python -m loadtest.bench_prefix                  # 64 requests, 512-token shared prefix
    python -m loadtest.bench_prefix --num-requests 16 --quick

All requests arrive at once (offline, through EngineCore). Time to first token is
measured per request from its arrival to its first sampled token; output tokens/s is
all generated tokens over the wall time of the whole batch. Each configuration runs on a
fresh engine so nothing is cached beforehand; the ratios compare runs made minutes apart
on the same machine with the same prompts.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams

_WORDS = (
    "river mountain lantern quiet copper garden orbit velvet signal harbor meadow crystal "
    "engine thunder paper window marble forest canyon ember violet anchor compass echo"
).split()


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def make_prompts(tokenizer, num_requests: int, prefix_tokens: int, question_tokens: int, shared: bool) -> list[list[int]]:
    """Token-id prompts: an exact-length system prefix (shared or per request) + a distinct question."""
    rng = random.Random(0)
    common = tokenizer.encode("System: " + _text(rng, prefix_tokens * 2))[:prefix_tokens]
    prompts = []
    for i in range(num_requests):
        prefix = common if shared else tokenizer.encode(f"System {i}: " + _text(rng, prefix_tokens * 2))[:prefix_tokens]
        question = tokenizer.encode(f" Question {i}: " + _text(rng, question_tokens * 2))[:question_tokens]
        prompts.append(prefix + question)
    return prompts


def run(prompts: list[list[int]], prefix_caching: bool, max_tokens: int, dtype: str) -> dict:
    core = EngineCore(EngineConfig.from_engine_args(dtype=dtype, enable_prefix_caching=prefix_caching), log=False)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    requests = []
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
        requests.append(core.requests[str(i)])
    while core.has_unfinished_requests():
        core.step()
    wall = time.perf_counter() - t0
    ttfts = [r.first_token_time - r.arrival_time for r in requests]
    generated = sum(r.num_output_tokens for r in requests)
    return {
        "median_ttft_s": statistics.median(ttfts),
        "output_tok_s": generated / wall,
        "cached_tokens": sum(r.num_cached_tokens for r in requests),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-unshared", action="store_true", help="skip the no-shared-prefix control")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model(verbose=False)))
    cases = [("shared", True)] + ([] if args.skip_unshared else [("unshared", False)])
    results = {}
    for name, shared in cases:
        prompts = make_prompts(tokenizer, args.num_requests, args.prefix_tokens, args.question_tokens, shared)
        for caching in (True, False):
            print(f"[bench] {name} prefix, prefix caching {'on' if caching else 'off'} ...", file=sys.stderr, flush=True)
            results[(name, caching)] = run(prompts, caching, args.max_tokens, args.dtype)

    print(
        f"\nPrefix caching: {args.num_requests} requests, {args.prefix_tokens}-token system prompt + "
        f"{args.question_tokens}-token question, {args.max_tokens} new tokens, {args.dtype}\n"
    )
    print("| prefix | caching | median TTFT (s) | output tok/s | cached prompt tokens | wall (s) |")
    print("|---|---|---:|---:|---:|---:|")
    for (name, caching), r in results.items():
        print(f"| {name} | {'on' if caching else 'off'} | {r['median_ttft_s']:.3f} | {r['output_tok_s']:.1f} | "
              f"{r['cached_tokens']} | {r['wall_s']:.1f} |")
    on, off = results[("shared", True)], results[("shared", False)]
    print(f"\nshared prefix: median TTFT off/on = {off['median_ttft_s'] / on['median_ttft_s']:.2f}x (goal >= 5x), "
          f"output tok/s on/off = {on['output_tok_s'] / off['output_tok_s']:.2f}x (goal >= 2x)")
    if ("unshared", True) in results:
        u_on, u_off = results[("unshared", True)], results[("unshared", False)]
        print(f"no shared prefix: output tok/s on/off = {u_on['output_tok_s'] / u_off['output_tok_s']:.3f}x "
              f"(goal within 2%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
