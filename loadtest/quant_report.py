"""The quantization quality report: docs/QUANTIZATION.md, every variant measured in one run.

    python -m loadtest.quant_report                       # the default model, default settings
    python -m loadtest.quant_report --calib-samples 8 --ppl-sequences 4   # a quick check

For each variant (float, W8A8, INT8 weight-only, INT4 RTN / AWQ / GPTQ) it writes the
folder with `pagoda quantize` (the float one is the model folder itself), starts `pagoda
serve --model DIR`, and measures through HTTP:
- perplexity on the held-out split of the built-in text (engine/quantization/calibration.py,
  disjoint from the calibration split): `/v1/completions` with the token ids as the prompt,
  `echo: true, logprobs: 0, max_tokens: 0`; ppl = exp(mean of -logprob) over every token
  that has context (all but the first of each sequence);
- batch-1 decode tokens/s: (N - 1) / (time of an N-token request - time of a 1-token
  request), greedy with ignore_eos, best of `--repeats` (prefill and HTTP overhead cancel);
- size on disk: the folder's *.safetensors bytes.
The INT4 group size is the one the folders record (128 when it divides every layer's input
features; SmolLM2's K = 576 makes it 64). Other processes' CPU use during each server's
measurements is reported, because on a shared machine it skews the timings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import httpx

from loadtest.machine import OtherCpu
from loadtest.servers import REPO_ROOT, LaunchedServer, pagoda_spec

# name -> (pagoda quantize --method, --bits); None = the float folder itself
VARIANTS = {
    "float": None,
    "w8a8": ("w8a8", 8),
    "int8": ("rtn", 8),
    "int4-rtn": ("rtn", 4),
    "int4-awq": ("awq", 4),
    "int4-gptq": ("gptq", 4),
}
EXTRA_QUANTIZE_ARGS = {"int4-gptq": ["--act-order"]}  # measured: ppl 30.1 -> 28.2 on SmolLM2 (group 64)
LABELS = {
    "float": "float32", "w8a8": "W8A8 (SmoothQuant)", "int8": "INT8 weight-only (RTN)",
    "int4-rtn": "INT4 RTN", "int4-awq": "INT4 AWQ", "int4-gptq": "INT4 GPTQ (act-order)",
}
GOAL_INT8_PPL = 1.01
GOAL_INT8_SPEEDUP = 1.6
GOAL_INT4_SHARE = 2 / 3  # AWQ or GPTQ keeps at most 2/3 of RTN's perplexity increase
DECODE_PROMPT = "Write a short story about a robot who learns to paint."


@dataclass(slots=True)
class Result:
    variant: str
    folder: str
    quantization_config: dict | None
    size_bytes: int
    quantize_seconds: float | None
    perplexity: float
    num_tokens: int
    decode_tok_s: float
    other_cpu_cores: float | None


def quantize(variant: str, model_dir: Path, out: Path, args: argparse.Namespace) -> float:
    method, bits = VARIANTS[variant]
    cmd = [sys.executable, "-m", "server.cli", "quantize", "--model", str(model_dir), "--method", method,
           "--bits", str(bits), "--group-size", str(args.group_size), "--out", str(out),
           "--calib-samples", str(args.calib_samples), "--calib-seq-len", str(args.calib_seq_len),
           *EXTRA_QUANTIZE_ARGS.get(variant, [])]
    print(f"[quant_report] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    return time.perf_counter() - start


def perplexity(url: str, model: str, sequences: list[list[int]]) -> tuple[float, int]:
    """exp(mean -logprob) over every token after the first of each sequence."""
    nll, count = 0.0, 0
    for seq in sequences:
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": seq, "echo": True, "logprobs": 0, "max_tokens": 0, "temperature": 0})
        r.raise_for_status()
        logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
        if len(logprobs) != len(seq) or logprobs[0] is not None:
            raise RuntimeError(f"expected {len(seq)} prompt logprobs (the first None), got {len(logprobs)}")
        nll -= sum(logprobs[1:])
        count += len(seq) - 1
    return math.exp(nll / count), count


def decode_tok_s(url: str, model: str, num_tokens: int, repeats: int) -> float:
    def timed(max_tokens: int) -> float:
        start = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "model": model, "prompt": DECODE_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        if r.json()["usage"]["completion_tokens"] != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {r.json()['usage']}")
        return time.perf_counter() - start

    timed(num_tokens)  # warm-up
    one = min(timed(1) for _ in range(repeats))
    full = min(timed(num_tokens) for _ in range(repeats))
    return (num_tokens - 1) / (full - one)


def measure(variant: str, folder: Path, sequences: list[list[int]], args: argparse.Namespace, log_dir: Path) -> tuple[float, int, float, float | None]:
    max_len = max(len(sequences[0]), 64 + args.decode_tokens) + 16
    spec = pagoda_spec(folder, "float32", ["--max-model-len", str(max_len), "--served-model-name", variant])
    server = LaunchedServer(spec, log_dir)
    try:
        server.wait_ready(args.startup_timeout)
        other = OtherCpu(server.proc.pid)
        ppl, count = perplexity(server.url, variant, sequences)
        tok_s = decode_tok_s(server.url, variant, args.decode_tokens, args.repeats)
        return ppl, count, tok_s, other.cores()
    finally:
        server.stop()


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def render(results: list[Result], args: argparse.Namespace, command: str) -> str:
    import torch

    by = {r.variant: r for r in results}
    base = by.get("float")
    group = next((r.quantization_config.get("group_size") for r in results
                  if r.quantization_config and r.quantization_config.get("bits") == 4), None)
    lines = [
        "# Quantization quality report",
        "",
        "Generated by `python -m loadtest.quant_report` (do not edit by hand). Every figure comes from",
        "one run: each variant written by `pagoda quantize`, served by `pagoda serve --model DIR`,",
        "measured over HTTP.",
        "",
        f"- Date: {date.today().isoformat()}. Machine: {platform.machine()}, {platform.system()}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
        f"(the servers inherit it), Python {platform.python_version()}.",
        f"- Command: `{command}`.",
        f"- Perplexity: held-out split of the built-in text (Python's `pydoc_data` prose, disjoint from the "
        f"calibration split), {args.ppl_sequences} sequences x {args.ppl_seq_len} tokens, through "
        "`/v1/completions` with `echo: true, logprobs: 0, max_tokens: 0`.",
        f"- Calibration (W8A8, AWQ, GPTQ): {args.calib_samples} x {args.calib_seq_len} tokens of the calibration split.",
        f"- INT4 group size: {group} (requested {args.group_size}; it must divide every linear's input "
        "features, and SmolLM2's K = 576 is not a multiple of 128). INT4 folders keep the LM head float "
        "(as AutoAWQ/AutoGPTQ write it); INT8 and W8A8 folders hold an INT8 weight-only LM head.",
        f"- Decode: batch 1, {args.decode_tokens} greedy tokens, (N - 1) / (t(N tokens) - t(1 token)), best of {args.repeats}.",
        "",
        "| variant | layout | size on disk (MB) | perplexity | vs float | decode tok/s | vs float | quantize (s) | other CPU (cores) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        qc = r.quantization_config or {}
        layout = qc.get("quant_method", "float") + (f" ({qc['format']})" if "format" in qc else "")
        ppl_rel = f"{100 * (r.perplexity / base.perplexity - 1):+.2f}%" if base else ""
        speed = f"{r.decode_tok_s / base.decode_tok_s:.2f}x" if base else ""
        quant_s = "" if r.quantize_seconds is None else f"{r.quantize_seconds:.0f}"
        other = "" if r.other_cpu_cores is None else f"{r.other_cpu_cores:.2f}"
        lines.append(f"| {LABELS[r.variant]} | {layout} | {r.size_bytes / 1e6:.1f} | {r.perplexity:.3f} | {ppl_rel} "
                     f"| {r.decode_tok_s:.1f} | {speed} | {quant_s} | {other} |")
    lines += ["", "Goals (issue 5):", ""]
    if base and "int8" in by:
        ratio = by["int8"].perplexity / base.perplexity
        lines.append(f"- INT8 perplexity within +1% of float: {100 * (ratio - 1):+.2f}% -> "
                     f"{'PASS' if ratio <= GOAL_INT8_PPL else 'MISS'}")
        speedup = by["int8"].decode_tok_s / base.decode_tok_s
        lines.append(f"- INT8 decode >= {GOAL_INT8_SPEEDUP}x float: {speedup:.2f}x -> "
                     f"{'PASS' if speedup >= GOAL_INT8_SPEEDUP else 'MISS'} (timings are only as good as the "
                     "machine was quiet: see the other-CPU column)")
    if base and "int4-rtn" in by and ({"int4-awq", "int4-gptq"} & set(by)):
        rtn = by["int4-rtn"].perplexity - base.perplexity
        best = min((by[v] for v in ("int4-awq", "int4-gptq") if v in by), key=lambda r: r.perplexity)
        share = (best.perplexity - base.perplexity) / rtn if rtn > 0 else float("inf")
        lines.append(f"- INT4 AWQ or GPTQ clearly better than INT4 RTN (keeps <= {GOAL_INT4_SHARE:.0%} of RTN's "
                     f"perplexity increase): {LABELS[best.variant]} keeps {share:.0%} -> "
                     f"{'PASS' if share <= GOAL_INT4_SHARE else 'MISS'}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.quant_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="float Hugging Face folder (default: the bundled model)")
    p.add_argument("--work-dir", default="/tmp/pagoda-quant-report", help="where the quantized folders go")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--group-size", type=int, default=128)
    # 32 x 256 tokens keep AWQ's grid search (the slowest step) to minutes on a 2-core CPU.
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--ppl-sequences", type=int, default=16)
    p.add_argument("--ppl-seq-len", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--reuse", action="store_true", help="keep quantized folders already in --work-dir")
    p.add_argument("--out", default=str(REPO_ROOT / "docs" / "QUANTIZATION.md"))
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from engine.default_model import resolve_model_path
    from engine.quantization.calibration import calibration_token_ids

    model_dir = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sequences = calibration_token_ids(tokenizer, args.ppl_sequences, args.ppl_seq_len, split="heldout").tolist()
    work = Path(args.work_dir)
    results = []
    for variant in args.variants:
        folder, seconds = model_dir, None
        if VARIANTS[variant] is not None:
            folder = work / variant
            if not (args.reuse and (folder / "config.json").is_file()):
                seconds = quantize(variant, model_dir, folder, args)
        config = json.loads((folder / "config.json").read_text()).get("quantization_config")
        ppl, count, tok_s, other = measure(variant, folder, sequences, args, work / "logs")
        results.append(Result(variant, str(folder), config, folder_size(folder), seconds, ppl, count, tok_s, other))
        print(f"[quant_report] {variant}: ppl {ppl:.3f} over {count} tokens, {tok_s:.1f} tok/s, "
              f"{folder_size(folder) / 1e6:.1f} MB", file=sys.stderr, flush=True)
    command = "python -m loadtest.quant_report " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(render(results, args, command.strip()))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    print(f"[quant_report] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
