"""Prompt-lookup speculative decoding on and off, the same server, model and requests.

    python -m loadtest.bench_spec_decode                 # ~6 min on 2 CPU cores
    python -m loadtest.bench_spec_decode --quick         # a smoke run (tests use it)

Pagoda is started twice, one after the other (each stopped with its whole session before
the next): without speculation, then with `--speculative-config` (default: ngram, k = 4,
n-grams 2..4). Each runs the same three workloads, greedy:

- `grounded @1`: the `grounded` dataset (loadtest/datasets.py: repeat / rewrite / quote a
  bundled passage, or edit a bundled code file and return all of it) as chat requests one
  at a time, each to its end of sequence or `--output-len`;
- `random @1`: random-token completions one at a time (`ignore_eos`, `--output-len`), where
  proposals rarely match;
- `random @N`: the same at `--streams` concurrent streams, past the speculative config's
  `disable_by_batch_size` (speculation switches itself off).

Reported per workload: output tokens per second (all output tokens / wall time, prefill
included), the ratio on / off measured in this run, the median time per output token after
the first (TPOT: the decode speed speculation changes; TPOT ratio = off / on) and time to
first token (which it does not), and the acceptance rate (accepted / draft tokens) from
the server's own `pagoda:spec_decode_*` counters.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import sys
import time
from pathlib import Path

import httpx

from loadtest.client import RequestParams, send_request
from loadtest.datasets import BenchRequest, DatasetSpec, LengthRange, TextSource, build_dataset
from loadtest.servers import LaunchedServer, pagoda_spec

DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


async def run_workload(url: str, requests: list[BenchRequest], concurrency: int, ignore_eos: bool,
                       timeout_s: float) -> dict:
    params = RequestParams(model=None, fixed_length_fields=(lambda n: {"ignore_eos": True}) if ignore_eos else None,
                           request_timeout_s=timeout_s)
    queue = list(requests)
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        start = time.perf_counter()

        async def worker():
            while queue:
                req = queue.pop(0)
                results.append(await send_request(client, req, params, start))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed, e.g. {failed[0]}")
    tokens = sum(r.output_tokens for r in results)
    tpots = sorted(r.tpot_s for r in results if r.tpot_s is not None)
    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
    return {"requests": len(results), "output_tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2),
            "median_tpot_ms": round(1000 * tpots[len(tpots) // 2], 2) if tpots else None,
            "median_ttft_ms": round(1000 * ttfts[len(ttfts) // 2], 1) if ttfts else None}


def spec_counters(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far, from the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = []
    for name in ("pagoda:spec_decode_num_draft_tokens_total", "pagoda:spec_decode_num_accepted_tokens_total"):
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
        values.append(float(m.group(1)) if m else 0.0)
    return values[0], values[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, help="model folder (default: the bundled model)")
    ap.add_argument("--dtype", default=None, help="--dtype for the server (default: its own, auto)")
    ap.add_argument("--speculative-config", default=DEFAULT_SPEC)
    ap.add_argument("--num-requests", type=int, default=8, help="requests per workload at one stream")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=128, help="random workloads' prompt tokens")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--server-args", default="", help="extra flags for both servers, one string")
    ap.add_argument("--quick", action="store_true", help="2 requests of 16 tokens per workload, 4 streams")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path(".cache/bench-spec-decode"))
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.num_requests, ns.output_len, ns.input_len, ns.streams = 2, 16, 32, 4

    from engine.default_model import default_model_path

    model_path = ns.model_path or default_model_path()
    source = TextSource(model_path)
    out_len = LengthRange(ns.output_len, ns.output_len)
    grounded = build_dataset(DatasetSpec("grounded", output_len=out_len), ns.num_requests, seed=0)
    rand_spec = DatasetSpec("random", input_len=LengthRange(ns.input_len, ns.input_len), output_len=out_len)
    random_one = build_dataset(rand_spec, ns.num_requests, seed=1, source=source)
    random_many = build_dataset(rand_spec, 2 * ns.streams, seed=2, source=source)
    workloads = [("grounded @1", grounded, 1, False), ("random @1", random_one, 1, True),
                 (f"random @{ns.streams}", random_many, ns.streams, True)]

    runs = {}
    for label, extra in (("off", []), ("on", ["--speculative-config", ns.speculative_config])):
        args = shlex.split(ns.server_args) + extra
        spec = pagoda_spec(model_path, ns.dtype, args)
        print(f"[spec-decode] starting pagoda ({label}): {spec.display_command()}", file=sys.stderr, flush=True)
        server = LaunchedServer(spec, ns.out / "logs")
        try:
            server.wait_ready(ns.startup_timeout)
            warm = [BenchRequest(8, prompt="Hello")]
            asyncio.run(run_workload(server.url, warm, 1, True, ns.timeout))
            rows = {}
            for name, requests, concurrency, ignore_eos in workloads:
                drafts0, accepted0 = spec_counters(server.url)
                row = asyncio.run(run_workload(server.url, requests, concurrency, ignore_eos, ns.timeout))
                drafts1, accepted1 = spec_counters(server.url)
                row["draft_tokens"] = drafts1 - drafts0
                row["acceptance"] = round((accepted1 - accepted0) / (drafts1 - drafts0), 3) if drafts1 > drafts0 else None
                print(f"[spec-decode] {label} {name}: {row}", file=sys.stderr, flush=True)
                rows[name] = row
            runs[label] = rows
        finally:
            server.stop()

    print(f"speculative config: `{ns.speculative_config}`\n")
    print("| workload | tok/s off | tok/s on | on / off | median TPOT ms off / on | TPOT ratio | median TTFT ms off / on "
          "| acceptance rate (on) | draft tokens (on) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, *_ in workloads:
        off, on = runs["off"][name], runs["on"][name]
        acceptance = "-" if on["acceptance"] is None else f"{on['acceptance']:.0%}"
        tpot_ratio = f"{off['median_tpot_ms'] / on['median_tpot_ms']:.2f}x" if on["median_tpot_ms"] else "-"
        print(f"| {name} | {off['tok_s']} | {on['tok_s']} | {on['tok_s'] / off['tok_s']:.2f}x | "
              f"{off['median_tpot_ms']} / {on['median_tpot_ms']} | {tpot_ratio} | "
              f"{off['median_ttft_ms']} / {on['median_ttft_ms']} | {acceptance} | {int(on['draft_tokens'])} |")
    if ns.json:
        ns.json.write_text(json.dumps({"speculative_config": ns.speculative_config, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
