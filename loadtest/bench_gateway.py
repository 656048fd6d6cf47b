"""Prefix-cache reuse behind a real LLM gateway: SMG's `cache_aware` policy against its
`round_robin`, in front of the same two Pagoda replicas, in one run (issue 37's benchmark).

    python -m loadtest.bench_gateway              # 9 prompts x 10 turns per policy (minutes on 2 CPU cores)
    python -m loadtest.bench_gateway --quick      # a smoke run

The workload: `--prompts` distinct system prompts of ~`--system-tokens` tokens each, each
with `--turns` different user turns, interleaved (prompt 0 turn 0, prompt 1 turn 0, ...),
sent one at a time as streamed chat requests with usage. Each replica's KV cache
(`--kv-cache-memory`, sized from the workload) holds about half of the prompts' prefixes,
so a policy that sends every prompt to both replicas makes each replica cycle through more
prefixes than it holds (LRU eviction: few hits), while one that keeps a prompt on one
replica finds it cached from its second turn on. For each policy the replicas are started
fresh (empty caches), and it prints the fraction of prompt tokens served from the prefix
cache (sum of `usage.prompt_tokens_details.cached_tokens` / sum of `prompt_tokens`) and the
median time to first token. Goal (issue 37): cache_aware >= 0.8 and >= 1.5x round_robin's.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.processes import PORT, HttpServer, free_port, pagoda_command

WORDS = ("river stone garden window silver morning letter market engine harbor forest candle winter "
         "paper mountain station orange bridge circle summer lantern pocket island meadow thunder").split()
BYTES_PER_TOKEN_BF16 = 23040  # the bundled model: 2 x 30 layers x 3 KV heads x 64 x 2 bytes


def system_prompt(i: int, words: int) -> str:
    rng = random.Random(i)
    return f"You are assistant number {i}. " + " ".join(rng.choice(WORDS) for _ in range(words))


def run_policy(policy: str, args: argparse.Namespace, log_dir: Path) -> dict:
    """Fresh replicas and SMG under `policy`; the workload; the figures."""
    smg = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
    cache_gib = args.kv_cache_tokens * BYTES_PER_TOKEN_BF16 / 2**30
    replicas = [HttpServer(f"replica-{policy}", pagoda_command(
        "--dtype", "bfloat16", "--max-model-len", "2048", "--kv-cache-memory", f"{cache_gib:.6f}", "--no-access-log"),
        log_dir, env={"OMP_NUM_THREADS": "1"}, signal_group=True) for _ in range(2)]
    gateway = None
    try:
        for r in replicas:
            r.wait_ready(180)
        gateway = HttpServer(f"smg-{policy}", [smg, "launch", "--host", "127.0.0.1", "--port", PORT, "--policy", policy,
                                               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                               "--worker-urls", *[r.url for r in replicas]],
                             log_dir, signal_group=True)
        gateway.wait_ready(60)
        prompts = [system_prompt(i, args.system_words) for i in range(args.prompts)]
        prompt_tokens = cached_tokens = 0
        ttfts = []
        with httpx.Client(timeout=600) as client:
            for turn in range(args.turns):
                for i, system in enumerate(prompts):
                    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "stream": True,
                            "stream_options": {"include_usage": True},
                            "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": f"Question {turn} about topic {i}?"}]}
                    start = time.perf_counter()
                    first = None
                    usage = None
                    with client.stream("POST", f"{gateway.url}/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            raise RuntimeError(f"{policy}: HTTP {r.status_code}: {r.read()[:300]!r}")
                        for line in r.iter_lines():
                            if not line.startswith("data: {"):
                                continue
                            chunk = json.loads(line[6:])
                            if first is None and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                                first = time.perf_counter() - start
                            if chunk.get("usage"):
                                usage = chunk["usage"]
                    ttfts.append(first if first is not None else time.perf_counter() - start)
                    prompt_tokens += usage["prompt_tokens"]
                    cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"policy": policy, "requests": len(ttfts), "prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
                "cached_fraction": round(cached_tokens / prompt_tokens, 3),
                "ttft_p50_s": round(statistics.median(ttfts), 3)}
    finally:
        for process in [gateway, *replicas]:
            if process is not None:
                process.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=9)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-words", type=int, default=900, help="words per system prompt (~1.1 tokens each)")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV-cache tokens per replica (default: about half of the workload's prefixes)")
    p.add_argument("--policies", default="cache_aware,round_robin")
    p.add_argument("--quick", action="store_true", help="3 short prompts x 2 turns")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.turns, args.system_words = 3, 2, 60
    if args.kv_cache_tokens is None:
        # Each prompt's prefix is ~1.1 tokens a word plus the template; half the prompts, rounded up.
        args.kv_cache_tokens = int((args.prompts + 1) // 2 * (args.system_words * 1.15 + 64))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    print(f"[gateway] {args.prompts} system prompts of ~{args.system_words} words x {args.turns} turns, interleaved; "
          f"2 replicas of {args.kv_cache_tokens} KV tokens each; logs in {log_dir}", flush=True)
    results = []
    for policy in args.policies.split(","):
        results.append(run_policy(policy, args, log_dir))
        print(f"[gateway] {results[-1]}", flush=True)
    print("\n| SMG policy | requests | prompt tokens | from the prefix cache | fraction | TTFT p50 s |\n|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['policy']} | {r['requests']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['cached_fraction']} | "
              f"{r['ttft_p50_s']} |")
    by = {r["policy"]: r for r in results}
    if "cache_aware" in by and "round_robin" in by:
        ca, rr = by["cache_aware"]["cached_fraction"], by["round_robin"]["cached_fraction"]
        ratio = f"{ca / rr:.2f}x" if rr else "inf"
        print(f"\ncache_aware / round_robin cached fraction: {ratio} (targets: cache_aware >= 0.8, >= 1.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
