"""A long prompt arriving while other streams decode: how long the streams stall, and how
soon the long prompt's first token comes.

    python -m loadtest.bench_long_prompt                        # Pagoda alone
    python -m loadtest.bench_long_prompt --vllm-python PATH     # and vLLM's CPU build, in turn

Per server (started one at a time on the same model, then stopped with its whole session):
`--streams` streamed completions decode `--stream-tokens` tokens each (ignore_eos); once
every stream has produced tokens for `--settle` seconds, one `--long-len`-token prompt is
sent for `--long-max-tokens` tokens. Reported, all from the same run:

- the long prompt's time to first token (its prefill, chunked by the server as it likes);
- the decoding streams' longest gap between two tokens while the long prompt was in
  prefill (from its arrival to its first token), and their median gap before it arrived;
- output tokens per second of the streams across the prefill window.

Both servers take `ignore_eos` (vLLM and Pagoda do), so this scenario runs those two.
"""

from __future__ import annotations

import argparse
import shlex
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from loadtest.client import RequestParams, RequestResult, send_request
from loadtest.datasets import BenchRequest, TextSource
from loadtest.servers import LaunchedServer, ServerSpec, Skipped, pagoda_spec, vllm_spec


def token_times(result: RequestResult) -> list[float]:
    """Each content chunk's arrival, in seconds after the run started."""
    if result.ttft_s is None:
        return []
    times = [result.start_s + result.ttft_s]
    for gap in result.itl_s:
        times.append(times[-1] + gap)
    return times


async def run_scenario(url: str, model: str | None, streams: list[BenchRequest], long: BenchRequest,
                       settle_s: float, timeout_s: float) -> dict:
    params = RequestParams(model=model, fixed_length_fields=lambda n: {"ignore_eos": True}, request_timeout_s=timeout_s)
    limits = httpx.Limits(max_connections=len(streams) + 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = [asyncio.create_task(send_request(client, req, params, start)) for req in streams]
        await asyncio.sleep(settle_s)
        long_sent = time.perf_counter() - start
        long_result = await send_request(client, long, params, start)
        results = await asyncio.gather(*tasks)
    failed = [r.error for r in [long_result, *results] if not r.ok]
    if failed:
        raise RuntimeError(f"requests failed: {failed[:3]}")
    return stall_summary(long_sent, long_result, results)


def stall_summary(long_sent: float, long_result: RequestResult, streams: list[RequestResult]) -> dict:
    """What the decoding `streams` saw while the long prompt, sent at `long_sent` (seconds
    after the run started), was in prefill: until its first token."""
    window_end = long_sent + (long_result.ttft_s or 0.0)
    gaps_in_window, gaps_before, tokens_in_window = [], [], 0
    for r in streams:
        times = token_times(r)
        for a, b in zip(times, times[1:]):
            if b > long_sent and a < window_end:
                gaps_in_window.append(b - a)
            elif b <= long_sent:
                gaps_before.append(b - a)
        tokens_in_window += sum(1 for t in times if long_sent < t <= window_end)
    window = max(window_end - long_sent, 1e-9)
    return {
        "long_prompt_tokens": long_result.prompt_tokens,
        "long_ttft_s": round(long_result.ttft_s or float("nan"), 3),
        "streams_max_gap_s": round(max(gaps_in_window, default=float("nan")), 3),
        "streams_median_gap_before_ms": round(1000 * statistics.median(gaps_before), 1) if gaps_before else None,
        "streams_tok_s_during_prefill": round(tokens_in_window / window, 1),
        "streams_still_decoding_at_first_token": all(token_times(r)[-1] > window_end for r in streams),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, help="model folder (default: the bundled model)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--stream-tokens", type=int, default=1500, help="enough to outlast the long prefill")
    ap.add_argument("--stream-prompt-len", type=int, default=64)
    ap.add_argument("--long-len", type=int, default=7500, help="tokens of the long prompt")
    ap.add_argument("--long-max-tokens", type=int, default=8)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds the streams decode before the long prompt")
    ap.add_argument("--server-args", default="", help="extra flags for pagoda, one string")
    ap.add_argument("--vllm-python", help="a venv Python with vLLM's CPU build: also run vLLM")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=Path(".cache/bench-long-prompt"))
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)

    from engine.default_model import default_model_path

    model_path = ns.model_path or default_model_path()
    source = TextSource(model_path)
    rng = random.Random(0)
    streams = [BenchRequest(ns.stream_tokens, prompt=source.random_text(rng, ns.stream_prompt_len))
               for _ in range(ns.streams)]
    long = BenchRequest(ns.long_max_tokens, prompt=source.random_text(rng, ns.long_len))

    specs: list[ServerSpec | Skipped] = [pagoda_spec(model_path, ns.dtype, shlex.split(ns.server_args))]
    if ns.vllm_python:
        # The sweep's 2048-token limit would refuse the long prompt; vLLM refuses a limit
        # past the model's max_position_embeddings.
        from transformers import AutoConfig

        limit = AutoConfig.from_pretrained(str(model_path)).max_position_embeddings
        specs.append(vllm_spec(model_path, ns.dtype, ns.vllm_python, max_model_len=limit))
    rows = []
    for spec in specs:
        if isinstance(spec, Skipped):
            print(f"[long-prompt] {spec.name}: skipped: {spec.reason}", file=sys.stderr)
            continue
        print(f"[long-prompt] starting {spec.name}: {spec.display_command()}", file=sys.stderr, flush=True)
        server = LaunchedServer(spec, ns.out / "logs")
        try:
            server.wait_ready(ns.startup_timeout)
            # One short request first: compilation or first-call costs are not the scenario.
            asyncio.run(run_scenario(server.url, spec.model, streams[:1], BenchRequest(4, prompt="Hello"), 0.5, ns.timeout))
            row = {"server": spec.name, **asyncio.run(run_scenario(server.url, spec.model, streams, long, ns.settle, ns.timeout))}
        finally:
            server.stop()
        print(f"[long-prompt] {row}", file=sys.stderr, flush=True)
        rows.append(row)
    header = ("server", "long prompt tokens", "long TTFT s", "streams' longest gap s", "streams' median gap before ms",
              "streams tok/s during prefill")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print(f"| {r['server']} | {r['long_prompt_tokens']} | {r['long_ttft_s']} | {r['streams_max_gap_s']} | "
              f"{r['streams_median_gap_before_ms']} | {r['streams_tok_s_during_prefill']} |")
    if len(rows) == 2:
        a, b = rows
        print(f"\n{a['server']} / {b['server']}: long TTFT {a['long_ttft_s'] / b['long_ttft_s']:.2f}x, "
              f"longest stream gap {a['streams_max_gap_s'] / b['streams_max_gap_s']:.2f}x")
    if ns.json:
        ns.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
