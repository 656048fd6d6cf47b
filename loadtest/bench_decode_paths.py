"""The decode step on CPU: the fused decode call against the model's per-op forward,
alternating in one process, against the read-bandwidth bound measured between rounds
(batch 1), or at `--batch N` rows.

    python -m loadtest.bench_decode_paths                        # bf16 (~2 min on 2 idle cores)
    python -m loadtest.bench_decode_paths --quantization int4    # INT4 weights, INT8 LM head
    python -m loadtest.bench_decode_paths --model .cache/bench-noise/models/llama-1b   # the 1B-class Llama
    python -m loadtest.bench_decode_paths --quantization int8 --int8-gemv
                                           # also the per-op path with torch's int8 kernel
    python -m loadtest.bench_decode_paths --quantization int4 --torch-int4
                                           # also the per-op path with torch's int4 kernel
    python -m loadtest.bench_decode_paths --batch 32             # a 32-row step (32 prompts)
    python -m loadtest.bench_decode_paths --phases               # and where the fused step's time goes
    python -m loadtest.bench_decode_paths --batch 32 --baseline-rev HEAD~1
                                           # also the fused call on HEAD~1's C++ kernels
    python -m loadtest.bench_decode_paths --batch 32 --pages   # also its weights on 4 KB pages

The paths (engine/models/llama.py `FusedDecodeLayers`, kernels/quant_linear.py):
- fused: every decoder layer of the step in one C++ call (the engine's route), with the
  greedy LM head (kernels/greedy_head.py: the head's int8 copy first, its bf16 rows only
  where the argmax can be) where the model has it;
- fused, whole head: the same without the greedy head (`PAGODA_CPU_GREEDY_HEAD=0`): every
  step reads the whole bf16 head;
- fused, 16-bit weights: the same without the bf16 linears' lossless 12-bit copies
  (`PAGODA_CPU_12BIT_WEIGHTS=0`), which steps of 1-2 rows read otherwise;
- fused, REV's kernels (`--baseline-rev REV`): the same call on the C++ kernels of git
  revision REV, built beside this tree's (`bench_linear.revision_kernels`): a kernel change
  timed against what it replaced, in one process, the paths alternating. REV's kernels must
  take this tree's call and packed layouts (2d8a700, the held `DecodeModel`, or later);
- fused, weights on 4 KB pages (`--pages`): the same call on copies of the packed weights,
  12-bit copies and the greedy head's copy in ordinary memory, where the engine put them on
  2 MB transparent huge pages (engine/huge_pages.py; the KV cache stays where it is);
- per-op: the model's Python forward, one kernel call per op (`PAGODA_CPU_FUSED_DECODE=0`);
- per-op, torch int8 (`--int8-gemv`): also W8A16 through torch's `_weight_int8pack_mm`
  instead of Pagoda's int8 kernel (each `Int8Linear`'s packed copy set aside);
- per-op, torch int4 (`--torch-int4`): a second engine whose INT4 linears are in torch's CPU
  layout (`_weight_int4pack_mm_for_cpu`, on OpenMP's team: what served INT4 before Pagoda's
  int4 kernel), run per op (the fused call takes Pagoda's kernels only).

The process runs under `OMP_WAIT_POLICY=passive`, as `pagoda` does (loadtest/__init__.py), unless
the variable is set (`OMP_WAIT_POLICY=active` gives torch's int4 kernel its spinning team).

This VM's memory bandwidth drifts by up to 2x over minutes, so the paths take turns, round
after round (every other round in reverse order), and the read bandwidth (`bench_offline.measure_read_bandwidth_gbs`) is measured
at the start of each round. A path's decode step = (T(65 tokens) - T(1 token)) / 64 of one
greedy prompt, or of `--batch` different ones at once (prefill and per-call costs cancel);
its median over the rounds is reported with the median bound: bytes of weights a step reads
(`decode_weight_bytes`; with the greedy head its int8 copy in place of the bf16 head: the
few 32-token groups it computes exactly are left out) / bandwidth. The bound is a batch-1 figure: a step of many rows is
bound by its arithmetic instead (`loadtest.bench_offline` measures that bound), so with
`--batch` over 1 the table has no bound column.

`--phases`: after the rounds, the fused step's time by phase (the C++ call's own clock,
csrc/cpu_kernels.cpp `PhaseClock`: the norms, each linear, rotary and the cache write,
attention, the SiLU, the head, and the engine's Python around the call), each phase's time
per step over `--rounds` measurements (median), and for the linears and the head the GB/s
their weight bytes streamed at (the bandwidth is the median measured between the rounds)
and their GFLOP/s as a fraction of the bf16 multiply-add peak measured beside them (every
kernel thread issuing vdpbf16ps on registers: what a many-row step's linears cannot pass).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from engine.huge_pages import huge_pages_wanted, pages_fact
from loadtest.bench_engine_gpu import decode_weight_bytes
from loadtest.bench_offline import measure_read_bandwidth_gbs

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _on_small_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` over a clone of its whole storage in torch's own (4 KB-page) memory."""
    storage = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.shape, t.stride())


