"""The quantization quality report: docs/QUANTIZATION.md, every variant measured in one run.

    python -m loadtest.quant_report                       # the default model, default settings
    python -m loadtest.quant_report --calib-samples 8 --ppl-sequences 4   # a quick check
    python -m loadtest.quant_report --dtype bfloat16 --kv-cache-dtypes auto int8   # weights x KV caches

For each weight variant (float, W8A8, INT8 weight-only, INT4 RTN / AWQ / GPTQ) it writes
the folder with `pagoda quantize` (the float one is the model folder itself) and, for each
KV cache dtype (`--kv-cache-dtypes`: `auto` keeps K/V in the compute dtype, `int8`/`fp8`
quantize them, kernels/kv_quant.py), starts `pagoda serve --model DIR --dtype DTYPE
--kv-cache-dtype KV` and measures through HTTP:
- perplexity on the held-out split of the built-in text (engine/quantization/calibration.py,
  disjoint from the calibration split): `/v1/completions` with the token ids as the prompt,
  `echo: true, logprobs: 0, max_tokens: 0`; ppl = exp(mean of -logprob) over every token
  that has context (all but the first of each sequence);
- batch-1 decode tokens/s: (N - 1) / (time of an N-token request - time of a 1-token
  request), greedy with ignore_eos, best of `--repeats` (prefill and HTTP overhead cancel);
  a quick look, not the benchmark of record (docs/BENCHMARKS.md has those, the KV cache's
  included); `--no-decode` skips it, and its columns;
- size on disk: the folder's *.safetensors bytes.
The INT4 group size is the one the folders record (128 when it divides every layer's input
features; SmolLM2's K = 576 makes it 64). Other processes' CPU use during each server's
measurements is reported, because on a shared machine it skews the timings.

With a quantized KV dtype among `--kv-cache-dtypes`, two in-process measurements follow
(engine.llm.LLM on the float weights, `--dtype`):
- the KV cache's quantization error: the real post-RoPE K and V that every layer writes
  (a spy on the ops' `reshape_and_cache`) while `--kv-sequences` held-out sequences prefill,
  quantized per scheme (INT8 symmetric per token and head, as Pagoda stores it; INT8
  asymmetric with a zero point; FP8 E4M3; INT8 per tensor), K and V apart: relative RMS
  error ||deq - x|| / ||x|| and the largest |deq - x| relative to its row's absmax;
- greedy agreement: the prompts tests/engine/test_generate_hf.py compares with Hugging
  Face `generate`, `--greedy-tokens` greedy tokens with the compute-dtype KV cache against
  each quantized one: the leading tokens that agree, and the positions that agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
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

from kernels.kv_quant import KV_CACHE_DTYPES
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
LABELS = {  # "float" is labelled with the served dtype (`label`)
    "w8a8": "W8A8 (SmoothQuant)", "int8": "INT8 weight-only (RTN)",
    "int4-rtn": "INT4 RTN", "int4-awq": "INT4 AWQ", "int4-gptq": "INT4 GPTQ (act-order)",
}
GOAL_INT8_PPL = 1.01
GOAL_INT8_SPEEDUP = 1.6
GOAL_INT4_SHARE = 2 / 3  # AWQ or GPTQ keeps at most 2/3 of RTN's perplexity increase
GOAL_KV_INT8_PPL = 1.01  # INT8 KV: at most +1% perplexity over the same weights with the compute-dtype cache
DECODE_PROMPT = "Write a short story about a robot who learns to paint."


def label(variant: str, dtype: str) -> str:
    return f"float ({dtype})" if variant == "float" else LABELS[variant]


@dataclass(slots=True)
class Result:
    variant: str
    kv_cache_dtype: str
    dtype: str
    folder: str
    quantization_config: dict | None
    size_bytes: int
    quantize_seconds: float | None
    perplexity: float
    num_tokens: int
    decode_tok_s: float | None  # None: not timed (--no-decode)
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


def measure(variant: str, kv: str, folder: Path, sequences: list[list[int]], args: argparse.Namespace,
            log_dir: Path) -> tuple[float, int, float | None, float | None]:
    max_len = max(len(sequences[0]), 64 + args.decode_tokens) + 16
    spec = pagoda_spec(folder, args.dtype, ["--max-model-len", str(max_len), "--served-model-name", variant,
                                            "--kv-cache-dtype", kv])
    server = LaunchedServer(spec, log_dir)
    try:
        server.wait_ready(args.startup_timeout)
        other = OtherCpu(server.proc.pid)
        ppl, count = perplexity(server.url, variant, sequences)
        if args.no_decode:
            return ppl, count, None, None
        tok_s = decode_tok_s(server.url, variant, args.decode_tokens, args.repeats)
        return ppl, count, tok_s, other.cores()
    finally:
        server.stop()


def folder_size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


# ---- the KV cache's quantization error -------------------------------------------------------


def capture_kv(model_dir: Path, dtype: str, sequences: list[list[int]]) -> tuple[list, list]:
    """Per layer, the K and V rows `[tokens, kv_heads, head_dim]` (in `dtype`, post-RoPE) that
    the model writes to its KV cache while `sequences` prefill: a spy on the engine's
    `ops.reshape_and_cache`, which every layer calls once a forward, in layer order."""
    import torch

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(str(model_dir), dtype=dtype, max_model_len=max(map(len, sequences)) + 16, enable_prefix_caching=False)
    worker = llm.engine_core.worker
    num_layers = worker.args.num_hidden_layers
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = worker.ops.reshape_and_cache

    def spy(k, v, key_cache, value_cache, slot_mapping):
        keep = slot_mapping >= 0  # padding rows (if any) write nowhere
        calls.append((k[keep].clone(), v[keep].clone()))
        real(k, v, key_cache, value_cache, slot_mapping)

    worker.ops = dataclasses.replace(worker.ops, reshape_and_cache=spy)  # after start-up: no warm-up pass seen
    llm.generate(sequences, SamplingParams(temperature=0, max_tokens=1))  # prefill only: no decode step
    llm.shutdown()
    del llm, worker
    gc.collect()
    if len(calls) % num_layers:
        raise RuntimeError(f"{len(calls)} reshape_and_cache calls for {num_layers} layers")
    keys = [torch.cat([c[0] for c in calls[i::num_layers]]) for i in range(num_layers)]
    values = [torch.cat([c[1] for c in calls[i::num_layers]]) for i in range(num_layers)]
    if keys[0].shape[0] != sum(map(len, sequences)):
        raise RuntimeError(f"captured {keys[0].shape[0]} K rows a layer, expected {sum(map(len, sequences))} "
                           "(a step the spy did not see: the fused decode call?)")
    return keys, values


def _int8_asymmetric(x):
    """INT8 asymmetric per row (for comparison only; Pagoda does not store it): scale =
    (max - min) / 255 over a range that includes 0, rounded *up* to bf16 (rounded down, the
    range's far end would clip), an integer zero point, uint8 codes."""
    import torch

    lo = x.amin(dim=-1, keepdim=True).clamp(max=0)
    hi = x.amax(dim=-1, keepdim=True).clamp(min=0)
    exact = (hi - lo) / 255
    scale = exact.to(torch.bfloat16)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / safe).clamp(0, 255)
    q = (torch.round(x / safe) + zero).clamp(0, 255)
    return torch.where(scale > 0, (q - zero) * scale, torch.zeros_like(x))


