"""HTTP vs offline: the same 32-request workload through `pagoda serve` and through `LLM`.

    python -m loadtest.bench_http                    # 32 concurrent streams, 128 tokens each
    python -m loadtest.bench_http --concurrency 1 --dtype bfloat16   # one stream: ITL vs the offline step

Both halves run in this one invocation, one after the other (never at the same time, so
they don't share the CPU): first the offline engine (`LLM.generate`, batch 32), then a
`pagoda serve` subprocess on a free loopback port with the same engine arguments, driven
by 32 concurrent streaming /v1/completions requests (greedy, `ignore_eos`). Output tokens/s
= generated tokens / wall time of the batch, after a warm-up round in both cases. The
issue's goal: HTTP >= 85% of offline.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from loadtest.bench_offline import make_prompts
from loadtest.client import RequestParams
from loadtest.datasets import BenchRequest
from loadtest.runner import LoadSpec, run_load
from loadtest.servers import LaunchedServer, pagoda_spec
from loadtest.summary import summarize


def offline_tok_s(prompts: list[str], max_tokens: int, dtype: str) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


def http_run(url: str, prompts: list[str], max_tokens: int) -> dict:
    """All prompts at once as streamed /v1/completions (the loadtest client), after a warm-up."""
    requests = [BenchRequest(max_tokens, prompt=p) for p in prompts]
    params = RequestParams(model=None, temperature=0.0, fixed_length_fields=lambda n: {"ignore_eos": True})
    outcome = asyncio.run(run_load(url, requests, requests[:4], params, LoadSpec(concurrency=len(requests))))
    s = summarize(outcome.results, outcome.wall_s)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['first_errors']}")
    return {
        "tok_s": s["output_throughput"],
        "tokens": s["output_tokens"],
        "median_ttft_s": s["ttft"]["median_ms"] / 1000,
        "median_itl_s": s["itl"]["median_ms"] / 1000 if s["itl"] else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="float32, or bfloat16 (the CPU default where native)")
    args = ap.parse_args(argv)
    prompts = make_prompts(args.concurrency, tag=7)

    print("[bench] offline engine ...", file=sys.stderr, flush=True)
    offline = offline_tok_s(prompts, args.max_tokens, args.dtype)
    print("[bench] HTTP server ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-http-") as log_dir:
        server = LaunchedServer(pagoda_spec(None, args.dtype, []), Path(log_dir))
        try:
            server.wait_ready(180)
            http = http_run(server.url, prompts, args.max_tokens)
        finally:
            server.stop()

    ratio = http["tok_s"] / offline
    print(f"\nHTTP vs offline: {args.concurrency} concurrent streams, {args.max_tokens} tokens each, {args.dtype}\n")
    print("| what | value |")
    print("|---|---:|")
    print(f"| offline LLM.generate batch {args.concurrency} | {offline:.1f} tok/s |")
    print(f"| HTTP streaming, {args.concurrency} concurrent | {http['tok_s']:.1f} tok/s |")
    print(f"| HTTP median TTFT | {http['median_ttft_s'] * 1000:.0f} ms |")
    print(f"| HTTP median inter-chunk latency | {http['median_itl_s'] * 1000:.1f} ms |")
    print(f"| HTTP / offline | {ratio:.1%} (goal >= 85%) {'PASS' if ratio >= 0.85 else 'MISS'} |")
    if args.concurrency == 1:
        # One stream: what HTTP adds per token, against the offline time per token (a
        # decode step, with the prefill spread over the output).
        step_ms = 1000 / offline
        print(f"| offline time per token, batch 1 | {step_ms:.1f} ms |")
        print(f"| HTTP median ITL / offline time per token | {http['median_itl_s'] * 1000 / step_ms:.2f}x (goal <= 1.1x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
