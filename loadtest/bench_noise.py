"""CPU serving next to other work: Pagoda against llama.cpp's `llama-server`, quiet and with a
busy neighbour, at two model sizes (issue 40's benchmark).

    python -m loadtest.bench_noise                          # bundled model, quiet + nice 0 + nice 19
    python -m loadtest.bench_noise --models bundled llama-1b --noise none nice0
    python -m loadtest.bench_noise --parts limit            # under `taskset -c 0`: auto vs --cpu-threads 1
    python -m loadtest.bench_noise --parts quota            # in a cgroup with a 1-CPU quota
    python -m loadtest.bench_noise --weights int8 int4 --noise none   # INT8 vs Q8_0, INT4 vs Q4_0
    python -m loadtest.bench_noise --servers pagoda pagoda-openmp   # the work pool vs OpenMP's team

Models: `bundled` (SmolLM2-135M-Instruct) and `llama-1b`, a random-weight Llama made here
at first use (Llama-3.2-1B's hidden size 2048, 16 layers, 32 heads and 8 KV heads, an MLP of
5632, the bundled tokenizer's 49,152-token vocabulary: 0.82B parameters, bf16; no download),
each converted to a bf16 GGUF by llama.cpp's own `convert_hf_to_gguf.py` (found beside the
llama-server binary's source tree, or `--llama-cpp-dir`), so both servers read the same weights.

`--weights int8 int4`: Pagoda's `--quantization int8` (weight-only, per output channel)
against llama.cpp on a Q8_0 GGUF (the converter's `--outtype q8_0`), and `int4` (groups of
128 with zero points) against Q4_0 (`llama-quantize`, built beside llama-server).

Servers, one at a time (each stopped, its whole process group, before the next starts):
`pagoda` (bf16), `pagoda-openmp` (the same with PAGODA_CPU_LOOPS=openmp: the kernels' loops
on OpenMP's fork-join team, as before the work pool; for the A/B), `pagoda-whole-head` (the
same with PAGODA_CPU_GREEDY_HEAD=0: greedy steps read the whole bf16 LM head, not its int8
copy first; kernels/greedy_head.py), `pagoda-16bit-weights` (PAGODA_CPU_12BIT_WEIGHTS=0:
steps of 1-2 rows read the bf16 weights, not their lossless 12-bit copies) and `llama.cpp`
(`llama-server -t CPUS -tb CPUS -np 32 --cont-batching`). Each server is warmed up, then
for each `--noise` condition in turn: the neighbour is started (none; a busy loop at nice 0;
at nice 19), and measured with it are

- `c=1`: `--itl-requests` requests one after another, the median of their TPOTs (ITL),
  with the memory read pace measured just before and just after them (a batch-1 step
  streams its weights, and this VM's pace drifts up to 2x within minutes, so two servers
  measured minutes apart can meet different paces: the readings show which);
- `c=32`: 32 concurrent requests, output tokens / wall time;

every request `--output-len` (64) greedy tokens with `ignore_eos` on a `--input-len`-token
random prompt, the same prompts for every server and fresh ones for each condition (a server
measured under several would otherwise find the earlier condition's prompts in its prefix
cache and skip their prefill), each token's arrival timed as it streams;
a measurement longer than `--cap` seconds (a server a neighbour slows a hundredfold) is
stopped and its rate taken over what it received (marked `capped`). `--rounds` repeats the servers in
alternating order. Reported: each figure, Pagoda / llama.cpp under the same condition, and
each condition / quiet for each server; for bf16 weights also the c=32 workload's FLOP bound
(its prompts' and decode steps' FLOPs at the bf16 GEMM peak measured before and after the
servers ran, with no server running: the most tok/s any server could reach here) and each
server's quiet c=32 figure as a fraction of it.

`--parts limit`: Pagoda under `taskset -c 0` (one CPU in its affinity mask) with its own
thread choice (the `cpu_threads:` start-up fact is quoted) and with `--cpu-threads 1` by
hand: c=1 ITL of each and their ratio. `--parts quota`: Pagoda in a cgroup with a CPU quota
of one CPU (loadtest/cpu_quota.py; needs write access to /sys/fs/cgroup): its own choice,
`--cpu-threads 1` and `--cpu-threads 2` (the count it would use if it missed the quota).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.datasets import DatasetSpec, LengthRange, TextSource, build_dataset
from loadtest.servers import LaunchedServer, ServerSpec, Skipped, find_llama_server, llama_server_spec, pagoda_spec

NOISE = {"none": None, "nice0": 0, "nice19": 19}
# The 1B-class model: Llama-3.2-1B's width, depth and heads with the bundled vocabulary.
LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "rope_theta": 500000.0, "tie_word_embeddings": True,
            "max_position_embeddings": 4096}


def random_llama_1b(bundled: Path, out: Path) -> Path:
    """The random-weight 1B-class Llama folder (made once, bf16, seed 0), with the bundled tokenizer."""
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    base = AutoConfig.from_pretrained(bundled)
    config = AutoConfig.for_model("llama", vocab_size=base.vocab_size, bos_token_id=base.bos_token_id,
                                  eos_token_id=base.eos_token_id, torch_dtype="bfloat16", **LLAMA_1B)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                 "generation_config.json"):
        if (bundled / name).is_file():
            shutil.copy(bundled / name, out / name)
    return out


def llama_cpp_dir(given: Path | None, binary: str | None) -> Path | None:
    """The llama.cpp source tree (its converter): `given`, else the tree the binary was built in."""
    if given is not None:
        return given
    if binary is None:
        return None
    for parent in Path(binary).resolve().parents:
        if (parent / "convert_hf_to_gguf.py").is_file():
            return parent
    return None


def convert_to_gguf(model: Path, tree: Path, out: Path, outtype: str = "bf16") -> Path:
    """`model` as a GGUF (`outtype` bf16 or q8_0) written by llama.cpp's own converter (made once).

    The converter reads from a folder of links to the model's files with one change: the
    tokenizer's `byte_fallback` off. The bundled tokenizer is byte-level BPE (its
    pre-tokenizer maps every byte to a token, so byte fallback never fires) but says
    `byte_fallback: true`, which the converter takes for a SentencePiece-style Llama vocab:
    the GGUF it writes then fails every request in llama-server (`unordered_map::at`).
    Without the flag it writes the `gpt2` vocab with SmolLM's pre-tokenizer, as it should."""
    if out.is_file():
        return out
    staged = out.parent / (out.stem + "-source")
    shutil.rmtree(staged, ignore_errors=True)
    staged.mkdir(parents=True)
    for f in model.iterdir():
        if f.name != "tokenizer.json":
            (staged / f.name).symlink_to(f.resolve())
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    tokenizer["model"]["byte_fallback"] = False
    (staged / "tokenizer.json").write_text(json.dumps(tokenizer))
    env = dict(os.environ, PYTHONPATH=str(tree / "gguf-py"))
    subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(staged), "--outtype", outtype,
                    "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