def step_seconds(llm, sampling_params, batch: int = 1) -> float:
    """One decode step: (T(65) - T(1)) / 64 for the same greedy prompt, or for `batch`
    different prompts at once (a step of `batch` rows)."""
    one, full = sampling_params(max_tokens=1), sampling_params(max_tokens=65)
    prompts = [PROMPT] if batch == 1 else [f"{i}. {PROMPT}" for i in range(batch)]
    t0 = time.perf_counter()
    llm.generate(prompts, one)
    t1 = time.perf_counter()
    llm.generate(prompts, full)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / 64


# The fused call's phases in the order a step runs them (csrc/cpu_kernels.cpp `DecodePhase`).
PHASE_ORDER = ["setup", "norms", "qkv", "rope_cache", "attention", "o_proj", "gate_up", "silu", "down", "mlp", "head",
               "outside the call"]


def phase_seconds(llm, sampling_params, batch: int = 1) -> dict[str, float]:
    """The fused decode step's seconds by phase (`decode_phase_times_start` / `_stop`): each
    phase's (total over T(65) - total over T(1)) / 64, as `step_seconds` takes the step, of
    the phases the decode steps ran, and "outside the call" = the step less the call's
    phases (the engine's Python)."""
    from kernels import cpu_kernels

    module = cpu_kernels.load()
    one, full = sampling_params(max_tokens=1), sampling_params(max_tokens=65)
    prompts = [PROMPT] if batch == 1 else [f"{i}. {PROMPT}" for i in range(batch)]
    llm.generate(prompts, one)  # the prompts cached: both runs below prefill the same
    totals = []
    for params in (one, full):
        module.decode_phase_times_start()
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        _, phases = module.decode_phase_times_stop()
        totals.append((wall, phases))
    (w1, p1), (w65, p65) = totals
    per_step = {name: (p65[name][0] - p1[name][0]) / 64 for name in p65 if p65[name][1] > p1[name][1]}
    per_step["outside the call"] = ((w65 - w1) / 64) - sum(per_step.values())
    return per_step