def _int8_per_tensor(x):
    """INT8 symmetric with one scale for the whole tensor (a layer's K or V over every token and head)."""
    import torch

    scale = (x.abs().max() / 127).to(torch.bfloat16).float()
    return torch.round(x / scale).clamp(-127, 127) * scale if scale > 0 else torch.zeros_like(x)


def _kv_quant(kind: str):
    from kernels import kv_quant

    return lambda x: kv_quant.dequantize(kv_quant.quantize(x, kind))


# name -> (description, extra bytes a (token, head) row stores beside head_dim one-byte codes, dequantized(x))
KV_SCHEMES = {
    "int8-sym": ("INT8 symmetric, per token + head (Pagoda's `int8`)", 2, _kv_quant("int8")),
    "int8-asym": ("INT8 asymmetric (zero point), per token + head", 4, _int8_asymmetric),
    "fp8-sym": ("FP8 E4M3 symmetric, per token + head (Pagoda's `fp8`)", 2, _kv_quant("fp8")),
    "int8-tensor": ("INT8 symmetric, per tensor (one scale a layer's K or V)", 0, _int8_per_tensor),
}


@dataclass(slots=True)
class KvErrors:
    head_dim: int
    rows: int  # (token, KV head) rows of K (as many of V) over all layers
    skew: dict  # "K"/"V" -> mean over rows of |max + min| / (max - min): 0 a range symmetric about 0, 1 one-signed
    errors: list  # [KvError]