# Pagoda's `--quantization` for each `--weights`, and the llama.cpp GGUF type it is set against:
# INT8 weight-only per output channel vs Q8_0 (blocks of 32, one scale each); INT4 weight-only
# in groups of 128 with zero points vs Q4_0 (blocks of 32, symmetric).
WEIGHTS = {"bf16": (None, "bf16"), "int8": ("int8", "q8_0"), "int4": ("int4", "q4_0")}


def model_gguf(model: Path, tree: Path, binary: str | None, out_dir: Path, model_name: str, weights: str) -> Path:
    """The GGUF llama-server reads for `weights`: bf16 and Q8_0 from llama.cpp's converter,
    Q4_0 by llama.cpp's `llama-quantize` (beside the llama-server binary) from the bf16 one."""
    gguf_type = WEIGHTS[weights][1]
    if gguf_type in ("bf16", "q8_0"):
        return convert_to_gguf(model, tree, out_dir / f"{model_name}-{gguf_type}.gguf", gguf_type)
    out = out_dir / f"{model_name}-{gguf_type}.gguf"
    if out.is_file():
        return out
    source = convert_to_gguf(model, tree, out_dir / f"{model_name}-bf16.gguf")
    quantize = Path(binary).resolve().parent / "llama-quantize" if binary else None
    if quantize is None or not quantize.is_file():
        raise FileNotFoundError(f"no llama-quantize beside {binary} (build the target `llama-quantize`; README)")
    subprocess.run([str(quantize), str(source), str(out), gguf_type.upper()], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def _lower_priority(nice: int) -> None:
    """In the neighbour before it runs: its nice level, and its autogroup's. Each session is
    its own scheduling group where the kernel has autogroups (/proc/sys/kernel/
    sched_autogroup_enabled; as each container is its own cgroup): CPU time is shared
    fairly between the groups first, and a process's nice weighs only inside its group. So
    a nice-0 neighbour in its own session takes half of a 2-CPU machine from the server's
    group, whatever the server's thread count, and a nice-19 one needs its group's nice
    set too (/proc/self/autogroup) to yield as `nice 19` promises."""
    os.nice(nice)
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass  # no autogroups: the nice level alone decides


class Neighbour:
    """A busy loop at a nice level in its own session (started and stopped around a measurement)."""

    def __init__(self, nice: int | None) -> None:
        self.nice, self.proc = nice, None

    def __enter__(self) -> Neighbour:
        if self.nice is not None:
            nice = self.nice
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True,
                                         preexec_fn=lambda: _lower_priority(nice))
            time.sleep(1.0)  # let the scheduler see it
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


