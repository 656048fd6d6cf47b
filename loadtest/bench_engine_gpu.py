"""Engine benchmark (GPU): a random-weight Llama-3-8B against the device's limits and HF `generate`.

    python -m loadtest.bench_engine_gpu --json out.json   # ~2-3 min on an H200

The model has Llama-3-8B's shape (32 layers, hidden 4096, 32 heads on 8 KV heads of 128,
intermediate 14336, vocab 128256) and random weights made on the GPU (`--load-format
dummy`: no checkpoint, no download); prompts are random token ids. Measured in one run:

- limits: copy bandwidth (`dst.copy_(src)`, read + written bytes) and the bf16 matmul
  rate (8192^3 `torch.mm`), both with `triton.testing.do_bench`;
- batch-1 decode (1024-token prompt, 128 new tokens; median step) in bf16, INT8 and INT4
  (`--quantization`, round-to-nearest at load time), each as a fraction of its bandwidth
  bound: (bytes of every weight a step reads + the K/V it reads) / copy bandwidth;
- output tokens/s at batch 64 and 256, 1024-token prompts, 128 new tokens each: over the
  whole run (prefill included) and over its pure decode steps;
- prefill of one 2048-token prompt (median of 5) as a fraction of the matmul rate,
  FLOPs = 2 x (decoder matmul weights) x tokens + the LM head's one row + causal attention;
- the batch-64 workload through Hugging Face `generate` (transformers' LlamaForCausalLM of
  the same config, our weights copied in, one static batch, SDPA attention) and the ratio.

Sections run in order of value: bf16 batch-1, batch 64 and its HF comparison, INT4 and
INT8 batch-1, then prefill and batch 256 (`--quick` leaves those two out). Every section
fails soft: its error goes into the table and the JSON, the others still run; a
`--time-budget` skips what would not finish. The JSON is rewritten after every
section. Needs no server package (fastapi/uvicorn/pydantic). Without CUDA it says so and
exits 0. Goals (issue 9) are informational: exit 0.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

LLAMA3_8B = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
CONTEXT = 1024
NEW_TOKENS = 128
PREFILL_TOKENS = 2048
PREFILL_REPEATS = 5
BATCHES = (64, 256)
HF_BATCH = 64
ENGINE_ARGS = dict(
    load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192,
)
# The bf16 engine profiles its KV cache within half the device, leaving the other half for
# the Hugging Face copy of the weights and its cache; batch 256 x 1152 tokens needs 36 GiB.
BF16_UTILIZATION = 0.5
QUANT_KV_GIB = 4.0
GOAL_B1_BANDWIDTH = 0.80
GOAL_INT4_SPEEDUP = 2.5
GOAL_VS_HF = 10.0
GOAL_PREFILL = 0.55
# Seconds a section needs at least (skipped below that): the estimate on an H200, padded.
SECTION_SECONDS = {"engine_bf16": 60, "hf": 40, "int8": 45, "int4": 45, "bf16_prefill": 20, "bf16_batch256": 30,
                   "profile": 15}
# Prefill and batch 256 run before the HF comparison and INT4/INT8 (they need the bf16
# engine) but only with the time those later, more valued sections need still left over.
LATER_SECONDS = SECTION_SECONDS["hf"] + SECTION_SECONDS["int4"] + SECTION_SECONDS["int8"]


def log(msg: str) -> None:
    print(f"[bench_engine_gpu] {msg}", file=sys.stderr, flush=True)


# ---- limits -------------------------------------------------------------------------------------


def measure_matmul_tflops(do_bench, device: torch.device, n: int = 8192) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    out = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    ms = do_bench(lambda: torch.mm(a, b, out=out), warmup=25, rep=200, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


# ---- the model's arithmetic ------------------------------------------------------------------------


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and buffer once, except the
    embedding table and the RoPE tables, of which a step reads one row (the LM head is
    counted even when tied to the embedding: it reads all of it). A linear whose kernel reads
    a packed copy (the C++ bf16 kernel's `kernel_weight` or oneDNN's `packed`, engine/models/
    llama.py `prepack_linears`) counts that copy instead of its weight parameter, which a
    tied head keeps only for the embedding lookup."""
    from engine.models.llama import Linear

    storages: dict[int, int] = {}
    packed_weights: set[str] = set()
    for name, module in model.named_modules(remove_duplicate=False):
        copy = getattr(module, "kernel_weight", None) if isinstance(module, Linear) else None
        copy = copy if copy is not None else (getattr(module, "packed", None) if isinstance(module, Linear) else None)
        if copy is not None:
            storages[copy.untyped_storage().data_ptr()] = copy.untyped_storage().nbytes()
            packed_weights.add(f"{name}.weight" if name else "weight")
    named = (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
    for name, t in named:
        if name.startswith(("model.embed_tokens.", "rope.")) or name in packed_weights:
            continue
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def prefill_flops(args, num_tokens: int) -> float:
    """2 FLOPs per weight per token in the decoder's matmuls, the LM head for the last token
    only, and causal attention: QK^T and PV, 2 x head_dim FLOPs each per (query, key) pair."""
    q, kv, h = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim, args.hidden_size
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * args.intermediate_size
    pairs = num_tokens * (num_tokens + 1) / 2
    attention = 4 * args.head_dim * args.num_attention_heads * pairs
    return args.num_hidden_layers * (2 * per_layer * num_tokens + attention) + 2 * h * args.vocab_size


# ---- runs ---------------------------------------------------------------------------------------


@dataclass
class BatchRun:
    batch: int
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    generated: int
    decode_s: float
    decode_tokens: int
    decode_step_ms: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else float("nan")


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_batch(core, prompts: list[list[int]], new_tokens: int, tag: str) -> BatchRun:
    """All prompts at once through EngineCore.step(); a step is a pure decode step when it
    scheduled exactly one token per output it returned. `step()` ends with the sampler's
    transfer to the host, so its wall time is the device time plus the engine's own."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{i}", prompt, params)
    decode_s, decode_tokens, decode_steps = 0.0, 0, []
    generated = 0
    synchronize(core.device)
    t0 = time.perf_counter()
    while core.has_unfinished_requests():
        scheduled_before = core.stats.num_scheduled_tokens
        ts = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - ts
        generated += len(outputs)
        if outputs and core.stats.num_scheduled_tokens - scheduled_before == len(outputs):
            decode_s += dt
            decode_tokens += len(outputs)
            decode_steps.append(dt * 1e3)
    wall = time.perf_counter() - t0
    return BatchRun(len(prompts), len(prompts[0]), new_tokens, wall, generated, decode_s, decode_tokens, decode_steps)


def build_engine(model_path: Path, **engine_args):
    from engine.config import EngineConfig
    from engine.engine_core import EngineCore

    t0 = time.perf_counter()
    core = EngineCore(EngineConfig.from_engine_args(model=str(model_path), **{**ENGINE_ARGS, **engine_args}))
    log(f"engine {engine_args} built in {time.perf_counter() - t0:.1f} s")
    return core


def release_memory() -> None:
    """Give the memory of whatever was dropped (an engine, its graphs' pool) back to the device."""
    gc.collect()
    torch.cuda.empty_cache()


def batch1_decode(core, copy_gbps: float, seed: int) -> dict:
    vocab = core.model.args.vocab_size
    run_batch(core, random_prompts(1, 64, vocab, seed), 8, f"warm-{seed}")
    run = run_batch(core, random_prompts(1, CONTEXT, vocab, seed + 1), NEW_TOKENS, f"b1-{seed}")
    step_s = statistics.median(run.decode_step_ms) / 1e3
    weights = decode_weight_bytes(core.model)
    # A decode step reads the K/V of every token so far: 1024 .. 1024 + 127, on average this.
    kv = (CONTEXT + NEW_TOKENS / 2) * core.kv_spec.bytes_per_token
    bound_s = (weights + kv) / (copy_gbps * 1e9)
    return {
        "step_ms": step_s * 1e3, "weight_bytes": weights, "kv_bytes": kv, "bound_ms": bound_s * 1e3,
        "fraction_of_bound": bound_s / step_s, "decode_steps": len(run.decode_step_ms),
    }


PROFILE_STEPS = 8
PROFILE_TOP = 8


def profile_decode(core, seed: int) -> dict:
    """Where a batch-1 decode step's device time goes: `PROFILE_STEPS` steps of a
    `CONTEXT`-token sequence under torch.profiler (CUDA activity; kernels inside a CUDA
    graph's replay are recorded too), the `PROFILE_TOP` kernels by total time, in
    microseconds per step, and the sum of all kernels per step."""
    from torch.profiler import ProfilerActivity, profile

    from engine import SamplingParams

    vocab = core.model.args.vocab_size
    params = SamplingParams(temperature=0, max_tokens=PROFILE_STEPS + 4, ignore_eos=True)
    core.add_request(f"profile-{seed}", random_prompts(1, CONTEXT, vocab, seed)[0], params)
    core.step()  # the prefill
    core.step()  # one decode step before the recorded ones
    synchronize(core.device)
    cuda = core.device.type == "cuda"  # (on the CPU: the CPU ops, for a smoke test of this function)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILE_STEPS):
            core.step()
        synchronize(core.device)
    while core.has_unfinished_requests():
        core.step()
    totals: dict[str, float] = {}
    for event in prof.events():
        if not cuda:
            totals[event.name] = totals.get(event.name, 0.0) + event.self_cpu_time_total
        elif event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:PROFILE_TOP]
    return {
        "kernel_us_per_step": sum(totals.values()) / PROFILE_STEPS,
        "top": [(name[:90], us / PROFILE_STEPS) for name, us in top],
    }


def prefill(core, matmul_tflops: float) -> dict:
    vocab = core.model.args.vocab_size
    times = []
    for i in range(PREFILL_REPEATS + 1):  # the first is a warm-up
        prompt = random_prompts(1, PREFILL_TOKENS, vocab, 1000 + i)[0]
        core.add_request(f"prefill-{i}", prompt, _one_token())
        synchronize(core.device)
        t0 = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    flops = prefill_flops(core.model.args, PREFILL_TOKENS)
    tflops = flops / step_s / 1e12
    return {"step_ms": step_s * 1e3, "flops": flops, "tflops": tflops, "fraction_of_matmul": tflops / matmul_tflops}


def _one_token():
    from engine import SamplingParams

    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


# ---- Hugging Face -------------------------------------------------------------------------------


def build_hf_copy(model, hf_config):
    """transformers' LlamaForCausalLM of `hf_config` on `model`'s device and dtype, holding
    `model`'s weights (`engine.loader._target` maps each checkpoint name onto our fused
    parameters)."""
    from transformers import LlamaForCausalLM

    from engine.loader import _target

    weight = model.model.embed_tokens.weight
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(weight.dtype)
    try:
        with torch.device(weight.device):
            hf = LlamaForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in hf.state_dict().items():
            if name == "lm_head.weight" and hf_config.tie_word_embeddings:
                continue  # the embedding table, copied under its own name
            _, source = _target(model, params, name)
            tensor.copy_(source)
    return hf


def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Wall seconds of one static-batch greedy `generate` (exactly `new_tokens` each) and its tokens."""
    ids = torch.tensor(prompts, device=hf.device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, pad_token_id=hf.config.pad_token_id,
    )
    synchronize(hf.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, **kwargs)
    synchronize(hf.device)
    wall = time.perf_counter() - t0
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"HF generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return wall, out[:, ids.shape[1]:].tolist()


def hf_section(hf, prompts: list[list[int]]) -> dict:
    hf_generate(hf, [p[:32] for p in prompts[:2]], 4)  # warm-up
    full, _ = hf_generate(hf, prompts, NEW_TOKENS)
    one, _ = hf_generate(hf, prompts, 1)
    decode = len(prompts) * (NEW_TOKENS - 1) / (full - one)
    return {"wall_s": full, "prefill_only_s": one, "tokens_per_s": len(prompts) * NEW_TOKENS / full,
            "decode_tokens_per_s": decode}


# ---- the run ------------------------------------------------------------------------------------


class Sections:
    """Runs each section fail-soft within the time budget; results and errors into `raw`."""

    def __init__(self, raw: dict, json_path: Path | None, budget_s: float) -> None:
        self.raw, self.json_path = raw, json_path
        self.deadline = time.monotonic() + budget_s
        raw.setdefault("errors", {})

    def run(self, name: str, fn: Callable[[], dict], needs_s: float = 0.0) -> dict | None:
        left = self.deadline - time.monotonic()
        if left < needs_s:
            self.raw["errors"][name] = f"skipped: {left:.0f} s of the time budget left, needs ~{needs_s:.0f} s"
            log(self.raw["errors"][name])
            return None
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - a failed section is reported, the others still run
            self.raw["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"{name} failed:\n{traceback.format_exc()}")
            result = None
        else:
            self.raw[name] = result
            log(f"{name} ({time.perf_counter() - t0:.1f} s): {result}")
        self.save()
        return result

    def save(self) -> None:
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self.raw, indent=2, default=str))


def engine_bf16(model_path: Path, limits: dict, sections: Sections, hf: dict, quick: bool = False,
                profile: bool = False) -> dict:
    """The bf16 engine's sections (batch 1, its kernel profile when `profile`, and batch 64
    first; prefill and batch 256 unless `quick`). Before the engine goes, its weights are copied into the HF model, which `hf`
    receives with the batch-64 prompts."""
    from transformers import LlamaConfig

    core = build_engine(model_path, gpu_memory_utilization=BF16_UTILIZATION)
    sections.run("bf16_batch1", lambda: batch1_decode(core, limits["copy_gbps"], seed=1))
    if profile:
        sections.run("bf16_profile", lambda: profile_decode(core, seed=7), SECTION_SECONDS["profile"])
    for i, batch in enumerate(BATCHES):
        if batch != HF_BATCH and quick:
            continue
        if batch != HF_BATCH:
            sections.run("bf16_prefill", lambda: prefill(core, limits["matmul_tflops"]),
                         SECTION_SECONDS["bf16_prefill"] + LATER_SECONDS)
        prompts = random_prompts(batch, CONTEXT, LLAMA3_8B["vocab_size"], seed=100 + i)
        needs = 0 if batch == HF_BATCH else SECTION_SECONDS.get(f"bf16_batch{batch}", 30) + LATER_SECONDS
        sections.run(f"bf16_batch{batch}", lambda: _summary(run_batch(core, prompts, NEW_TOKENS, f"b{batch}")), needs)
        if batch == HF_BATCH:
            hf["prompts"] = prompts

    def build() -> dict:
        t0 = time.perf_counter()
        hf["model"] = build_hf_copy(core.model, LlamaConfig(**LLAMA3_8B))
        return {"seconds": time.perf_counter() - t0}

    sections.run("hf_build", build, SECTION_SECONDS["hf"])
    return {"num_blocks": core.num_blocks, "cuda_graphs": core.runner.decode_graphs is not None}


def _summary(run: BatchRun) -> dict:
    d = asdict(run)
    d.pop("decode_step_ms")
    d["median_decode_step_ms"] = statistics.median(run.decode_step_ms) if run.decode_step_ms else None
    d["tokens_per_s"], d["decode_tokens_per_s"] = run.tokens_per_s, run.decode_tokens_per_s
    return d


def quantized(model_path: Path, method: str, limits: dict, profile: bool = False) -> dict:
    """Batch-1 decode with `--quantization method` (and its kernel profile when `profile`);
    eager (and the capture error recorded) when its decode step cannot be captured."""
    args = dict(quantization=method, kv_cache_memory=QUANT_KV_GIB, max_num_seqs=8, max_cuda_graph_batch_size=1)
    capture_error = None
    try:
        core = build_engine(model_path, **args)
    except Exception as e:  # noqa: BLE001 - measured eagerly instead, the error reported
        capture_error = f"{type(e).__name__}: {e}"
        log(f"{method} with CUDA graphs failed, retrying eagerly:\n{traceback.format_exc()}")
        release_memory()
        core = build_engine(model_path, enforce_eager=True, **args)
    result = batch1_decode(core, limits["copy_gbps"], seed=2)
    if profile:
        result["profile"] = profile_decode(core, seed=8)
    return {**result, "cuda_graphs": core.runner.decode_graphs is not None, "graph_error": capture_error}


def report(raw: dict, device_name: str) -> str:
    from loadtest.bench_offline import Report, _check

    rep = Report()
    errors = raw["errors"]
    limits = raw.get("limits") or {}

    def missing(what: str, *names: str) -> None:
        why = "; ".join(f"{n}: {errors[n]}" for n in names if n in errors) or "not run"
        rep.add(f"{what} ({why})", None, "")

    rep.add("copy bandwidth (read + written)", limits.get("copy_gbps"), "GB/s")
    rep.add("bf16 matmul 8192^3", limits.get("matmul_tflops"), "TFLOP/s")
    bf16_ms = (raw.get("bf16_batch1") or {}).get("step_ms")
    for method in ("bf16", "int8", "int4"):
        r = raw.get(f"{method}_batch1")
        if r is None:
            missing(f"batch-1 decode {method}", f"{method}_batch1", "engine_bf16")
            continue
        speedup = bf16_ms / r["step_ms"] if bf16_ms and method != "bf16" else None
        goal = status = ""
        if method == "bf16":
            goal, status = f">= {GOAL_B1_BANDWIDTH:.0%}", _check(r["fraction_of_bound"], GOAL_B1_BANDWIDTH)
        elif method == "int4":
            goal, status = f">= {GOAL_INT4_SPEEDUP}x bf16", _check(speedup, GOAL_INT4_SPEEDUP)
        graphs = "" if r.get("cuda_graphs", True) else ", eager"
        rep.add(
            f"batch-1 decode {method}{graphs} (bound {r['bound_ms']:.2f} ms: {r['weight_bytes'] / 1e9:.2f} GB "
            f"weights + {r['kv_bytes'] / 1e6:.0f} MB KV)",
            r["step_ms"], "ms/token",
            f"{r['fraction_of_bound']:.0%} of bound" + (f", {speedup:.2f}x bf16" if speedup else ""), goal, status,
        )
    for batch in BATCHES:
        r = raw.get(f"bf16_batch{batch}")
        if r is None:
            missing(f"batch {batch} x {CONTEXT}-token prompts", f"bf16_batch{batch}", "engine_bf16")
            continue
        rep.add(f"pagoda batch {batch}, {CONTEXT}-token prompts, {NEW_TOKENS} new: whole run", r["tokens_per_s"],
                "tok/s")
        rep.add(f"pagoda batch {batch}: decode steps only (median step {r['median_decode_step_ms']:.1f} ms)",
                r["decode_tokens_per_s"], "tok/s")
    hf, pagoda = raw.get("hf"), raw.get(f"bf16_batch{HF_BATCH}")
    if hf is None:
        missing(f"HF generate static batch {HF_BATCH}", "hf", "hf_build")
    else:
        rep.add(f"HF generate static batch {HF_BATCH}: whole run", hf["tokens_per_s"], "tok/s")
        rep.add(f"HF generate static batch {HF_BATCH}: decode only (from a 1-token run)", hf["decode_tokens_per_s"],
                "tok/s")
        if pagoda is not None:
            whole = pagoda["tokens_per_s"] / hf["tokens_per_s"]
            decode = pagoda["decode_tokens_per_s"] / hf["decode_tokens_per_s"]
            rep.add(f"pagoda / HF at batch {HF_BATCH}: whole run", whole, "x", goal=f">= {GOAL_VS_HF:g}x",
                    status=_check(whole, GOAL_VS_HF))
            rep.add(f"pagoda / HF at batch {HF_BATCH}: decode only", decode, "x", goal=f">= {GOAL_VS_HF:g}x",
                    status=_check(decode, GOAL_VS_HF))
    p = raw.get("bf16_prefill")
    if p is None:
        missing(f"prefill {PREFILL_TOKENS} tokens", "bf16_prefill", "engine_bf16")
    else:
        rep.add(f"prefill {PREFILL_TOKENS} tokens ({p['tflops']:.0f} TFLOP/s)", p["step_ms"], "ms",
                f"{p['fraction_of_matmul']:.0%} of matmul rate", f">= {GOAL_PREFILL:.0%}",
                _check(p["fraction_of_matmul"], GOAL_PREFILL))
    engine = raw.get("engine_bf16") or {}
    graphs = {True: "on", False: "off"}.get(engine.get("cuda_graphs"), "n/a")
    profiles = ""
    for method, prof in (("bf16", raw.get("bf16_profile")), ("int4", (raw.get("int4_batch1") or {}).get("profile")),
                         ("int8", (raw.get("int8_batch1") or {}).get("profile"))):
        if prof:
            profiles += f"\nbatch-1 decode {method}: kernels {prof['kernel_us_per_step']:.0f} us per step; top:\n"
            profiles += "".join(f"  {us:8.1f} us  {name}\n" for name, us in prof["top"])
    return (
        f"{device_name}; Llama-3-8B shape, random weights, bf16 engine with CUDA graphs {graphs}, "
        f"{engine.get('num_blocks', 'n/a')} KV blocks\n\n{rep.markdown()}{profiles}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the raw numbers here (after every section)")
    parser.add_argument("--time-budget", type=float, default=420.0,
                        help="seconds; sections that would not fit are skipped")
    parser.add_argument("--quick", action="store_true", help="leave out prefill and batch 256")
    parser.add_argument("--profile", action="store_true",
                        help="also profile the batch-1 decode steps (bf16, INT4, INT8): top kernels per step")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_engine_gpu: CUDA is required (a Llama-3-8B-shaped model on the GPU); nothing to do.")
        return 0

    import triton
    from transformers import LlamaConfig
    from triton.testing import do_bench

    from engine.dummy_model import write_dummy_model_folder
    from loadtest.bench_kernels import measure_copy_bandwidth

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    raw: dict = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "config": LLAMA3_8B}
    sections = Sections(raw, args.json, args.time_budget)
    log(f"{name}, torch {torch.__version__}, triton {triton.__version__}")
    limits = sections.run("limits", lambda: {
        "copy_gbps": measure_copy_bandwidth(do_bench, device), "matmul_tflops": measure_matmul_tflops(do_bench, device),
    })
    release_memory()
    if limits is None:
        print(report(raw, name))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_path = write_dummy_model_folder(Path(tmp) / "llama3-8b-shape", LlamaConfig(**LLAMA3_8B))
        hf: dict = {}
        sections.run("engine_bf16", lambda: engine_bf16(model_path, limits, sections, hf, args.quick, args.profile),
                     SECTION_SECONDS["engine_bf16"])
        release_memory()  # the bf16 engine is gone: the HF model runs alone
        if "model" in hf and "prompts" in hf:
            sections.run("hf", lambda: hf_section(hf["model"], hf["prompts"]), SECTION_SECONDS["hf"])
        hf.clear()
        release_memory()
        for method in ("int4", "int8"):  # INT4's goal first
            sections.run(f"{method}_batch1", lambda m=method: quantized(model_path, m, limits, args.profile), SECTION_SECONDS[method])
            release_memory()
    sections.save()
    print("\n" + report(raw, name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
