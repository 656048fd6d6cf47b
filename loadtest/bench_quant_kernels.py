"""Quantized GEMM benchmark: Triton W4A16 / W8A8 on the GPU; `--cpu`: the W8A8 CPU paths.

    python -m loadtest.bench_quant_kernels                  # GPU, ~1-2 min on an H200
    python -m loadtest.bench_quant_kernels --json out.json  # also save the raw numbers
    python -m loadtest.bench_quant_kernels --cpu            # the table in kernels/quant_linear.py

GPU, measured in one run on one device (issue 5's goals, informational: exit 0):
- copy bandwidth (`loadtest.bench_kernels.measure_copy_bandwidth`, read + written bytes);
- W4A16 (group 128, with zeros, bf16 activations) at M = 1, 16, 64 on Llama-3-8B's MLP
  (fused gate_up 4096 -> 28672, down 14336 -> 4096) against torch's bf16 matmul of the
  same shape: time ratio bf16 / W4A16 (goals >= 2.5x at M <= 16, >= 1x at 64), and at
  M = 1 the bytes moved (int4 weights + bf16 scales + uint8 zeros + activations + output)
  per second as a fraction of copy bandwidth (goal >= 70%);
- W8A8 at M = 2048 on the same shapes: the Triton GEMM alone (pre-quantized activations)
  and with the per-token quantization kernel, in TOPS, against torch's int8 GEMM
  (`torch._int_mm`, cuBLASLt) and bf16 matmul rates measured on the same shapes.
Timings: `triton.testing.do_bench` (median; it clears L2 before each run), and every timed
function cycles through enough copies of its weights to exceed 120 MB (twice an H200's L2),
so no weight is read from L2. Outputs are checked against the torch references first.
Without CUDA (and without --cpu) it says so and exits 0.

CPU (`--cpu`): one W8A8 layer (dynamic per-token int8 activations, per-channel int8
weights) four ways on SmolLM2-135M's shapes at M = 1, 8, 128, min over repeats, plus the
float and int8 weight-only GEMMs as baselines; takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch

MLP_SHAPES = {"gate_up": (28672, 4096), "down": (4096, 14336)}  # (N, K) of Llama-3-8B
W4_ROWS = (1, 16, 64)
W8_ROWS = 2048
GROUP_SIZE = 128
ROTATE_BYTES = 120 * 2**20
GOAL_W4_SPEEDUP = {1: 2.5, 16: 2.5, 64: 1.0}
GOAL_W4_BANDWIDTH = 0.70
CPU_SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536)]  # (N, K): o, fused qkv, fused gate_up, down
CPU_ROWS = (1, 8, 128)


@dataclass
class W4Result:
    layer: str
    m: int
    n: int
    k: int
    w4a16_us: float
    bf16_us: float
    speedup: float
    bytes_moved: int
    gbps: float
    fraction_of_copy: float


@dataclass
class W8Result:
    layer: str
    m: int
    n: int
    k: int
    gemm_us: float
    with_quant_us: float
    int_mm_us: float
    bf16_us: float
    gemm_tops: float
    int_mm_tops: float
    bf16_tflops: float
    gemm_over_int_mm: float
    gemm_over_bf16_rate: float
    speedup_with_quant: float


def _copies(nbytes: int) -> int:
    return max(2, -(-ROTATE_BYTES // nbytes))


def _rotating(fn, sets):
    """fn(*sets[i]) with i advancing on each call: each run reads weights L2 has not seen."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(sets)
        return fn(*sets[state["i"]])

    return call