PAGODA_VARIANTS = {
    "pagoda-openmp": {"PAGODA_CPU_LOOPS": "openmp"},  # the kernels' loops on OpenMP's team, not the work pool
    "pagoda-whole-head": {"PAGODA_CPU_GREEDY_HEAD": "0"},  # every step reads the whole bf16 LM head
    "pagoda-16bit-weights": {"PAGODA_CPU_12BIT_WEIGHTS": "0"},  # 1-2 row steps read the bf16 weights
}
"""Pagoda with one thing turned off, for A/B runs against `pagoda` (the environment each sets)."""


def server_spec(name: str, model: Path, gguf: Path, ns: argparse.Namespace, weights: str = "bf16") -> ServerSpec | Skipped:
    cpus = len(os.sched_getaffinity(0))
    method = WEIGHTS[weights][0]
    pagoda_args = shlex.split(ns.pagoda_args) + (["--quantization", method] if method else [])
    if name == "pagoda":
        return pagoda_spec(model, "bfloat16", pagoda_args)
    if name in PAGODA_VARIANTS:
        spec = pagoda_spec(model, "bfloat16", pagoda_args)
        spec.name, spec.env = name, dict(PAGODA_VARIANTS[name])
        return spec
    if name == "llama.cpp":
        return llama_server_spec(gguf, ns.llama_server, threads=cpus, parallel=ns.streams,
                                 ctx_per_slot=ns.input_len + ns.output_len + 64)
    raise ValueError(name)