@dataclass(slots=True)
class KvError:
    scheme: str
    tensor: str  # K or V
    rel_rms: float  # ||deq - x|| / ||x|| over every layer's rows
    worst_layer_rel_rms: float
    worst_layer: int
    max_err_of_absmax: float  # max over rows of max|deq - x| / the row's absmax
    mean_err_of_absmax: float  # the mean over rows of the same


def kv_errors(keys: list, values: list) -> KvErrors:
    out = []
    skew = {}
    for name, layers in (("K", keys), ("V", values)):
        total, rows = 0.0, 0
        for x in layers:
            x = x.float()
            hi, lo = x.amax(dim=-1), x.amin(dim=-1)
            span = hi - lo
            total, rows = total + float(((hi + lo).abs() / span)[span > 0].sum()), rows + int((span > 0).sum())
        skew[name] = total / rows
    for scheme, (_, _, deq) in KV_SCHEMES.items():
        for name, layers in (("K", keys), ("V", values)):
            err2 = x2 = 0.0
            per_layer, row_max, row_sum, rows = [], 0.0, 0.0, 0
            for x in layers:
                x = x.float()
                e = deq(x) - x
                le2, lx2 = float(e.square().sum()), float(x.square().sum())
                err2, x2 = err2 + le2, x2 + lx2
                per_layer.append(math.sqrt(le2 / lx2))
                absmax = x.abs().amax(dim=-1)
                rel = e.abs().amax(dim=-1)[absmax > 0] / absmax[absmax > 0]
                row_max, row_sum, rows = max(row_max, float(rel.max())), row_sum + float(rel.sum()), rows + rel.numel()
            worst = max(range(len(per_layer)), key=per_layer.__getitem__)
            out.append(KvError(scheme, name, math.sqrt(err2 / x2), per_layer[worst], worst, row_max, row_sum / rows))
    return KvErrors(keys[0].shape[-1], sum(x.shape[0] * x.shape[1] for x in keys), skew, out)


# ---- greedy agreement -------------------------------------------------------------------------


@dataclass(slots=True)
class Greedy:
    prompt: str  # a short description
    prompt_tokens: int
    tokens: dict  # kv cache dtype (or "float32 auto", the HF-parity reference) -> the greedy token ids


def hf_parity_prompts(tokenizer) -> list[list[int]]:
    """The prompts whose greedy tokens tests/engine/test_generate_hf.py compares with Hugging Face `generate`."""
    from tests.engine.test_generate_hf import _prompts

    return _prompts(tokenizer)


def describe_prompt(tokenizer, ids: list[int]) -> str:
    text = tokenizer.decode(ids)
    if "<|im_start|>user\n" in text:  # a chat template's prompt: the user's message
        text = "chat: " + text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
    elif len(text) > 40:  # a long prompt: its end, from a word's start
        tail = text[-36:]
        text = "... " + tail[tail.find(" ") + 1:]
    return text.replace("\n", " ")


def greedy_agreement(model_dir: Path, dtype: str, kv_dtypes: list[str], num_tokens: int) -> list[Greedy]:
    from transformers import AutoTokenizer

    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = hf_parity_prompts(tokenizer)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    runs = [(dtype, kv) for kv in kv_dtypes] + ([("float32", "auto")] if dtype != "float32" else [])
    tokens = {}
    for run_dtype, kv in runs:
        key = kv if run_dtype == dtype else f"{run_dtype} {kv}"
        llm = LLM(str(model_dir), dtype=run_dtype, kv_cache_dtype=kv, max_model_len=max(map(len, prompts)) + num_tokens + 16)
        tokens[key] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        del llm
        gc.collect()
    return [Greedy(describe_prompt(tokenizer, p), len(p), {k: v[i] for k, v in tokens.items()}) for i, p in enumerate(prompts)]