def bench_w4a16(do_bench, layer: str, n: int, k: int, copy_gbps: float, device) -> list[W4Result]:
    from kernels.quant_reference import w4a16_linear_ref
    from kernels.triton_w4a16 import w4a16_linear

    g = torch.Generator(device=device).manual_seed(n + k)
    groups = k // GROUP_SIZE

    def make_int4():  # uniformly random int32 words = uniformly random packed nibbles
        qweight = torch.randint(-(2**31), 2**31, (k // 8, n), dtype=torch.int32, device=device, generator=g)
        scales = (torch.rand(groups, n, device=device, generator=g) * 0.01 + 0.001).bfloat16()
        zeros = torch.randint(0, 16, (groups, n), dtype=torch.uint8, device=device, generator=g)
        return qweight, scales, zeros

    first = make_int4()
    w4_bytes = sum(t.numel() * t.element_size() for t in first)
    w4_sets = [first] + [make_int4() for _ in range(_copies(w4_bytes) - 1)]
    bf16_sets = [(torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g),)
                 for _ in range(_copies(n * k * 2))]
    results = []
    for m in W4_ROWS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
        qweight, scales, zeros = first
        got = w4a16_linear(x, qweight, scales, zeros, GROUP_SIZE).float()
        ref = w4a16_linear_ref(x.float(), qweight, scales.float(), zeros, GROUP_SIZE)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise SystemExit(f"W4A16 disagrees with the reference at {layer} M={m}: max rel err {err:.3g}")
        w4_ms = do_bench(_rotating(lambda q, s, z: w4a16_linear(x, q, s, z, GROUP_SIZE), w4_sets),
                         warmup=25, rep=200, return_mode="median")
        bf16_ms = do_bench(_rotating(lambda w: x @ w.t(), bf16_sets), warmup=25, rep=200, return_mode="median")
        moved = w4_bytes + x.numel() * 2 + m * n * 2
        gbps = moved / (w4_ms * 1e-3) / 1e9
        results.append(W4Result(layer, m, n, k, w4_ms * 1e3, bf16_ms * 1e3, bf16_ms / w4_ms, moved, gbps,
                                gbps / copy_gbps))
        print(f"[bench_quant_kernels] {asdict(results[-1])}", file=sys.stderr, flush=True)
    return results


def bench_w8a8(do_bench, layer: str, n: int, k: int, device) -> W8Result:
    from kernels.quant_reference import w8a8_linear_ref
    from kernels.triton_w8a8 import quantize_per_token, w8a8_linear

    g = torch.Generator(device=device).manual_seed(n * 3 + k)
    m = W8_ROWS
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    int8_sets = [
        (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device, generator=g),
         torch.rand(n, device=device, generator=g) * 1e-3)
        for _ in range(_copies(n * k))
    ]
    bf16_sets = [(torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g),)
                 for _ in range(_copies(n * k * 2))]
    qx, x_scale = quantize_per_token(x)
    qweight, w_scale = int8_sets[0]
    got = w8a8_linear(qx, x_scale, qweight, w_scale, out_dtype=torch.float32)
    ref = w8a8_linear_ref(qx, x_scale, qweight, w_scale)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    if err > 1e-5:
        raise SystemExit(f"W8A8 GEMM disagrees with the reference at {layer}: max rel err {err:.3g}")

    def bench(fn, sets) -> float:
        return do_bench(_rotating(fn, sets), warmup=10, rep=100, return_mode="median")

    gemm_ms = bench(lambda q, s: w8a8_linear(qx, x_scale, q, s, out_dtype=torch.bfloat16), int8_sets)
    full_ms = bench(lambda q, s: w8a8_linear(*quantize_per_token(x), q, s, out_dtype=torch.bfloat16), int8_sets)
    int_mm_ms = bench(lambda q, s: torch._int_mm(qx, q.t()), int8_sets)
    bf16_ms = bench(lambda w: x @ w.t(), bf16_sets)
    ops = 2 * m * n * k
    rate = lambda ms: ops / (ms * 1e-3) / 1e12  # noqa: E731
    result = W8Result(
        layer, m, n, k, gemm_ms * 1e3, full_ms * 1e3, int_mm_ms * 1e3, bf16_ms * 1e3,
        rate(gemm_ms), rate(int_mm_ms), rate(bf16_ms), int_mm_ms / gemm_ms, bf16_ms / gemm_ms, bf16_ms / full_ms,
    )
    print(f"[bench_quant_kernels] {asdict(result)}", file=sys.stderr, flush=True)
    return result


def main_gpu(json_path: str | None) -> int:
    import triton
    from triton.testing import do_bench

    from loadtest.bench_kernels import measure_copy_bandwidth

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    print(f"[bench_quant_kernels] {name}, torch {torch.__version__}, triton {triton.__version__}",
          file=sys.stderr, flush=True)
    copy_gbps = measure_copy_bandwidth(do_bench, device)
    w4 = [r for layer, (n, k) in MLP_SHAPES.items() for r in bench_w4a16(do_bench, layer, n, k, copy_gbps, device)]
    w8 = [bench_w8a8(do_bench, layer, n, k, device) for layer, (n, k) in MLP_SHAPES.items()]

    print(f"\n{name}; copy bandwidth {copy_gbps:.0f} GB/s; Llama-3-8B MLP, bf16 activations\n")
    print(f"W4A16 (group {GROUP_SIZE}, zeros) vs torch bf16 matmul")
    print("| layer | M | W4A16 us | bf16 us | speedup | goal | GB/s | of copy bw |")
    print("|---|---:|---:|---:|---:|---|---:|---:|")
    for r in w4:
        goal = GOAL_W4_SPEEDUP[r.m]
        bw = f"{r.fraction_of_copy:.0%} (goal >= {GOAL_W4_BANDWIDTH:.0%} " \
             f"{'MET' if r.fraction_of_copy >= GOAL_W4_BANDWIDTH else 'MISS'})" if r.m == 1 else f"{r.fraction_of_copy:.0%}"
        print(f"| {r.layer} {r.n}x{r.k} | {r.m} | {r.w4a16_us:.1f} | {r.bf16_us:.1f} | {r.speedup:.2f}x | "
              f">= {goal}x {'MET' if r.speedup >= goal else 'MISS'} | {r.gbps:.0f} | {bw} |")
    print(f"\nW8A8 at M = {W8_ROWS} (TOPS = 2 M N K / time)")
    print("| layer | W8A8 GEMM us | TOPS | of _int_mm | of bf16 rate | + act quant us | vs bf16 | _int_mm TOPS | bf16 TFLOPS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in w8:
        print(f"| {r.layer} {r.n}x{r.k} | {r.gemm_us:.1f} | {r.gemm_tops:.0f} | {r.gemm_over_int_mm:.0%} | "
              f"{r.gemm_over_bf16_rate:.2f}x | {r.with_quant_us:.1f} | {r.speedup_with_quant:.2f}x | "
              f"{r.int_mm_tops:.0f} | {r.bf16_tflops:.0f} |")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "triton": triton.__version__,
                       "copy_gbps": copy_gbps, "w4a16": [asdict(r) for r in w4], "w8a8": [asdict(r) for r in w8]},
                      f, indent=2)
    return 0