def linear_work(fused, batch: int) -> tuple[dict[str, int], dict[str, int]]:
    """(weight bytes, multiply-adds a row) of a fused step of `batch` rows in each linear
    phase (all layers) and in the head."""
    names = ["qkv", "o_proj", "gate_up", "down"]
    read, macs = dict.fromkeys(names, 0), dict.fromkeys(names, 0)
    for index, (weight, kind) in enumerate(zip(fused.linear_weights, fused.kinds, strict=True)):
        copy = fused.c12[3 * index:3 * index + 3] if fused.c12 is not None and batch <= 2 else []
        tensors = copy if copy and copy[0].numel() > 0 else [weight]
        read[names[index % 4]] += sum(t.untyped_storage().nbytes() for t in tensors)
        # [N, K] as packed (an int4 weight: [N, K / 2] bytes; csrc DecodeLinear)
        macs[names[index % 4]] += weight.shape[0] * weight.shape[1] * (2 if kind > 0 else 1)
    for table in (read, macs):
        table["mlp"] = table["gate_up"] + table["down"]  # steps of 3+ rows: both in one kernel (bf16_silu_mlp)
    head = fused.argmax_head if fused.argmax_head is not None and batch <= 4 else [fused.lm_head]
    read["head"] = sum(t.untyped_storage().nbytes() for t in head if t is not None)
    macs["head"] = fused.embedding.numel()  # vocab x hidden (a tied or untied head alike)
    return read, macs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: the bundled model); e.g. "
                        "loadtest.bench_noise's 1B-class Llama, .cache/bench-noise/models/llama-1b")
    parser.add_argument("--dtype", default="bfloat16", help="the model dtype (the fused call takes bf16)")
    parser.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    parser.add_argument("--int8-gemv", action="store_true", help="also the per-op path with torch's int8 kernel")
    parser.add_argument("--torch-int4", action="store_true", help="also the per-op path with torch's int4 kernel "
                        "(with --quantization int4)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=1, help="rows per step: this many prompts at once")
    parser.add_argument("--phases", action="store_true", help="also the fused step's time by phase")
    parser.add_argument("--pages", action="store_true",
                        help="also the fused call with the weights on 4 KB pages (where the engine's are on huge pages)")
    parser.add_argument("--baseline-rev", default=None,
                        help="also the fused call on this git revision's C++ kernels, built beside this tree's")
    args = parser.parse_args()
    if args.batch < 1:
        parser.error("--batch must be at least 1")

    from engine import LLM, SamplingParams
    import engine.quantization.linears as linears
    from engine.quantization.linears import Int8Linear
    from kernels import cpu_kernels

    if args.torch_int4 and args.quantization != "int4":
        parser.error("--torch-int4 compares INT4 kernels: give --quantization int4")
    llm = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
    torch_int4 = None
    if args.torch_int4:  # INT4 linears in torch's layout: `cpu_int4_tensors` without Pagoda's kernel
        kernel_check, linears.gemv_enabled = linears.gemv_enabled, lambda: False
        try:
            torch_int4 = LLM(model=args.model, dtype=args.dtype, quantization=args.quantization)
        finally:
            linears.gemv_enabled = kernel_check
        if not any(isinstance(m, linears.Int4Linear) and not m.kernel and m.cpu_packed
                   for m in torch_int4.engine_core.worker.model.modules()):
            sys.exit("torch's CPU int4 kernel does not run here (its probe failed)")
    model = llm.engine_core.worker.model
    fused = model.fused_decode
    if fused is None:
        sys.exit("the fused decode call does not run for this model here (the start-up log's decode_layers line says why)")
    int8_linears = {m: m.kernel_weight for m in model.modules() if isinstance(m, Int8Linear)}
    greedy_head, c12 = fused.argmax_head, fused.c12
    own_kernels = cpu_kernels.load()
    baseline_path = f"fused, {args.baseline_rev}'s kernels" if args.baseline_rev else None
    baseline_kernels = None
    if args.baseline_rev:
        from loadtest.bench_linear import revision_kernels

        baseline_kernels = revision_kernels(args.baseline_rev)

    pages_path = "fused, weights on 4 KB pages" if args.pages and huge_pages_wanted() else None
    if args.pages and pages_path is None:
        print(f"--pages: the engine's weights are not on huge pages here ({pages_fact()})", file=sys.stderr)
    on_huge = (fused.tensors, fused.embedding, fused.lm_head, greedy_head, c12)
    on_small = None
    if pages_path:  # the same bytes in ordinary memory, each tensor's storage cloned
        small = _on_small_pages
        on_small = ([small(t) for t in fused.tensors], small(fused.embedding),
                    None if fused.lm_head is None else small(fused.lm_head),
                    None if greedy_head is None else [small(t) for t in greedy_head],
                    None if c12 is None else [small(t) for t in c12])

    def use(path: str) -> None:
        # The kernels every call of this path goes through (`cpu_kernels.load()`'s module);
        # where they change, the held model is made anew on them at the path's first step.
        kernels = baseline_kernels if path == baseline_path else own_kernels
        if cpu_kernels._state["module"] is not kernels:
            cpu_kernels._state["module"] = kernels
            fused._held = None
        tensors = on_small if path == pages_path else on_huge
        if fused.tensors is not tensors[0]:  # the weights' pages change: the held model anew too
            fused.tensors, fused.embedding, fused.lm_head = tensors[:3]
            fused._held = None
        model.fused_decode = fused if path.startswith("fused") else None
        fused.argmax_head = None if path == "fused, whole head" else tensors[3]
        fused.c12 = None if path == "fused, 16-bit weights" else tensors[4]
        for linear, packed in int8_linears.items():
            linear.kernel_weight = None if path == "per-op, torch int8" else packed

    paths = (["fused"] + ([baseline_path] if baseline_path else []) + ([pages_path] if pages_path else [])
             + (["fused, whole head"] if greedy_head is not None and args.batch <= 4 else [])
             + (["fused, 16-bit weights"] if c12 is not None and args.batch <= 2 else []) + ["per-op"]
             + (["per-op, torch int8"] if args.int8_gemv else [])
             + (["per-op, torch int4"] if torch_int4 else []))

    def engine(path: str):
        return torch_int4 if path == "per-op, torch int4" else llm

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    for path in paths:  # warm-up
        use(path)
        step_seconds(engine(path), params, args.batch)
    steps: dict[str, list[float]] = {p: [] for p in paths}
    bandwidths = []
    for r in range(args.rounds):
        bandwidths.append(measure_read_bandwidth_gbs())
        for path in (paths if r % 2 == 0 else paths[::-1]):  # each path first in turn: no order favours one
            use(path)
            steps[path].append(step_seconds(engine(path), params, args.batch))
        print(f"round {r + 1}: read {bandwidths[-1]:.1f} GB/s, "
              + ", ".join(f"{p} {steps[p][-1] * 1e3:.2f} ms" for p in paths), file=sys.stderr, flush=True)
    use("fused")
    phases, phase_bandwidths, phase_peaks = [], [], []
    for _ in range(args.rounds if args.phases else 0):  # each with the bandwidth and FLOP peak of its moment
        phase_bandwidths.append(measure_read_bandwidth_gbs())
        phase_peaks.append(cpu_kernels.bf16_dot_peak_gflops())
        phases.append(phase_seconds(llm, params, args.batch))

    weight_bytes = decode_weight_bytes(model)
    path_bytes = {p: weight_bytes for p in paths}
    if greedy_head is not None and args.batch <= 4:  # the int8 copy read in place of the bf16 head (the route's rows)
        head = fused.lm_head.untyped_storage().nbytes()
        for path in {"fused", baseline_path, pages_path, "fused, 16-bit weights"} & set(paths):
            path_bytes[path] = weight_bytes - head + sum(t.untyped_storage().nbytes() for t in greedy_head)
    if c12 is not None and args.batch <= 2:  # the 12-bit copies read in place of those bf16 weights
        for path in {"fused", baseline_path, pages_path, "fused, whole head"} & set(paths):
            path_bytes[path] += fused.c12_bytes - fused.c12_bf16_bytes
    bandwidth = statistics.median(bandwidths)
    bound = weight_bytes / (bandwidth * 1e9)
    what = args.quantization or args.dtype
    rows = "Batch-1 decode step" if args.batch == 1 else f"{args.batch}-row decode step"
    print(f"\n{rows}, {what}, {torch.get_num_threads()} threads "
          f"(OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}), {args.rounds} alternating rounds: "
          f"weights read per step {weight_bytes / 1e6:.0f} MB"
          + (f" ({path_bytes['fused'] / 1e6:.0f} MB on the fused path: "
             + ", ".join(what for what, used in (("greedy head", greedy_head is not None),
                                                 ("12-bit copies", c12 is not None and args.batch <= 2)) if used) + ")"
             if path_bytes["fused"] != weight_bytes else "")
          + f", read bandwidth median {bandwidth:.1f} GB/s "
          f"(range {min(bandwidths):.1f}-{max(bandwidths):.1f})"
          + (f", bound {bound * 1e3:.2f} ms\n" if args.batch == 1 else "\n"))
    bound_column = args.batch == 1  # many rows are bound by their arithmetic, not the weight stream
    print("| path | decode step (median) | range | vs fused |" + (" fraction of the read bound |" if bound_column else ""))
    print("|---|---:|---:|---:|" + ("---:|" if bound_column else ""))
    base = statistics.median(steps["fused"])
    for path in paths:
        med = statistics.median(steps[path])
        print(f"| {path} | {med * 1e3:.2f} ms | {min(steps[path]) * 1e3:.2f}-{max(steps[path]) * 1e3:.2f} ms "
              f"| {med / base:.2f}x |" + (f" {path_bytes[path] / (bandwidth * 1e9) / med:.0%} |" if bound_column else ""))

    if phases:
        streamed, macs = linear_work(fused, args.batch)
        medians = {name: statistics.median(p.get(name, 0.0) for p in phases) for name in phases[0]}
        # The shares are of these measurements' own step (their phases' sum): the VM's memory
        # may have changed pace since the rounds above.
        step = sum(medians.values())
        peak = statistics.median(phase_peaks)
        print(f"\nThe fused step by phase, {step * 1e3:.2f} ms (median of {len(phases)} measurements, per step; "
              f"GB/s: the phase's weight bytes over its time, the head's without the groups it computes "
              f"exactly, read bandwidth {statistics.median(phase_bandwidths):.1f} GB/s beside them; GFLOP/s: 2 x {args.batch} rows x its weights' "
              f"multiply-adds a row over its time" + (f", the head's at the whole head's" if args.batch <= 4 else "")
              + f"; of peak: of the bf16 multiply-add peak measured beside them, {peak:.0f} GFLOP/s "
              f"(vdpbf16ps on registers, every kernel thread: `cpu_kernels.bf16_dot_peak_gflops`)):\n")
        print("| phase | ms a step | share of the step | weight MB | GB/s | GFLOP/s | of peak |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name in sorted(phases[0], key=lambda n: PHASE_ORDER.index(n) if n in PHASE_ORDER else len(PHASE_ORDER)):
            med = medians[name]
            mb = streamed.get(name)
            gflops = 2 * args.batch * macs[name] / med / 1e9 if mb and med > 0 else 0.0
            print(f"| {name} | {med * 1e3:.3f} | {med / step:.1%} | "
                  + (f"{mb / 1e6:.1f} | {mb / med / 1e9:.1f} | {gflops:.0f} | {gflops / peak:.0%} |"
                     if gflops and peak else "| | | |"))


if __name__ == "__main__":
    main()