def leading_agreement(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ---- the report -------------------------------------------------------------------------------


def render(results: list[Result], args: argparse.Namespace, command: str,
           kv: KvErrors | None = None, greedy: list[Greedy] | None = None) -> str:
    import torch

    by = {(r.variant, r.kv_cache_dtype): r for r in results}
    kvs = list(dict.fromkeys(r.kv_cache_dtype for r in results))
    ref_kv = "auto" if "auto" in kvs else kvs[0]  # the KV cache the weight goals are measured with
    many_kv = len(kvs) > 1
    timed = all(r.decode_tok_s is not None for r in results)
    group = next((r.quantization_config.get("group_size") for r in results
                  if r.quantization_config and r.quantization_config.get("bits") == 4), None)
    lines = [
        "# Quantization quality report",
        "",
        "Generated by `python -m loadtest.quant_report` (do not edit by hand). Every figure comes from",
        "one run: each weight variant written by `pagoda quantize`, served by `pagoda serve --model DIR",
        f"--dtype {args.dtype} --kv-cache-dtype KV` once per KV cache dtype, measured over HTTP; the KV",
        "cache's error figures and the greedy agreement come from the same run, in process.",
        "",
        f"- Date: {date.today().isoformat()}. Machine: {platform.machine()}, {platform.system()}, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} "
        f"(the servers inherit it), Python {platform.python_version()}.",
        f"- Command: `{command}`.",
        f"- Compute dtype: {args.dtype}. KV cache: `auto` stores K/V in the compute dtype"
        + ("." if not set(kvs) - {"auto"} else
           "; `int8` stores each (token, KV head) row as one-byte codes and a bf16 scale (kernels/kv_quant.py"
           + (", `fp8` the same with E4M3 codes" if "fp8" in kvs else "") + ")"
           + ("; the C++ CPU attention reads the int8 rows in place (scores: integer dots of the query rows, quantized to int8 per row, and the key codes)." if args.dtype == "bfloat16"
              else f"; on CPU in {args.dtype} the int8 rows go through the torch reference (dequantized each step), "
                   "the same quantization.")),
        f"- Perplexity: held-out split of the built-in text (Python's `pydoc_data` prose, disjoint from the "
        f"calibration split), {args.ppl_sequences} sequences x {args.ppl_seq_len} tokens, through "
        "`/v1/completions` with `echo: true, logprobs: 0, max_tokens: 0`. \"vs float\" compares with the "
        "float weights under the same KV cache" + (f"; \"vs {ref_kv} KV\" with the same weights under the `{ref_kv}` "
                                                   "cache." if many_kv else "."),
        f"- Calibration (W8A8, AWQ, GPTQ): {args.calib_samples} x {args.calib_seq_len} tokens of the calibration split.",
        f"- INT4 group size: {group} (requested {args.group_size}; it must divide every linear's input "
        "features, and SmolLM2's K = 576 is not a multiple of 128). INT4 folders keep the LM head float "
        "(as AutoAWQ/AutoGPTQ write it); INT8 and W8A8 folders hold an INT8 weight-only LM head.",
        (f"- Decode: batch 1, {args.decode_tokens} greedy tokens, (N - 1) / (t(N tokens) - t(1 token)), best of "
         f"{args.repeats}, over HTTP. A quick look only: not the KV cache benchmark, and not the figures of record "
         "for weight-only decode either (both are in [docs/BENCHMARKS.md](BENCHMARKS.md)); on a shared machine "
         "these timings measure the machine as much as the method (see the other-CPU column)." if timed else
         "- Decode speed: not timed in this run (`--no-decode`): the CPU decode speed of quantized weights and of "
         "the quantized KV cache is measured in [docs/BENCHMARKS.md](BENCHMARKS.md) "
         "([\"Weight-only quantization, CPU decode\"](BENCHMARKS.md#weight-only-quantization-cpu-decode) for the "
         "weights)."),
        "",
        "| weights | KV cache | layout | size on disk (MB) | perplexity | vs float "
        + (f"| vs {ref_kv} KV " if many_kv else "")
        + ("| decode tok/s | vs float " if timed else "") + "| quantize (s) |" + (" other CPU (cores) |" if timed else ""),
        "|---|---|---|---:|---:|---:|" + ("---:|" if many_kv else "") + ("---:|---:|" if timed else "") + "---:|" + ("---:|" if timed else ""),
    ]
    for r in results:
        qc = r.quantization_config or {}
        layout = qc.get("quant_method", "float") + (f" ({qc['format']})" if "format" in qc else "")
        base = by.get(("float", r.kv_cache_dtype))
        same_w = by.get((r.variant, ref_kv))
        ppl_rel = f"{100 * (r.perplexity / base.perplexity - 1):+.2f}%" if base else ""
        kv_rel = f"{100 * (r.perplexity / same_w.perplexity - 1):+.2f}%" if same_w else ""
        quant_s = "" if r.quantize_seconds is None else f"{r.quantize_seconds:.0f}"
        row = (f"| {label(r.variant, r.dtype)} | {r.kv_cache_dtype} | {layout} | {r.size_bytes / 1e6:.1f} "
               f"| {r.perplexity:.3f} | {ppl_rel} |" + (f" {kv_rel} |" if many_kv else ""))
        if timed:
            speed = f"{r.decode_tok_s / base.decode_tok_s:.2f}x" if base else ""
            row += f" {r.decode_tok_s:.1f} | {speed} |"
        row += f" {quant_s} |"
        if timed:
            row += " " + ("" if r.other_cpu_cores is None else f"{r.other_cpu_cores:.2f}") + " |"
        lines.append(row)
    lines += ["", "Goals:", ""]
    base = by.get(("float", ref_kv))
    kv_note = f" (`{ref_kv}` KV cache)" if many_kv else ""
    if base and ("int8", ref_kv) in by:
        int8 = by[("int8", ref_kv)]
        ratio = int8.perplexity / base.perplexity
        lines.append(f"- INT8 weight perplexity within +1% of float{kv_note}: {100 * (ratio - 1):+.2f}% -> "
                     f"{'PASS' if ratio <= GOAL_INT8_PPL else 'MISS'}")
        if not timed:
            lines.append(f"- INT8 weight decode >= {GOAL_INT8_SPEEDUP}x float: measured in docs/BENCHMARKS.md "
                         "(\"Weight-only quantization, CPU decode\"), not in this run.")
        else:
            speedup = int8.decode_tok_s / base.decode_tok_s
            lines.append(f"- INT8 weight decode >= {GOAL_INT8_SPEEDUP}x float{kv_note}: {speedup:.2f}x in this run -> "
                         f"{'PASS' if speedup >= GOAL_INT8_SPEEDUP else 'MISS'} (timings are only as good as the "
                         "machine was quiet: see the other-CPU column; the figure of record is docs/BENCHMARKS.md's, "
                         "\"Weight-only quantization, CPU decode\")")
    rtn = by.get(("int4-rtn", ref_kv))
    better = [by[(v, ref_kv)] for v in ("int4-awq", "int4-gptq") if (v, ref_kv) in by]
    if base and rtn and better:
        rise = rtn.perplexity - base.perplexity
        best = min(better, key=lambda r: r.perplexity)
        share = (best.perplexity - base.perplexity) / rise if rise > 0 else float("inf")
        lines.append(f"- INT4 AWQ or GPTQ clearly better than INT4 RTN, keeping <= {GOAL_INT4_SHARE:.0%} of RTN's "
                     f"perplexity increase{kv_note}: {label(best.variant, best.dtype)} keeps {share:.0%} -> "
                     f"{'PASS' if share <= GOAL_INT4_SHARE else 'MISS'}")
    if "int8" in kvs and "auto" in kvs:
        for variant in dict.fromkeys(r.variant for r in results):
            a, q = by.get((variant, "auto")), by.get((variant, "int8"))
            if a and q:
                ratio = q.perplexity / a.perplexity
                lines.append(f"- {label(variant, a.dtype)}: INT8 KV perplexity within +1% of the same weights with "
                             f"the compute-dtype KV cache: {100 * (ratio - 1):+.2f}% -> "
                             f"{'PASS' if ratio <= GOAL_KV_INT8_PPL else 'MISS'}")
    if kv:
        a, q = by.get(("float", "auto")), by.get(("float", "int8"))
        lines += render_kv_errors(kv, args, q.perplexity / a.perplexity if a and q else None)
    if greedy:
        lines += render_greedy(greedy, args)
    return "\n".join(lines) + "\n"


def render_kv_errors(kv: KvErrors, args: argparse.Namespace, int8_kv_rise: float | None) -> list[str]:
    """The KV cache section; `int8_kv_rise`: the float weights' perplexity ratio int8 KV / auto KV, if measured."""
    e = {(x.scheme, x.tensor): x for x in kv.errors}
    d = kv.head_dim
    ref = 2 * d  # bytes of a bf16 row
    pct = lambda v: f"{100 * v:.2f}%"  # noqa: E731
    lines = [
        "",
        "## KV cache",
        "",
        f"Quantization error of the real K and V: every layer's post-RoPE K and V rows, float weights in "
        f"{args.dtype}, captured (a spy on the engine's `reshape_and_cache`) while {args.kv_sequences} held-out "
        f"sequences of {args.ppl_seq_len} tokens prefill ({kv.rows} (layer, token, KV head) rows of K and as many of V), "
        "then quantized and dequantized by each scheme. Relative RMS error: ||deq - x|| / ||x|| over all layers' "
        "rows (the worst layer's beside it). Row error: max |deq - x| over a (token, head) row divided by that "
        f"row's absmax, the mean over rows and the largest. Bytes per row at head dim {d}: the codes and what the "
        f"scheme stores beside them (a bf16 row is {ref} bytes).",
        "",
        "| scheme | bytes/row | tokens vs bf16 | K rel. RMS | K worst layer | K row err mean / max | V rel. RMS "
        "| V worst layer | V row err mean / max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for scheme, (desc, extra, _) in KV_SCHEMES.items():
        k, v = e[(scheme, "K")], e[(scheme, "V")]
        row = d + extra
        lines.append(f"| {desc} | {row} | {ref / row:.2f}x | {pct(k.rel_rms)} | {pct(k.worst_layer_rel_rms)} (layer "
                     f"{k.worst_layer}) | {pct(k.mean_err_of_absmax)} / {pct(k.max_err_of_absmax)} | {pct(v.rel_rms)} "
                     f"| {pct(v.worst_layer_rel_rms)} (layer {v.worst_layer}) | {pct(v.mean_err_of_absmax)} / "
                     f"{pct(v.max_err_of_absmax)} |")
    sym_k, sym_v = e[("int8-sym", "K")], e[("int8-sym", "V")]
    asym_k, asym_v = e[("int8-asym", "K")], e[("int8-asym", "V")]
    fp8_k, fp8_v = e[("fp8-sym", "K")], e[("fp8-sym", "V")]
    ten_k, ten_v = e[("int8-tensor", "K")], e[("int8-tensor", "V")]
    less_k, less_v = 1 - asym_k.rel_rms / sym_k.rel_rms, 1 - asym_v.rel_rms / sym_v.rel_rms
    bits = lambda less: math.log2(1 / (1 - less)) if less < 1 else math.inf  # noqa: E731
    clearly = min(less_k, less_v) >= 1 / 3  # a third less error on both K and V: over half a bit
    said = lambda less: f"{100 * less:.0f}% less" if less >= 0 else f"{100 * -less:.0f}% more"  # noqa: E731
    lines += [
        "",
        f"**Which scheme, and why.** Pagoda's INT8 KV cache is symmetric, per token and KV head: each row's scale "
        f"is bf16(absmax / 127), computed as the row is written (nothing to calibrate), so an outlier in one token "
        f"or head costs no precision anywhere else; one-byte codes and a 2-byte scale make a row {d + 2} bytes "
        f"instead of {ref}, {ref / (d + 2):.2f}x the tokens in the same memory, and a value reads back with one "
        f"multiply (no zero point to store or to subtract in the attention's inner loop). Measured here: symmetric "
        f"gives K {pct(sym_k.rel_rms)} and V {pct(sym_v.rel_rms)} relative RMS error. Asymmetric (scale = "
        f"(max - min) / 255 and a uint8 zero point beside it: {d + 4} bytes a row with the scale kept 2-byte aligned, "
        f"{ref / (d + 4):.2f}x) gives K "
        f"{pct(asym_k.rel_rms)} ({said(less_k)}, {bits(less_k):.2f} bit) and V {pct(asym_v.rel_rms)} "
        f"({said(less_v)}, {bits(less_v):.2f} bit): K gains more because its rows' ranges are more lopsided "
        f"(mean |max + min| / (max - min) over rows: K {kv.skew['K']:.2f}, V {kv.skew['V']:.2f}; 0 is a range "
        "symmetric about zero), and a symmetric grid leaves the unused side's codes idle.",
    ]
    if clearly:
        verdict = ("That is clearly lower (a third or more less error on both K and V): the asymmetric layout would "
                   "be worth its 2 bytes and zero point, and Pagoda's symmetric choice should be revisited.")
    elif int8_kv_rise is not None and int8_kv_rise > GOAL_KV_INT8_PPL:
        verdict = (f"Not clearly lower, but the symmetric cache misses the +1% perplexity goal here "
                   f"({100 * (int8_kv_rise - 1):+.2f}% on the float weights): asymmetric rows are the first thing to try.")
    else:
        rise = "" if int8_kv_rise is None else (
            f", and end to end the symmetric cache changes the float weights' perplexity by "
            f"{100 * (int8_kv_rise - 1):+.2f}% (table above; the goal: at most +1%)")
        verdict = (f"Lower, but not clearly: at most {max(bits(less_k), bits(less_v)):.2f} bit of precision{rise}; "
                   f"so Pagoda keeps the symmetric rows, the smaller ({d + 2} vs {d + 4} bytes) and simpler to read.")
    lines[-1] += " " + verdict
    lines += [
        "",
        f"FP8 E4M3 (`--kv-cache-dtype fp8`, CUDA and the torch backend; same row size) keeps a 3-bit mantissa: "
        f"K {pct(fp8_k.rel_rms)}, V {pct(fp8_v.rel_rms)}, {fp8_k.rel_rms / sym_k.rel_rms:.1f}x and "
        f"{fp8_v.rel_rms / sym_v.rel_rms:.1f}x INT8's error: it is for hardware that reads E4M3 natively. One INT8 "
        f"scale per tensor, the strawman (here even each layer's exact absmax over the captured tokens, which a "
        f"static scale would have to guess ahead), gives K {pct(ten_k.rel_rms)} and V {pct(ten_v.rel_rms)}, and "
        f"the rows far below their tensor's absmax lose up to "
        f"{pct(max(ten_k.max_err_of_absmax, ten_v.max_err_of_absmax))} of their own range (per-row scales: "
        f"{pct(max(sym_k.max_err_of_absmax, sym_v.max_err_of_absmax))}).",
    ]
    return lines


def render_greedy(greedy: list[Greedy], args: argparse.Namespace) -> list[str]:
    keys = list(greedy[0].tokens)
    quantized = [k for k in keys if k in ("int8", "fp8")]
    ref32 = next((k for k in keys if k.startswith("float32")), None)
    n = args.greedy_tokens
    head = "| # | prompt | prompt tokens |"
    rule = "|---:|---|---:|"
    for k in quantized:
        head += f" {k} KV: leading tokens equal | {k} KV: positions equal |"
        rule += "---:|---:|"
    if ref32:
        head += f" auto KV vs float32 auto: leading tokens equal |"
        rule += "---:|"
    lines = [
        "",
        "## Greedy tokens with a quantized KV cache",
        "",
        f"The prompts tests/engine/test_generate_hf.py compares with Hugging Face `generate`; {n} greedy tokens each "
        f"(`ignore_eos`), batched, float weights in {args.dtype} (in process, `engine.llm.LLM`): the `auto` KV cache "
        f"against each quantized one. Leading tokens equal: how many tokens agree before the first difference; "
        f"positions equal: at how many of the {n} positions the tokens are the same."
        + (f" For scale, the last column compares the `auto` cache in {args.dtype} with float32 (the dtype the test "
           "matches Hugging Face in): the compute dtype alone moves greedy tokens too." if ref32 else ""),
        "",
        head,
        rule,
    ]
    totals = {k: [0, 0] for k in quantized}
    total32 = 0
    for i, g in enumerate(greedy):
        desc = g.prompt.replace("|", "\\|").replace("`", "'")
        row = f"| {i} | `{desc}` | {g.prompt_tokens} |"
        for k in quantized:
            lead = leading_agreement(g.tokens["auto"], g.tokens[k])
            same = sum(a == b for a, b in zip(g.tokens["auto"], g.tokens[k]))
            totals[k][0] += lead
            totals[k][1] += same
            row += f" {lead} | {same} |"
        if ref32:
            lead32 = leading_agreement(g.tokens[ref32], g.tokens["auto"])
            total32 += lead32
            row += f" {lead32} |"
        lines.append(row)
    row = f"| | all {len(greedy)} | |"
    for k in quantized:
        row += f" {totals[k][0]} / {n * len(greedy)} | {totals[k][1]} / {n * len(greedy)} |"
    if ref32:
        row += f" {total32} / {n * len(greedy)} |"
    lines.append(row)
    for k in quantized:
        full = sum(leading_agreement(g.tokens["auto"], g.tokens[k]) == n for g in greedy)
        lines += ["", f"With the {k} KV cache, {full} of {len(greedy)} prompts give the same {n} tokens as the `auto` cache."]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.quant_report", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="float Hugging Face folder (default: the bundled model)")
    p.add_argument("--work-dir", default="/tmp/pagoda-quant-report", help="where the quantized folders go")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the servers' compute dtype (pagoda serve --dtype)")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "int8"], choices=list(KV_CACHE_DTYPES),
                   help="every weight variant is served once per KV cache dtype (pagoda serve --kv-cache-dtype)")
    p.add_argument("--group-size", type=int, default=128)
    # 32 x 256 tokens keep AWQ's grid search (the slowest step) to minutes on a 2-core CPU.
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=256)
    p.add_argument("--ppl-sequences", type=int, default=16)
    p.add_argument("--ppl-seq-len", type=int, default=512)
    p.add_argument("--kv-sequences", type=int, default=4,
                   help="held-out sequences (of --ppl-seq-len tokens) whose K and V the KV error figures quantize")
    p.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens a prompt for the agreement table")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-decode", action="store_true",
                   help="skip the decode timings (and their columns): on a busy machine they measure the machine")
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
    quantized_kv = [kv for kv in args.kv_cache_dtypes if kv != "auto"]
    kv_report = greedy = None
    if quantized_kv:  # in process, before any server: the machine to itself
        print(f"[quant_report] KV cache error: K/V of {args.kv_sequences} held-out sequences", file=sys.stderr, flush=True)
        kv_seqs = calibration_token_ids(tokenizer, args.kv_sequences, args.ppl_seq_len, split="heldout").tolist()
        keys, values = capture_kv(model_dir, args.dtype, kv_seqs)
        kv_report = kv_errors(keys, values)
        del keys, values
        gc.collect()
        for e in kv_report.errors:
            print(f"[quant_report]   {e.scheme} {e.tensor}: rel RMS {100 * e.rel_rms:.3f}%, row max err "
                  f"{100 * e.max_err_of_absmax:.2f}% of absmax", file=sys.stderr, flush=True)
        print(f"[quant_report] greedy agreement: {args.greedy_tokens} tokens", file=sys.stderr, flush=True)
        greedy = greedy_agreement(model_dir, args.dtype, ["auto", *quantized_kv], args.greedy_tokens)
    work = Path(args.work_dir)
    results = []
    for variant in args.variants:
        folder, seconds = model_dir, None
        if VARIANTS[variant] is not None:
            folder = work / variant
            if not (args.reuse and (folder / "config.json").is_file()):
                seconds = quantize(variant, model_dir, folder, args)
        config = json.loads((folder / "config.json").read_text()).get("quantization_config")
        for kv in args.kv_cache_dtypes:
            ppl, count, tok_s, other = measure(variant, kv, folder, sequences, args, work / "logs")
            results.append(Result(variant, kv, args.dtype, str(folder), config, folder_size(folder), seconds, ppl,
                                  count, tok_s, other))
            speed = "" if tok_s is None else f", {tok_s:.1f} tok/s"
            print(f"[quant_report] {variant} (KV {kv}): ppl {ppl:.3f} over {count} tokens{speed}, "
                  f"{folder_size(folder) / 1e6:.1f} MB", file=sys.stderr, flush=True)
    env = "".join(f"{k}={v} " for k, v in sorted(os.environ.items()) if k.startswith("PAGODA_"))  # the servers inherit them
    command = env + "python -m loadtest.quant_report " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).write_text(render(results, args, command.strip(), kv_report, greedy))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "results": [asdict(r) for r in results],
            "kv_cache_errors": asdict(kv_report) if kv_report else None,
            "greedy": [asdict(g) for g in greedy or []],
        }, indent=2) + "\n")
    print(f"[quant_report] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