def _us(fn, iters: int = 10, repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t) / iters)
    return best * 1e6


def main_cpu() -> int:
    """The W8A8 CPU candidates side by side (`kernels/quant_linear.py` picks the winner).

    `act quant` is the per-token quantization alone (part of every W8A8 column); `w8a16`
    (int8 weights, bf16 activations) and `float` (`kernels.linear`) are the baselines.
    """
    import torch.nn.functional as F

    from kernels.linear import linear
    from kernels.quant_linear import w8a16_linear_cpu
    from kernels.quant_reference import quantize_per_token_ref

    def int_mm(x, qweight_t, w_scale):  # torch's int8 x int8 -> int32 GEMM
        qx, x_scale = quantize_per_token_ref(x)
        return torch._int_mm(qx, qweight_t).float() * x_scale * w_scale

    def int8pack(x, qweight, w_scale_bf16):  # integer activations through the weight-only int8 kernel
        qx, x_scale = quantize_per_token_ref(x)
        return torch._weight_int8pack_mm(qx.to(torch.bfloat16), qweight, w_scale_bf16).float() * x_scale

    def dequant(x, qweight, w_scale):  # dequantize both operands, one fp32 GEMM
        qx, x_scale = quantize_per_token_ref(x)
        return F.linear(qx.float() * x_scale, qweight.float() * w_scale[:, None])

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; microseconds, min of 7 x 10 calls")
    print(f"{'shape':>9} {'M':>4} {'_int_mm':>8} {'_int_mm[K,N]':>12} {'int8pack':>9} {'dequant':>8} "
          f"{'act quant':>9} {'w8a16':>8} {'float':>8}")
    _us(lambda: linear(torch.randn(64, 576), torch.randn(576, 576)))  # thread pool and allocator warm-up
    for n, k in CPU_SHAPES:
        gen = torch.Generator().manual_seed(n + k)
        w = torch.randn(n, k, generator=gen) * 0.05
        qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
        w_scale = torch.rand(n, generator=gen) * 1e-3
        qweight_kn = qweight.t().contiguous()
        for m in CPU_ROWS:
            x = torch.randn(m, k, generator=gen)
            row = [
                _us(lambda: int_mm(x, qweight.t(), w_scale)),
                _us(lambda: int_mm(x, qweight_kn, w_scale)),
                _us(lambda: int8pack(x, qweight, w_scale.bfloat16())),
                _us(lambda: dequant(x, qweight, w_scale)),
                _us(lambda: quantize_per_token_ref(x)),
                _us(lambda: w8a16_linear_cpu(x, qweight, w_scale.bfloat16())),
                _us(lambda: linear(x, w)),
            ]
            print(f"{n:>4}x{k:<4} {m:>4} " + " ".join(f"{v:{w_}.1f}" for v, w_ in zip(row, (8, 12, 9, 8, 9, 8, 8))),
                  flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the raw GPU numbers here")
    parser.add_argument("--cpu", action="store_true", help="the W8A8 CPU paths instead (no GPU needed)")
    args = parser.parse_args(argv)
    if args.cpu:
        return main_cpu()
    if not torch.cuda.is_available():
        print("bench_quant_kernels: CUDA is required (the Triton kernels are timed on the GPU); nothing to do. "
              "`--cpu` times the W8A8 CPU paths.")
        return 0
    return main_gpu(args.json)


if __name__ == "__main__":
    sys.exit(main())
