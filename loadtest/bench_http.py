"""HTTP vs offline: the same 32-request workload through `pagoda serve` and through `LLM`.

    python -m loadtest.bench_http                    # 32 concurrent streams, 128 tokens each

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
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from loadtest.bench_offline import make_prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_tok_s(prompts: list[str], max_tokens: int, dtype: str) -> float:
    from engine import LLM, SamplingParams

    llm = LLM(dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / wall


async def _stream_one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[int, float, list[float]]:
    """Returns (completion tokens, TTFT, inter-chunk gaps) of one streamed completion."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    last = t0
    gaps: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            now = time.perf_counter()
            if chunk.get("choices"):
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return tokens, first or 0.0, gaps


async def http_run(url: str, prompts: list[str], max_tokens: int) -> dict:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await asyncio.gather(*[_stream_one(client, p, 8) for p in prompts[:4]])  # warm-up
        t0 = time.perf_counter()
        results = await asyncio.gather(*[_stream_one(client, p, max_tokens) for p in prompts])
        wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    gaps = [g for r in results for g in r[2]]
    return {
        "tok_s": tokens / wall,
        "tokens": tokens,
        "median_ttft_s": statistics.median(r[1] for r in results),
        "median_itl_s": statistics.median(gaps) if gaps else 0.0,
    }


def serve(port: int, dtype: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), "--dtype", dtype, "--no-access-log"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not become healthy in 180 s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    prompts = make_prompts(args.concurrency, tag=7)

    print("[bench] offline engine ...", file=sys.stderr, flush=True)
    offline = offline_tok_s(prompts, args.max_tokens, args.dtype)
    print("[bench] HTTP server ...", file=sys.stderr, flush=True)
    port = _free_port()
    proc = serve(port, args.dtype)
    try:
        http = asyncio.run(http_run(f"http://127.0.0.1:{port}", prompts, args.max_tokens))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

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
