"""Fairness between API keys: one tenant's flood vs another tenant's single request.

    python -m loadtest.bench_fairness                 # the issue's scenario (defaults below)
    python -m loadtest.bench_fairness --quick         # a short run that checks it works

Each run starts `pagoda serve --max-num-seqs 8 --api-keys-file ...` with two named keys,
`tenant-a` and `tenant-b`, once with `--scheduling-policy fair` and once with `fcfs`
(arrival order: what the server did before named keys), one server at a time. In each
run tenant A opens `--a-streams` concurrent streams of `--max-tokens` tokens (ignore_eos,
so every stream is exactly that long); `--b-delay` seconds later tenant B sends one
request of the same shape. Reported per run: B's time to first token (TTFT), A's median
TTFT, their ratio (the goal is at most 0.3 under fair; fcfs gives about 1 or worse, B
waiting behind the whole flood), and A's total throughput (A's generated tokens over the
time from its first request to its last token), compared between the runs (the goal: fair
costs A at most 5%).

TTFT is measured by the client from sending the request to the first streamed text. The
numbers vary with what else runs on the machine; the ratios compare runs made a minute
apart with the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.processes import HttpServer, pagoda_command

KEYS = {"tenant-a": "bench-key-a", "tenant-b": "bench-key-b"}


async def _stream(http: httpx.AsyncClient, key: str, body: dict) -> tuple[float, float, int]:
    """One streamed completion: (TTFT, end time, tokens), times from time.monotonic()."""
    t0 = time.monotonic()
    ttft, tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            for choice in event.get("choices", []):
                if choice.get("text"):
                    tokens += 1  # one token per chunk: the engine emits each token's text as it comes
                    if ttft is None:
                        ttft = time.monotonic() - t0
    if ttft is None:
        raise RuntimeError("a stream produced no text")
    return ttft, time.monotonic(), tokens


async def _scenario(url: str, model: str, a_streams: int, max_tokens: int, b_delay: float) -> dict:
    body = {"model": model, "prompt": "Write a long story about a lighthouse keeper.", "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    limits = httpx.Limits(max_connections=a_streams + 8, max_keepalive_connections=a_streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.monotonic()
        a_tasks = [asyncio.create_task(_stream(http, KEYS["tenant-a"], body)) for _ in range(a_streams)]
        await asyncio.sleep(b_delay)
        b_ttft, _, _ = await _stream(http, KEYS["tenant-b"], body)
        a_results = await asyncio.gather(*a_tasks)
    a_ttfts = [r[0] for r in a_results]
    a_end = max(r[1] for r in a_results)
    a_tokens = sum(r[2] for r in a_results)
    return {
        "b_ttft": b_ttft,
        "a_median_ttft": statistics.median(a_ttfts),
        "a_tok_s": a_tokens / (a_end - start),
        "a_tokens": a_tokens,
    }


def run(policy: str, args: argparse.Namespace, keys_file: Path, log_dir: Path) -> dict:
    extra = ["--model", args.model] if args.model else []
    server = HttpServer(f"pagoda-{policy}", pagoda_command(
        "--max-num-seqs", str(args.max_num_seqs), "--api-keys-file", str(keys_file),
        "--scheduling-policy", policy, "--max-model-len", "1024", "--no-access-log", *extra,
    ), log_dir, drop_env=("PAGODA_API_KEY",))
    try:
        server.wait_ready(300)
        headers = {"Authorization": f"Bearer {KEYS['tenant-a']}"}
        model = httpx.get(f"{server.url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        # Warm-up: the first requests pay one-time costs (kernel builds, allocator growth).
        warm = {"model": model, "prompt": "Hello", "max_tokens": 8}
        for _ in range(2):
            httpx.post(f"{server.url}/v1/completions", json=warm, headers=headers, timeout=300).raise_for_status()
        return asyncio.run(_scenario(server.url, model, args.a_streams, args.max_tokens, args.b_delay))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-streams", type=int, default=48, help="tenant A's concurrent streams")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (A's and B's)")
    parser.add_argument("--b-delay", type=float, default=2.0, help="seconds after A's flood that B sends its request")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--policies", default="fair,fcfs", help="comma-separated --scheduling-policy values to run")
    parser.add_argument("--quick", action="store_true", help="a short run: 16 streams of 16 tokens, B after 0.5 s")
    args = parser.parse_args(argv)
    if args.quick:
        args.a_streams, args.max_tokens, args.b_delay = 16, 16, 0.5
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]

    with tempfile.TemporaryDirectory(prefix="pagoda-bench-fairness-") as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps({"keys": [{"name": n, "key": k} for n, k in KEYS.items()]}))
        results = {}
        for policy in policies:
            print(f"[bench_fairness] {policy}: {args.a_streams} streams of tenant A, tenant B after {args.b_delay:g} s",
                  file=sys.stderr, flush=True)
            results[policy] = run(policy, args, keys_file, Path(tmp))

    print(f"\nTenant A: {args.a_streams} concurrent streams of {args.max_tokens} tokens; tenant B: one request "
          f"{args.b_delay:g} s later; --max-num-seqs {args.max_num_seqs}.\n")
    print("| policy | B TTFT (s) | A median TTFT (s) | B / A median | A throughput (tok/s) | A vs fcfs |")
    print("|---|---|---|---|---|---|")
    base = results.get("fcfs")
    for policy, r in results.items():
        vs = f"{r['a_tok_s'] / base['a_tok_s']:.2f}x" if base else "-"
        print(f"| {policy} | {r['b_ttft']:.2f} | {r['a_median_ttft']:.2f} | {r['b_ttft'] / r['a_median_ttft']:.2f} | "
              f"{r['a_tok_s']:.1f} | {vs} |")
    if "fair" in results:
        fair = results["fair"]
        ratio = fair["b_ttft"] / fair["a_median_ttft"]
        print(f"\nfair: B's TTFT is {ratio:.2f}x A's median (goal <= 0.3)", end="")
        if base:
            print(f"; A's throughput {fair['a_tok_s'] / base['a_tok_s'] - 1:+.1%} vs fcfs (goal >= -5%)")
        else:
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
