"""Multi-LoRA serving against the base alone, the same server and run (issue 39's benchmark).

    python -m loadtest.bench_lora                 # 8 adapters, 32 streams (minutes on 2 CPU cores)
    python -m loadtest.bench_lora --quick         # a smoke run (tests use it)

Writes `--adapters` random PEFT LoRA adapters of rank `--rank` for the model (q/k/v/o and
MLP projections; adapter_config.json + adapter_model.safetensors, no peft needed), starts
one Pagoda with them all (`--lora-modules`, `--max-loras` = their number), and runs, with
random-token completions (`ignore_eos`, `--output-len`):

- `base @N`: `--streams` concurrent streams on the base model;
- `adapters @N`: the same, request i on adapter i mod `--adapters`;
- `base @1` and `adapter @1`: one stream, for the inter-token latency (median TPOT).

Reported: output tok/s of each (all output tokens / wall time) and adapters / base (the
issue's target: >= 0.8x), and the batch-1 median TPOT with an adapter / without (<= 1.15x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from loadtest.client import RequestParams, send_request
from loadtest.datasets import BenchRequest, DatasetSpec, LengthRange, TextSource, build_dataset
from loadtest.servers import LaunchedServer, pagoda_spec

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model_path: Path, out: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` random LoRA adapters of rank `rank` for the model at `model_path`, in PEFT's layout."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_path / "config.json").read_text())
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    paths = {}
    for i in range(count):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(layers):
            for module, (fan_in, fan_out) in shapes.items():
                part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{part}.{module}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) / fan_in ** 0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
        folder = out / f"adapter-{i}"
        folder.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
        paths[f"adapter-{i}"] = folder
    return paths


async def run_workload(url: str, requests: list[BenchRequest], models: list[str | None], concurrency: int,
                       timeout_s: float) -> dict:
    """The requests over `concurrency` streams, request i for `models[i]`; tok/s and median TPOT."""
    queue = list(zip(requests, models))
    results = []
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        start = time.perf_counter()

        async def worker():
            while queue:
                req, model = queue.pop(0)
                params = RequestParams(model=model, fixed_length_fields=lambda n: {"ignore_eos": True},
                                       request_timeout_s=timeout_s)
                results.append(await send_request(client, req, params, start))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed, e.g. {failed[0]}")
    tokens = sum(r.output_tokens for r in results)
    tpots = sorted(r.tpot_s for r in results if r.tpot_s is not None)
    return {"requests": len(results), "output_tokens": tokens, "wall_s": round(wall, 2),
            "tok_s": round(tokens / wall, 2),
            "median_tpot_ms": round(1000 * tpots[len(tpots) // 2], 2) if tpots else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, help="model folder (default: the bundled model)")
    ap.add_argument("--dtype", default=None, help="--dtype for the server (default: its own, auto)")
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--itl-requests", type=int, default=4, help="requests of the batch-1 workloads")
    ap.add_argument("--server-args", default="", help="extra flags for the server, one string")
    ap.add_argument("--quick", action="store_true", help="2 adapters of rank 4, 4 streams, 8 tokens")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path(".cache/bench-lora"))
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.adapters, ns.rank, ns.streams, ns.output_len, ns.input_len, ns.itl_requests = 2, 4, 4, 8, 16, 1

    import shlex

    from engine.default_model import default_model_path

    model_path = ns.model_path or default_model_path()
    adapters = write_adapters(model_path, ns.out / "adapters", ns.adapters, ns.rank)
    names = list(adapters)
    source = TextSource(model_path)
    spec_many = DatasetSpec("random", input_len=LengthRange(ns.input_len, ns.input_len),
                            output_len=LengthRange(ns.output_len, ns.output_len))
    many = build_dataset(spec_many, 2 * ns.streams, seed=1, source=source)
    one = build_dataset(spec_many, ns.itl_requests, seed=2, source=source)
    workloads = [
        (f"base @{ns.streams}", many, [None] * len(many), ns.streams),
        (f"adapters @{ns.streams}", many, [names[i % len(names)] for i in range(len(many))], ns.streams),
        ("base @1", one, [None] * len(one), 1),
        ("adapter @1", one, [names[0]] * len(one), 1),
    ]
    args = shlex.split(ns.server_args) + ["--max-loras", str(len(names)), "--max-lora-rank", str(ns.rank),
                                          "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]
    spec = pagoda_spec(model_path, ns.dtype, args)
    print(f"[lora] starting pagoda: {spec.display_command()}", file=sys.stderr, flush=True)
    server = LaunchedServer(spec, ns.out / "logs")
    rows = {}
    try:
        server.wait_ready(ns.startup_timeout)
        asyncio.run(run_workload(server.url, [BenchRequest(4, prompt="Hello")] * 2, [None, names[0]], 1, ns.timeout))
        for label, requests, models, concurrency in workloads:
            rows[label] = asyncio.run(run_workload(server.url, requests, models, concurrency, ns.timeout))
            print(f"[lora] {label}: {rows[label]}", file=sys.stderr, flush=True)
    finally:
        server.stop()

    base_n, lora_n = rows[f"base @{ns.streams}"], rows[f"adapters @{ns.streams}"]
    base_1, lora_1 = rows["base @1"], rows["adapter @1"]
    print(f"{len(names)} adapters of rank {ns.rank}, {ns.streams} streams, {ns.output_len} output tokens\n")
    print("| workload | output tok/s | median TPOT ms |")
    print("|---|---|---|")
    for label, row in rows.items():
        print(f"| {label} | {row['tok_s']} | {row['median_tpot_ms']} |")
    tok_ratio = lora_n["tok_s"] / base_n["tok_s"]
    itl_ratio = lora_1["median_tpot_ms"] / base_1["median_tpot_ms"] if base_1["median_tpot_ms"] else float("nan")
    print(f"\nadapters / base output tok/s at {ns.streams} streams: {tok_ratio:.2f}x (target >= 0.8x)")
    print(f"batch-1 ITL with an adapter / without: {itl_ratio:.2f}x (target <= 1.15x)")
    if ns.json:
        ns.json.write_text(json.dumps({"rows": rows, "tok_s_ratio": tok_ratio, "itl_ratio": itl_ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
