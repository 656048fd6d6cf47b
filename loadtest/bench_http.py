"""HTTP vs offline: the same workload through `pagoda serve` and through `LLM`.

    python -m loadtest.bench_http                    # 32 concurrent streams, 128 tokens each
    python -m loadtest.bench_http --concurrency 1 --dtype bfloat16   # one stream: ITL vs the offline step

Both halves run in this one invocation, never at the same time (they would share the CPU).

Many streams: first the offline engine (`LLM.generate`, batch 32), then a `pagoda serve`
subprocess on a free loopback port with the same engine arguments, driven by 32 concurrent
streaming /v1/completions requests (greedy, `ignore_eos`). Output tokens/s = generated
tokens / wall time of the batch, after a warm-up round in both cases. Goal: HTTP >= 85% of
offline.

One stream (`--concurrency 1`): what HTTP adds per token. The server and the offline engine
are both loaded (each idle while the other runs), and `--rounds` rounds alternate the two,
so both see the same minute of this VM's drifting memory bandwidth: the offline batch-1
decode step (the engine's own step time, T(max_tokens) - T(1) over the steps between, as
bench_offline) against the median gap between streamed tokens of one HTTP request of the
same length, each round a ratio; the median round is the figure (goal <= 1.1x). Where the
rest goes: the CPU time per token of the server's event-loop thread (SSE chunks, socket
writes) and of this client, both taken from the two cores the decode step runs on.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.bench_offline import batch1_step_s, make_prompts, pagoda_run
from loadtest.client import RequestParams, send_request
from loadtest.datasets import BenchRequest
from loadtest.machine import thread_seconds
from loadtest.runner import LoadSpec, run_load
from loadtest.servers import LaunchedServer, pagoda_spec
from loadtest.summary import summarize


# Greedy streamed requests of exactly max_tokens tokens (this server honours ignore_eos).
GREEDY_FIXED_LENGTH = RequestParams(model=None, temperature=0.0, fixed_length_fields=lambda n: {"ignore_eos": True})


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
    outcome = asyncio.run(run_load(url, requests, requests[:4], GREEDY_FIXED_LENGTH, LoadSpec(concurrency=len(requests))))
    s = summarize(outcome.results, outcome.wall_s)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} requests failed: {s['first_errors']}")
    return {
        "tok_s": s["output_throughput"],
        "tokens": s["output_tokens"],
        "median_ttft_s": s["ttft"]["median_ms"] / 1000,
        "median_itl_s": s["itl"]["median_ms"] / 1000 if s["itl"] else 0.0,
    }


def one_stream_rounds(url: str, server_pid: int, llm, max_tokens: int, rounds: int) -> list[dict]:
    """Alternate the offline batch-1 decode step and one streamed HTTP request, `rounds` times.

    Each round: a fresh prompt for each side (no prefix-cache hits), the offline side's step
    from engine stats, the HTTP side's median inter-token gap, and the CPU seconds per
    token the server's main (event-loop) thread and this thread (the client's event loop)
    spent during the HTTP request (the server's from /proc, in clock ticks of ~10 ms: a
    coarse figure for a short request). Even rounds run offline first, odd rounds HTTP first.
    """
    tags = iter(range(100, 10**6))
    out = []
    for r in range(rounds):
        row: dict = {}

        def offline() -> None:
            row["step_s"] = batch1_step_s(llm, max_tokens, tags)

        def http() -> None:
            # One request on its own client: no warm-up and no /metrics scrapes (run_load's
            # sampler would render and parse the registry mid-stream), CPU counted over the
            # stream only.
            request = BenchRequest(max_tokens, prompt=make_prompts(1, next(tags))[0])

            async def one() -> tuple:
                async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                    before, client_before = thread_seconds(server_pid, server_pid), time.thread_time()
                    result = await send_request(client, request, GREEDY_FIXED_LENGTH, time.perf_counter())
                    after = thread_seconds(server_pid, server_pid)  # the server's main thread: its event loop
                    loop_cpu = None if before is None or after is None else after - before
                    return result, loop_cpu, time.thread_time() - client_before

            result, loop_cpu, client_cpu = asyncio.run(one())
            if not result.ok or not result.itl_s:
                raise RuntimeError(f"the HTTP request failed: {result.error_kind}: {result.error}")
            row["itl_s"] = statistics.median(result.itl_s)
            row["server_loop_cpu_s"] = loop_cpu / result.output_tokens if loop_cpu is not None else None
            row["client_cpu_s"] = client_cpu / result.output_tokens

        for side in ((offline, http) if r % 2 == 0 else (http, offline)):
            side()
        row["ratio"] = row["itl_s"] / row["step_s"]
        print(f"[bench] round {r + 1}/{rounds}: offline step {row['step_s'] * 1e3:.2f} ms, "
              f"HTTP ITL {row['itl_s'] * 1e3:.2f} ms, {row['ratio']:.3f}x", file=sys.stderr, flush=True)
        out.append(row)
    return out


def main_one_stream(args) -> int:
    from engine import LLM

    with tempfile.TemporaryDirectory(prefix="bench-http-") as log_dir:
        print("[bench] HTTP server ...", file=sys.stderr, flush=True)
        server = LaunchedServer(pagoda_spec(None, args.dtype, []), Path(log_dir))
        try:
            server.wait_ready(180)
            print("[bench] offline engine ...", file=sys.stderr, flush=True)
            llm = LLM(dtype=args.dtype)
            pagoda_run(llm, make_prompts(2, 1), 8)  # warm-up of both sides
            http_run(server.url, make_prompts(2, 2), 8)
            rows = one_stream_rounds(server.url, server.proc.pid, llm, args.max_tokens, args.rounds)
        finally:
            server.stop()

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    print(f"\nHTTP vs offline, one stream: {args.rounds} alternating rounds of {args.max_tokens} tokens, {args.dtype}\n")
    print("| round | offline batch-1 step | HTTP median ITL | ITL / step |")
    print("|---:|---:|---:|---:|")
    for i, row in enumerate(rows, 1):
        print(f"| {i} | {row['step_s'] * 1e3:.2f} ms | {row['itl_s'] * 1e3:.2f} ms | {row['ratio']:.3f}x |")
    ratio = med("ratio")
    met = sum(row["ratio"] <= 1.1 for row in rows)
    print(f"| median | {med('step_s') * 1e3:.2f} ms | {med('itl_s') * 1e3:.2f} ms | "
          f"**{ratio:.3f}x** (goal <= 1.1x: {'PASS' if ratio <= 1.1 else 'MISS'}; {met} of {len(rows)} rounds) |")
    if rows[0]["server_loop_cpu_s"] is not None:
        print(f"\nCPU per token taken from the step's two cores (the request's own costs "
              f"included, medians of the rounds): the server's event-loop thread {med('server_loop_cpu_s') * 1e3:.2f} ms, "
              f"this client's {med('client_cpu_s') * 1e3:.2f} ms")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="float32, or bfloat16 (the CPU default where native)")
    ap.add_argument("--rounds", type=int, default=7, help="one stream: alternating offline/HTTP rounds")
    args = ap.parse_args(argv)
    if args.concurrency == 1:
        return main_one_stream(args)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
