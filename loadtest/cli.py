"""`python -m loadtest`: a load generator for any OpenAI-compatible server, with peers side by side.

    python -m loadtest                                   # start pagoda (default model), concurrency 8
    python -m loadtest --base-url http://127.0.0.1:8000  # a server that is already running
    python -m loadtest --sweep --peers --dtype float32   # 1/8/32/64 streams, pagoda and each local peer
    python -m loadtest --request-rate 4 --burstiness 0.5 --duration 60 --concurrency 64
    python -m loadtest --dataset jsonl --jsonl prompts.jsonl --slo ttft:500 --slo tpot:50

Without --base-url it starts `pagoda serve` on a free loopback port (and stops it after).
With --peers it also starts, one at a time on the same model files and workload, each peer
installed here (transformers serve --continuous-batching; llama-cpp-python's server) and
prints one table with ratios. Every server gets the same prompts; each load level its own
prompts (so no level reuses another's prefix cache) and a warm-up that is not counted.
Writes OUT/results.json, OUT/summary.md and PNG plots; prints the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import httpx

from loadtest import compat, report
from loadtest.client import RequestParams
from loadtest.datasets import DATASETS, BenchRequest, DatasetSpec, LengthRange, TextSource, build_dataset
from loadtest.machine import OtherCpu, session_memory_mib
from loadtest.plots import RunSeries, plot_all
from loadtest.progress import PROGRESS_KINDS, make_progress
from loadtest.runner import LoadSpec, run_load
from loadtest.servers import LaunchedServer, ServerSpec, Skipped, pagoda_spec, peer_specs
from loadtest.summary import Slo, summarize

SWEEP = (1, 8, 32, 64)
MIN_PROMPTS = 8


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("target")
    g.add_argument("--base-url", help="a running OpenAI-compatible server (default: start pagoda)")
    g.add_argument("--name", help="the target's name in the report (default: pagoda, or `server` with --base-url)")
    g.add_argument("--model", help="the `model` field to send (default: the first of /v1/models)")
    g.add_argument("--model-path", type=Path, help="model folder servers are started on (default: pagoda's bundled model)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="sent as a Bearer token (default: $OPENAI_API_KEY)")
    g.add_argument("--dtype", help="--dtype for every started server (e.g. float32); default: each server's own")
    g.add_argument("--server-args", default="", help="extra flags for the started pagoda, one string")
    g.add_argument("--peers", nargs="?", const="all", default=None, metavar="all|NAMES",
                   help="also start each locally installed peer and compare; or only those named, comma-separated, "
                   "from: vllm, transformers, llama.cpp")
    g.add_argument("--transformers-args", default="", help="extra flags for `transformers serve`, one string "
                   "(e.g. '--cb-num-blocks 512'; by default it sizes its KV cache from free RAM)")
    g.add_argument("--llama-cpp-args", default="", help="extra flags for llama-cpp-python's server, one string")
    g.add_argument("--vllm-python", help="the Python of a venv with vLLM's CPU build: adds it as a peer "
                   "(default: $PAGODA_VLLM_PYTHON; README: the recipe)")
    g.add_argument("--vllm-args", default="", help="extra flags for vLLM's api_server, one string")
    g.add_argument("--gguf", type=Path, help="GGUF file for llama-cpp-python's server (default: the bundled model's)")
    g.add_argument("--startup-timeout", type=float, default=300.0, help="seconds a started server has to become ready")

    g = ap.add_argument_group("workload")
    g.add_argument("--dataset", default="random", choices=DATASETS)
    g.add_argument("--num-prompts", default=None, help="per load level: N, or Kx for K x concurrency "
                   f"(at least {MIN_PROMPTS}); default 4x, or 32 without a concurrency cap")
    g.add_argument("--input-len", default="128", help="prompt tokens: N or LOW:HIGH (random, prefix: the suffix)")
    g.add_argument("--output-len", default="128", help="max_tokens: N or LOW:HIGH")
    g.add_argument("--prefix-len", type=int, default=256, help="prefix dataset: shared prefix tokens")
    g.add_argument("--num-prefixes", type=int, default=4, help="prefix dataset: how many distinct prefixes")
    g.add_argument("--jsonl", type=Path, help='jsonl dataset: one {"prompt": ...} or {"messages": [...]} a line')
    g.add_argument("--tokenizer", help="folder or tokenizer.json for random prompts, or `words` "
                   "(default: the model folder's tokenizer when there is one)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--no-ignore-eos", dest="fixed_length", action="store_false",
                   help="let outputs stop at EOS (default: ask for exactly max_tokens, in whatever way the server accepts)")

    g = ap.add_argument_group("load")
    g.add_argument("--concurrency", default="8", help="most requests in flight; a comma list is a sweep (1,8,32)")
    g.add_argument("--sweep", action="store_true", help=f"concurrency {','.join(map(str, SWEEP))}")
    g.add_argument("--request-rate", type=float, default=math.inf, help="arrivals per second (default inf: closed loop)")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals: 1 Poisson, <1 burstier")
    g.add_argument("--duration", type=float, default=None, help="seconds per level after which no new request is sent")
    g.add_argument("--warmup", type=int, default=4, help="warm-up requests per level (8 tokens each), not counted")
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")
    g.add_argument("--slo", action="append", default=[], metavar="KEY:MS", help="goodput SLO: ttft, tpot or e2e in ms (repeatable)")

    g = ap.add_argument_group("output")
    g.add_argument("--out", type=Path, default=Path(".cache/loadtest"), help="folder for results.json, summary.md, plots, server logs")
    g.add_argument("--json", type=Path, help="results file (default OUT/results.json)")
    g.add_argument("--markdown", type=Path, help="summary file (default OUT/summary.md)")
    g.add_argument("--plots-dir", type=Path, help="folder for PNG plots (default OUT)")
    g.add_argument("--plot-prefix", default="", help="prefix of the PNG file names")
    g.add_argument("--title", default=None)
    g.add_argument("--save-itl", action="store_true", help="keep every inter-token gap in the JSON")
    g.add_argument("--progress", default="auto", choices=PROGRESS_KINDS)
    return ap


@dataclass(slots=True)
class Level:
    load: LoadSpec
    label: str
    short_label: str
    num_prompts: int


def parse_levels(ns: argparse.Namespace) -> list[Level]:
    concurrencies: list[int | None]
    if ns.sweep:
        concurrencies = list(SWEEP)
    elif ns.concurrency in ("", "none", "0") and math.isfinite(ns.request_rate):
        concurrencies = [None]
    else:
        try:
            concurrencies = [int(c) for c in str(ns.concurrency).split(",")]
        except ValueError as e:
            raise ValueError(f"--concurrency: expected integers separated by commas, got {ns.concurrency!r}") from e
    levels = []
    for c in concurrencies:
        load = LoadSpec(c, ns.request_rate, ns.burstiness, ns.duration, ns.seed)
        if math.isfinite(ns.request_rate):
            label, short = f"rate {ns.request_rate:g}/s, " + (f"concurrency {c}" if c else "no cap"), \
                f"r={ns.request_rate:g}" + (f",c={c}" if c else "")
        else:
            label, short = f"concurrency {c}", f"c={c}"
        levels.append(Level(load, label, short, num_prompts_for(ns.num_prompts, c)))
    return levels


def num_prompts_for(text: str | None, concurrency: int | None) -> int:
    if text is None:
        return max(MIN_PROMPTS, 4 * concurrency) if concurrency else 32
    text = str(text).strip()
    try:
        if text.endswith("x"):
            if concurrency is None:
                raise ValueError("Kx needs a concurrency; give --num-prompts N")
            return max(MIN_PROMPTS, int(float(text[:-1]) * concurrency))
        n = int(text)
    except ValueError as e:
        raise ValueError(f"--num-prompts: expected N or Kx, got {text!r}: {e}") from e
    if n < 1:
        raise ValueError("--num-prompts must be >= 1")
    return n


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(next(line.split()[1] for line in f if line.startswith("MemTotal")))
            mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores ({cpu}){mem}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("pagoda-serve", "transformers", "torch", "llama-cpp-python", "httpx"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def resolve_model_path(ns: argparse.Namespace, launching: bool) -> Path | None:
    if ns.model_path is not None:
        return ns.model_path
    if not launching:
        return None
    from engine.default_model import ensure_default_model

    return ensure_default_model()


def resolve_tokenizer(ns: argparse.Namespace, model_path: Path | None) -> Path | None:
    if ns.tokenizer == "words":
        return None
    if ns.tokenizer:
        return Path(ns.tokenizer)
    candidates = [model_path] if model_path else []
    if not candidates:
        try:
            from engine.default_model import default_model_path

            candidates.append(default_model_path())
        except ImportError:
            pass
    return next((c for c in candidates if (c / "tokenizer.json").is_file()), None)


async def _model_name(url: str, headers: dict) -> str | None:
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as client:
        try:
            r = await client.get("/v1/models")
            return r.json()["data"][0]["id"] if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return None


async def bench_server(entry: dict, url: str, model: str | None, server_pid: int | None, levels: list[Level], datasets: list, warmups: list,
                       probe: BenchRequest, ns: argparse.Namespace, slos: tuple[Slo, ...], series: list[RunSeries]) -> None:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    model = model or ns.model or await _model_name(url, headers)
    entry["model"] = model
    params = RequestParams(model=model, temperature=ns.temperature, request_timeout_s=ns.request_timeout)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(ns.request_timeout, connect=10)) as client:
        negotiated = await compat.negotiate(client, params, probe, ns.fixed_length)
    params.include_usage = negotiated.include_usage
    params.fixed_length_fields = negotiated.mode.fields
    entry["request_mode"] = negotiated.mode.name
    entry["request_note"] = negotiated.note
    entry["rejected"] = negotiated.rejected
    print(f"[loadtest] {entry['name']} at {url}: model {model!r}; requests: {negotiated.note}", file=sys.stderr, flush=True)
    for level, requests, warmup in zip(levels, datasets, warmups):
        other_cpu = OtherCpu(server_pid)
        outcome = await run_load(url, requests, warmup, params, level.load, headers=headers,
                                 progress=make_progress(ns.progress), label=f"{entry['name']}, {level.label}")
        summary = summarize(outcome.results, outcome.wall_s, slos)
        entry["runs"].append({
            "label": level.label, "load": level.load.describe(), "num_prompts": len(requests),
            "warmup": outcome.warmup, "summary": summary, "server_metrics": outcome.server_metrics(),
            # Other processes' CPU use during the run (includes the warm-up), in cores.
            "other_cpu_cores": other_cpu.cores(),
            "requests": [report.request_record(r, ns.save_itl) for r in outcome.results],
        })
        series.append(RunSeries(entry["name"], level.label, level.short_label, summary, outcome.results))
        s = summary
        print(f"[loadtest] {entry['name']}, {level.label}: {s['completed']} ok, {s['failed']} failed, "
              f"{s['output_throughput']:.1f} output tok/s, median ITL "
              f"{(s['itl'] or {}).get('median_ms', float('nan')):.1f} ms", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser()
    ns = ap.parse_args(argv)
    try:
        levels = parse_levels(ns)
        slos = tuple(Slo.parse(s) for s in ns.slo)
        if ns.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        launching = ns.base_url is None or ns.peers
        model_path = resolve_model_path(ns, launching)
        spec = DatasetSpec(
            ns.dataset, LengthRange.parse(ns.input_len), LengthRange.parse(ns.output_len), ns.prefix_len,
            ns.num_prefixes, ns.jsonl, resolve_tokenizer(ns, model_path),
        )
        source = TextSource(spec.tokenizer_path)
        # Per level: its own prompts (seeded by level), the same for every server.
        datasets = [build_dataset(spec, lv.num_prompts, ns.seed + 1000 * (i + 1), source) for i, lv in enumerate(levels)]
        warmups = [build_dataset(spec, ns.warmup, ns.seed + 1000 * (i + 1) + 500, source) for i in range(len(levels))]
        # Its own prompt: probing with a measured one would hand that one a prefix-cache hit.
        probe = build_dataset(spec, 1, ns.seed + 999, source)[0]
    except (ValueError, FileNotFoundError) as e:
        ap.error(str(e))

    out_dir: Path = ns.out
    json_path = ns.json or out_dir / "results.json"
    md_path = ns.markdown or out_dir / "summary.md"
    targets: list[tuple[str, ServerSpec | None, str | None]] = []
    if ns.base_url:
        targets.append((ns.name or "server", None, ns.base_url.rstrip("/")))
    else:
        targets.append((ns.name or "pagoda", pagoda_spec(model_path, ns.dtype, shlex.split(ns.server_args)), None))
    skipped: list[dict] = []
    if ns.peers:
        for peer in peer_specs(model_path, ns.dtype, ns.gguf, shlex.split(ns.transformers_args), shlex.split(ns.llama_cpp_args),
                               ns.vllm_python, shlex.split(ns.vllm_args)):
            if ns.peers != "all" and not any(w.strip().lower() in peer.name.lower() for w in ns.peers.split(",")):
                continue
            if isinstance(peer, Skipped):
                print(f"[loadtest] peer {peer.name}: skipped: {peer.reason}", file=sys.stderr, flush=True)
                skipped.append({"name": peer.name, "reason": peer.reason})
            else:
                targets.append((peer.name, peer, None))

    servers: list[dict] = []
    series: list[RunSeries] = []
    for name, server_spec, url in targets:
        entry = {"name": name, "url": url, "command": None, "model": None, "request_mode": None,
                 "request_note": None, "rejected": [], "error": None, "runs": []}
        servers.append(entry)
        launched = None
        try:
            if server_spec is not None:
                entry["command"] = server_spec.display_command()
                print(f"[loadtest] starting {name}: {entry['command']}", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                launched = LaunchedServer(server_spec, out_dir / "logs")
                launched.wait_ready(ns.startup_timeout)
                entry["url"] = launched.url
                entry["startup_s"] = round(time.monotonic() - t0, 1)
                entry["memory_mib_after_start"] = _rounded(session_memory_mib(launched.proc.pid))
            asyncio.run(bench_server(entry, entry["url"], server_spec.model if server_spec else None,
                                     launched.proc.pid if launched else None,
                                     levels, datasets, warmups, probe, ns, slos, series))
        except (RuntimeError, ConnectionError, OSError) as e:
            entry["error"] = str(e)[-3000:]
            print(f"[loadtest] {name}: {e}", file=sys.stderr, flush=True)
        finally:
            if launched is not None:
                entry["memory_mib_after_run"] = _rounded(session_memory_mib(launched.proc.pid))
                launched.stop()

    doc = {
        "schema": report.SCHEMA,
        "title": ns.title,
        "created_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "command": _command_line(argv),
        "environment": {"machine": machine_description(), "versions": _versions()},
        "workload": {
            "dataset": spec.describe(), "num_prompts": ", ".join(f"{lv.num_prompts} ({lv.short_label})" for lv in levels),
            "warmup": ns.warmup, "temperature": ns.temperature, "fixed_length": ns.fixed_length,
            "request_timeout_s": ns.request_timeout, "slos_ms": {s.key: s.limit_ms for s in slos},
            "levels": [lv.load.describe() for lv in levels],
        },
        "servers": servers,
        "skipped": skipped,
        "plots": plot_all(series, ns.plots_dir or out_dir, ns.plot_prefix),
    }
    report.write_json(doc, json_path)
    text = report.markdown(doc, md_path)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(text)
    print(text)
    print(f"[loadtest] wrote {json_path}, {md_path}" + "".join(f", {p['path']}" for p in doc["plots"]), file=sys.stderr)
    return 1 if servers[0]["error"] else 0


def _rounded(mib: float | None) -> float | None:
    return None if mib is None else round(mib, 1)


def _command_line(argv: list[str]) -> str:
    exe = sys.executable
    try:
        exe = os.path.relpath(exe)
    except ValueError:
        pass
    if exe.startswith(".."):
        exe = "python"
    return shlex.join([exe, "-m", "loadtest", *argv])