async def capped_workload(url: str, model: str | None, requests, concurrency: int, cap_s: float) -> dict:
    """The requests over `concurrency` streams (greedy, ignore_eos), stopped after `cap_s`
    seconds if not done: a server that a neighbour slows a hundredfold would otherwise take
    an hour. Every token's arrival is timed as it streams, so a capped run still gives its
    rate: output tokens received / elapsed, and each stream's median gap (ITL)."""
    arrivals: list[list[float]] = [[] for _ in requests]
    queue = list(enumerate(requests))

    async def stream(client: httpx.AsyncClient, i: int, req) -> None:
        body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        if model:
            body["model"] = model
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith("data:") and line[5:].strip() != "[DONE]":
                    chunk = json.loads(line[5:])
                    if any(c.get("text") for c in chunk.get("choices") or ()):
                        arrivals[i].append(time.perf_counter())

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            i, req = queue.pop(0)
            await stream(client, i, req)

    start = time.perf_counter()
    capped = False
    # A connection per request (no keep-alive): llama-server closes idle connections, and a
    # request sent on one it has just closed fails with "Server disconnected" before it starts.
    async with httpx.AsyncClient(base_url=url, timeout=cap_s + 60,
                                 limits=httpx.Limits(max_connections=concurrency + 2,
                                                     max_keepalive_connections=0)) as client:
        try:
            await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(concurrency))), cap_s)
        except asyncio.TimeoutError:
            capped = True
    wall = time.perf_counter() - start
    tokens = sum(len(a) for a in arrivals)
    gaps = sorted(statistics.median(b - a for a, b in zip(t, t[1:])) for t in arrivals if len(t) > 2)
    # A stream's mean gap (first token to last): unlike the median it counts the rare long
    # gaps, e.g. a CPU quota's throttled periods.
    means = sorted((t[-1] - t[0]) / (len(t) - 1) for t in arrivals if len(t) > 2)
    return {"output_tokens": tokens, "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2),
            "median_itl_ms": round(1000 * gaps[len(gaps) // 2], 2) if gaps else None,
            "mean_itl_ms": round(1000 * means[len(means) // 2], 2) if means else None, "capped": capped}


def noise_workloads(spec: DatasetSpec, itl_requests: int, streams: int, source: TextSource) -> dict[str, tuple]:
    """Each noise condition's (c=1 requests, c=`streams` requests), prompts of their own: a
    server measured under several conditions keeps the earlier ones' prompts in its prefix
    cache (Pagoda's, llama.cpp's slots), and the same prompts again would skip their
    prefill. The same seeds for every server: each gets the same sets."""
    return {noise: (build_dataset(spec, itl_requests, seed=1 + 100 * i, source=source),
                    build_dataset(spec, streams, seed=2 + 100 * i, source=source))
            for i, noise in enumerate(NOISE)}


def read_pace_gbs() -> float:
    """This moment's memory read pace (bench_offline's read stream, run here in the client
    with the server idle): a batch-1 step streams its weights at what the memory gives, and
    on this project's VM that drifts up to 2x within minutes."""
    from loadtest.bench_offline import measure_read_bandwidth_gbs

    return round(measure_read_bandwidth_gbs(), 1)


def measure(url: str, model: str | None, one, many, streams: int, cap_s: float) -> dict:
    """c=1 then c=`streams`, with the read pace measured just before and just after the c=1
    requests (`c1_read_gbs`). Two servers' c=1 figures come minutes apart; the readings show
    which paces they met. They mark a round whose pace changed, but do not correct for it:
    the pace can flip within the seconds between two readings (2026-12-07: Pagoda's step at
    36.6 ms between readings of 58 and 60 GB/s, 28.5 ms between 50 and 55)."""
    before = read_pace_gbs()
    c1 = asyncio.run(capped_workload(url, model, one, 1, cap_s))
    after = read_pace_gbs()
    cn = asyncio.run(capped_workload(url, model, many, streams, cap_s))
    return {"c1_itl_ms": c1["median_itl_ms"], f"c{streams}_tok_s": cn["tok_s"], "c1": c1, f"c{streams}": cn,
            "c1_read_gbs": [before, after], "capped": c1["capped"] or cn["capped"]}


def run_server(spec: ServerSpec, ns: argparse.Namespace, workloads: dict[str, tuple], warm, log_dir: Path,
               noises: list[str], wrap=None) -> dict:
    """Start `spec` (through `wrap(command)` when given: under taskset, into a cgroup), warm
    it, measure it under each noise with that noise's (c=1, c=N) requests, stop it."""
    if wrap is not None:
        spec = ServerSpec(spec.name, wrap(list(spec.command)), spec.model, spec.env, spec.ready_paths)
    print(f"[noise] {spec.name}: {spec.display_command()} (load average {os.getloadavg()[0]:.2f})",
          file=sys.stderr, flush=True)
    server = LaunchedServer(spec, log_dir)
    out = {}
    try:
        server.wait_ready(ns.startup_timeout)
        asyncio.run(capped_workload(server.url, spec.model, warm, 2, ns.cap))
        for noise in noises:
            with Neighbour(NOISE[noise]):
                out[noise] = measure(server.url, spec.model, *workloads[noise], ns.streams, ns.cap)
            print(f"[noise]   {noise}: c=1 ITL {out[noise]['c1_itl_ms']} ms "
                  f"(read pace {' / '.join(map(str, out[noise]['c1_read_gbs']))} GB/s before / after), "
                  f"c={ns.streams} {out[noise][f'c{ns.streams}_tok_s']} tok/s"
                  f"{' (capped)' if out[noise]['capped'] else ''}", file=sys.stderr, flush=True)
        facts = [line.strip() for line in server.log_tail(200_000).splitlines() if "cpu_threads:" in line]
        if facts:
            out["cpu_threads_fact"] = facts[-1]
    finally:
        server.stop()
    return out


def quota_part(model: Path, ns: argparse.Namespace, workloads: dict[str, tuple], warm) -> dict | None:
    """Pagoda in a cgroup with a quota of one CPU (2 CPUs in its affinity mask): its own
    thread choice, `--cpu-threads 1` and `--cpu-threads 2` (what not noticing the quota
    would cost), each in a fresh cgroup; None where no cgroup can be made here."""
    from loadtest.cpu_quota import cpu_quota_cgroup

    out = {}
    for key, flags in (("auto", []), ("cpu_threads_1", ["--cpu-threads", "1"]),
                       ("cpu_threads_2", ["--cpu-threads", "2"])):
        with cpu_quota_cgroup(1.0) as wrap:
            if wrap is None:
                print("[noise] quota part skipped: no cgroup can be made here", file=sys.stderr)
                return None
            spec = pagoda_spec(model, "bfloat16", shlex.split(ns.pagoda_args) + flags)
            out[key] = run_server(spec, ns, workloads, warm, ns.out / "logs", ["none"], wrap=wrap)
    return out


def gemm_peak_gflops() -> float:
    """The bf16 GEMM rate this machine gives now (2048^3, the better of MKL and oneDNN with
    a packed weight: bench_offline.measure_matmul_gflops), measured with no server running."""
    import torch

    from loadtest.bench_offline import measure_matmul_gflops

    return measure_matmul_gflops(2048, 2048, 2048, torch.bfloat16)


def flop_bound(model: Path, many, peaks: list[float]) -> dict:
    """The c=N workload's least time on this machine: its FLOPs (every request's prompt and
    decode steps, bench_offline.request_flops) at the best bf16 GEMM rate measured before and
    after the servers ran; as output tokens / that time, the most tok/s any server could
    reach here (the steps of 32 rows are bound by their arithmetic, not the weight stream)."""
    from loadtest.bench_offline import model_size, request_flops

    size = model_size(model)
    flops = sum(request_flops(size, req.prompt_len or 0, req.max_tokens) for req in many)
    peak = max(peaks)
    return {"gemm_gflops": [round(p, 1) for p in peaks], "tflops": round(flops / 1e12, 3),
            "tok_s": round(sum(req.max_tokens for req in many) / (flops / (peak * 1e9)), 1)}


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["bundled"], choices=["bundled", "llama-1b"])
    ap.add_argument("--model-path", type=Path, help="the folder `bundled` stands for (default: the bundled model)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8-token outputs, 4 streams, 2 requests "
                    "at c=1 (tests use it)")
    ap.add_argument("--servers", nargs="+", default=["pagoda", "llama.cpp"],
                    choices=["pagoda", *PAGODA_VARIANTS, "llama.cpp"])
    ap.add_argument("--noise", nargs="+", default=["none", "nice0", "nice19"], choices=list(NOISE))
    ap.add_argument("--parts", nargs="+", default=["peers"], choices=["peers", "limit", "quota"])
    ap.add_argument("--weights", nargs="+", default=["bf16"], choices=list(WEIGHTS),
                    help="bf16, int8 (Pagoda --quantization int8 vs llama.cpp Q8_0), int4 (int4 vs Q4_0)")
    ap.add_argument("--rounds", type=int, default=1, help="the servers this many times, in alternating order")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--itl-requests", type=int, default=4)
    ap.add_argument("--pagoda-args", default="", help="extra flags for pagoda, one string")
    ap.add_argument("--llama-server", help="the llama-server binary (default: $PAGODA_LLAMA_SERVER or PATH)")
    ap.add_argument("--llama-cpp-dir", type=Path, help="llama.cpp's source tree, for convert_hf_to_gguf.py "
                    "(default: the tree the binary was built in)")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--cap", type=float, default=150.0, help="seconds a measurement may take; a slower one is "
                    "stopped and its rate taken over what it received (marked capped)")
    ap.add_argument("--out", type=Path, default=Path(".cache/bench-noise"))
    ap.add_argument("--json", type=Path)
    ns = ap.parse_args(argv)
    if ns.quick:
        ns.output_len, ns.input_len, ns.streams, ns.itl_requests = 8, 16, 4, 2

    from engine.default_model import default_model_path

    bundled = ns.model_path or default_model_path()
    binary = find_llama_server(ns.llama_server)
    tree = llama_cpp_dir(ns.llama_cpp_dir, binary)
    results: dict = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "args": vars(ns) | {
        "out": str(ns.out), "json": str(ns.json), "llama_cpp_dir": str(tree), "llama_server": binary}}
    labels = []
    for model_name in ns.models:
        model = bundled if model_name == "bundled" else random_llama_1b(bundled, ns.out / "models" / "llama-1b")
        source = TextSource(bundled)
        spec = DatasetSpec("random", input_len=LengthRange(ns.input_len, ns.input_len),
                           output_len=LengthRange(ns.output_len, ns.output_len))
        workloads = noise_workloads(spec, ns.itl_requests, ns.streams, source)
        many = workloads["none"][1]
        warm = build_dataset(DatasetSpec("random", input_len=LengthRange(ns.input_len, ns.input_len),
                                         output_len=LengthRange(8, 8)), 4, seed=3, source=source)
        for weights in ns.weights:
            label = model_name if weights == "bf16" else f"{model_name} {weights} (llama.cpp {WEIGHTS[weights][1]})"
            labels.append(label)
            gguf = None
            if "llama.cpp" in ns.servers and "peers" in ns.parts:
                if tree is None:
                    print("[noise] llama.cpp skipped: no convert_hf_to_gguf.py (--llama-cpp-dir)", file=sys.stderr)
                else:
                    gguf = model_gguf(model, tree, binary, ns.out / "models", model_name, weights)
            per_model: dict = {"model": str(model), "weights": weights, "gguf": str(gguf) if gguf else None,
                               "rounds": []}
            if "peers" in ns.parts:
                peaks = [gemm_peak_gflops()] if weights == "bf16" else []
                for r in range(ns.rounds):
                    order = ns.servers if r % 2 == 0 else list(reversed(ns.servers))
                    got = {}
                    for name in order:
                        s = server_spec(name, model, gguf, ns, weights)
                        if isinstance(s, Skipped):
                            print(f"[noise] {s.name} skipped: {s.reason}", file=sys.stderr)
                            continue
                        got[name] = run_server(s, ns, workloads, warm, ns.out / "logs", ns.noise)
                    per_model["rounds"].append(got)
                if peaks:
                    peaks.append(gemm_peak_gflops())
                    per_model["flop_bound"] = flop_bound(model, many, peaks)
            if "limit" in ns.parts and weights == "bf16":
                def cpu0(command: list[str]) -> list[str]:
                    return ["taskset", "-c", "0", *command]

                auto = run_server(pagoda_spec(model, "bfloat16", shlex.split(ns.pagoda_args)), ns, workloads, warm,
                                  ns.out / "logs", ["none"], wrap=cpu0)
                by_hand = run_server(
                    pagoda_spec(model, "bfloat16", shlex.split(ns.pagoda_args) + ["--cpu-threads", "1"]),
                    ns, workloads, warm, ns.out / "logs", ["none"], wrap=cpu0)
                per_model["limit"] = {"auto": auto, "cpu_threads_1": by_hand}
            if "quota" in ns.parts and weights == "bf16":
                per_model["quota"] = quota_part(model, ns, workloads, warm)
            results[label] = per_model

    n = ns.streams
    print(f"\nCPU serving next to other work ({os.cpu_count()} CPUs; {ns.output_len} greedy tokens, ignore_eos, "
          f"{ns.input_len}-token prompts; c=1 median ITL over {ns.itl_requests} requests, c={n} output tok/s)")
    for model_name in labels:
        per_model = results[model_name]
        for r, got in enumerate(per_model["rounds"]):
            print(f"\n{model_name}, round {r + 1}:")
            print(f"| server | noise | c=1 ITL ms | vs quiet | read GB/s around c=1 | c={n} tok/s | vs quiet |")
            print("|---|---|---|---|---|---|---|")
            for name, by_noise in got.items():
                quiet = by_noise.get("none", {})
                for noise in ns.noise:
                    m = by_noise[noise]
                    mark = " (capped)" if m["capped"] else ""
                    print(f"| {name} | {noise} | {m['c1_itl_ms']} | {ratio(m['c1_itl_ms'], quiet.get('c1_itl_ms'))} "
                          f"| {' / '.join(map(str, m.get('c1_read_gbs', [])))} "
                          f"| {m[f'c{n}_tok_s']}{mark} | {ratio(m[f'c{n}_tok_s'], quiet.get(f'c{n}_tok_s'))} |")
            if "pagoda" in got and len(got) > 1:
                for other in (s for s in got if s != "pagoda"):
                    print(f"pagoda / {other}: " + "; ".join(
                        f"{noise}: c=1 ITL {ratio(got['pagoda'][noise]['c1_itl_ms'], got[other][noise]['c1_itl_ms'])}, "
                        f"c={n} {ratio(got['pagoda'][noise][f'c{n}_tok_s'], got[other][noise][f'c{n}_tok_s'])}"
                        for noise in ns.noise))
        if per_model.get("flop_bound") and per_model["rounds"]:
            b = per_model["flop_bound"]
            quiet = [(name, got[name]["none"][f"c{n}_tok_s"]) for got in per_model["rounds"] for name in got
                     if "none" in got[name]]
            print(f"\n{model_name}: c={n} FLOP bound {b['tok_s']} tok/s ({b['tflops']} TFLOP of prompts and decode "
                  f"steps at the bf16 GEMM peak measured before / after the servers, "
                  f"{' / '.join(str(g) for g in b['gemm_gflops'])} GFLOP/s); quiet c={n} as a fraction of it: "
                  + ", ".join(f"{name} {tok / b['tok_s']:.0%}" for name, tok in quiet))
        if "limit" in per_model:
            lim = per_model["limit"]
            a, h = lim["auto"]["none"], lim["cpu_threads_1"]["none"]
            print(f"\n{model_name} under taskset -c 0: auto ({lim['auto'].get('cpu_threads_fact', '?')}) "
                  f"c=1 ITL {a['c1_itl_ms']} ms; --cpu-threads 1: {h['c1_itl_ms']} ms; auto / by hand "
                  f"{ratio(a['c1_itl_ms'], h['c1_itl_ms'])}")
        if per_model.get("quota"):
            q = per_model["quota"]
            auto = q["auto"]["none"]
            print(f"\n{model_name} in a cgroup with a quota of 1 CPU (loadtest/cpu_quota.py): auto "
                  f"({q['auto'].get('cpu_threads_fact', '?')})")
            print(f"| threads | c=1 ITL ms (median gap) | c=1 mean gap ms | c={n} tok/s | ITL vs auto |")
            print("|---|---|---|---|---|")
            for key in ("auto", "cpu_threads_1", "cpu_threads_2"):
                m = q[key]["none"]
                print(f"| {key} | {m['c1_itl_ms']} | {m['c1']['mean_itl_ms']} | {m[f'c{n}_tok_s']} "
                      f"| {ratio(m['c1_itl_ms'], auto['c1_itl_ms'])} |")
    path = ns.json or ns.out / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str))
    print(f"\n[noise] results in {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
