"""Quantized linears: torch's own int8/int4 CPU GEMMs with a fallback; Triton on CUDA.

Measured on this 2-core CPU (min of 15 x 20 calls, microseconds, `python -m
loadtest.bench_quant --kernels` reruns it) on SmolLM2-135M's shapes [N x K], fp32 input:

    shape      M  F.linear  sliced-bmm fp32  int8pack(fp32 x)  int8pack(bf16 x)  int4pack(bf16 x, g64/128)
    576x576    1     17.7        17.5             107.8             11.2              10.8
    960x576    1     29.5        24.3             177.2             11.4              12.6
    3072x576   1     91.8        65.0             565.0             25.6              27.5
    576x1536   1     44.6        36.2             287.4             14.2              17.4
    1536x576   1     48.8        35.9             284.4             16.3              16.5
    3072x576   8    309.9       346.3            4870.1             98.5              89.0
    576x1536   8    137.0       161.1            2383.4             45.2              46.3

`torch._weight_int8pack_mm` / `aten._weight_int4pack_mm_for_cpu` are vectorised for
bfloat16 activations only (fp32 is ~10x slower, fp16 ~20x): the winner is "cast x to
bf16, run torch's int kernel, cast the output back" — 2-3.5x faster than the fp32
sliced-bmm path at M = 1..8, and not slower up to M = 512 (prefill). Dequantize-then-
matmul streams 4 bytes per weight again plus the int8 read, so it is slower than float
(331 vs 46 us at 576x1536); it stays as the fallback that works everywhere (CUDA, a torch
without these private ops). The cost: activations and outputs are rounded to bf16
(relative 2^-9) around each quantized GEMM; the int8/int4 rounding of the weights is
larger (tests bound the end-to-end effect).

The private ops are probed once against the reference (`_cpu_op_works`); any failure
selects the reference path.

W8A8 (`w8a8_linear`: int8 weights, activations quantized per token at run time) on
CPU, microseconds per layer, fp32 x, `python -m loadtest.bench_quant_kernels --cpu`
(min of 7 x 10 calls; run while other jobs loaded the 2 cores, load average ~6: the
millisecond entries are OpenMP threads waiting for a descheduled peer, not the kernels;
the order of the columns was the same in three runs):

    shape      M  _int_mm  _int_mm[K,N]  int8pack  dequant  act quant  w8a16  float
    576x576    1     27.1      41.5      15599.5   9225.4     17.7     11.6    18.8
    576x576    8     36.9      44.4         56.4  19073.7     25.1     29.1    76.2
    576x576  128    148.9     144.5       2435.5  16926.1     44.9    325.3  2045.7
    960x576    1     27.5      31.6         32.5    214.7     17.7     15.6    26.0
    960x576    8     44.0      40.8         62.6   6880.6     20.8     39.4   117.3
    960x576  128    151.8     153.3       2605.1  45569.8     50.6   7722.1  2988.9
    3072x576   1     38.5      72.8         51.4  32745.9     17.8     31.9    68.0
    3072x576   8     90.9     105.6        136.4  53831.4     24.9    106.0  2287.3
    3072x576 128   1230.0    2045.6      24318.2  82848.9     37.5  10799.1 18602.5
    576x1536   1     31.0      42.1         38.3    148.0     18.7     17.8    37.9
    576x1536   8     55.7      54.3         77.2    308.9     23.1     48.8   173.4
    576x1536 128    259.7     243.3       3247.6  19200.5     80.9   2321.6  5748.0

`_int_mm`: torch's int8 x int8 -> int32 GEMM on the stored [N, K] weight (a transposed
view; a [K, N] copy is no faster); `int8pack`: the integer activations as bf16 through
the weight-only int8 kernel; `dequant`: both operands back to fp32, one F.linear. All
three include `act quant` (the per-token quantization alone, ~18 us of small torch ops
at M = 1). `w8a16` (int8 weights, activations unquantized) and `float` are baselines,
not W8A8. `_int_mm` wins every row among the W8A8 paths, and beats float by 6-20x at
M = 128 (int8 dot products; the spread is the noise of the three runs); at M = 1 the activation quantization makes it slower than the
weight-only path, which stays the CPU decode choice (`--quantization int8`). It is exact
in the integer part, so it is probed for equality (`cpu_int_mm_available`); a failure
selects the float64 reference. On CUDA, W4A16 and W8A8 run the Triton kernels
(`kernels/triton_w4a16.py`, `kernels/triton_w8a8.py`) regardless of `--kernel-backend`.
"""

from __future__ import annotations

import functools

import torch

from kernels.quant_reference import (
    dequantize_w4_ref,
    int8_matmul_ref,
    quantize_per_token_ref,
    w4a16_linear_ref,
    w8a8_linear_ref,
    w8a16_linear_ref,
)


@functools.cache
def cpu_int8_mm_available() -> bool:
    return _cpu_op_works("int8")


@functools.cache
def cpu_int4_mm_available() -> bool:
    return _cpu_op_works("int4")


@functools.cache
def cpu_int_mm_available() -> bool:
    """torch._int_mm (int8 x int8 -> int32) runs on CPU here and is exact."""
    gen = torch.Generator().manual_seed(0)
    qx = torch.randint(-127, 128, (3, 72), dtype=torch.int8, generator=gen)
    qweight = torch.randint(-127, 128, (17, 72), dtype=torch.int8, generator=gen)
    try:
        return bool(torch.equal(torch._int_mm(qx, qweight.t()), int8_matmul_ref(qx, qweight)))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


def _cpu_op_works(kind: str) -> bool:
    """Run the private op once on a small case and compare with the reference."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    try:
        if kind == "int8":
            qweight = torch.randint(-128, 128, (16, 64), dtype=torch.int8, generator=gen)
            scales = (torch.rand(16, generator=gen) + 0.5).bfloat16()
            out = w8a16_linear_cpu(x, qweight, scales)
            ref = w8a16_linear_ref(x, qweight, scales.float())
        else:
            q = torch.randint(0, 16, (16, 64), dtype=torch.int32, generator=gen)
            scales = torch.rand(2, 16, generator=gen) + 0.5
            zeros = torch.randint(0, 16, (2, 16), dtype=torch.int32, generator=gen)
            packed, scales_and_zeros = pack_int4_cpu(q, scales, zeros, 32)
            out = w4a16_linear_cpu(x, packed, scales_and_zeros, 32)
            w = (q - zeros.repeat_interleave(32, 0).t()) * scales.repeat_interleave(32, 0).t()
            ref = x @ w.t()
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.allclose(out, ref, rtol=2e-2, atol=0.5))


def w8a16_linear_cpu(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N] bfloat16
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    out = torch._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales).to(x.dtype)
    return out if bias is None else out + bias


def pack_int4_cpu(
    q: torch.Tensor,  # [N, K] int in [0, 15]
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor | None,  # [K / G, N] integer zero points; None = 8
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout: packed uint8 [N, K / 2] and bf16 [K / G, N, 2] (scale, offset).

    That kernel computes w = (q - 8) * scale + offset, so offset = scale * (8 - zero).
    """
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
    offset = scales * (8 - (8 if zeros is None else zeros.float()))
    return packed, torch.stack([scales.float(), offset.float()], dim=-1).to(torch.bfloat16).contiguous()


def w4a16_linear_cpu(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [N, K / 2] uint8 (pack_int4_cpu)
    scales_and_zeros: torch.Tensor,  # [K / G, N, 2] bfloat16
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), packed, group_size, scales_and_zeros)
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def w8a16_linear(x, qweight, scales, bias=None):  # noqa: ANN001 - same signature as the reference
    """CPU int8 kernel when it works here (scales must then be bf16), else the reference."""
    if x.device.type == "cpu" and cpu_int8_mm_available():
        return w8a16_linear_cpu(x, qweight, scales.to(torch.bfloat16), bias)
    return w8a16_linear_ref(x, qweight, scales, bias)


def w4a16_linear(x, qweight, scales, zeros, group_size, bias=None):  # noqa: ANN001 - the reference's signature
    """AutoGPTQ-layout W4A16: the Triton kernel on CUDA (group sizes 32/64/128), else the reference."""
    if x.device.type == "cuda" and group_size in (32, 64, 128):
        from kernels import triton_w4a16

        return triton_w4a16.w4a16_linear(x, qweight, scales, zeros, group_size, bias)
    return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias)


def w8a8_linear(
    x: torch.Tensor,  # [M, K] float
    qweight: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Dynamic W8A8 in x's dtype: quantize x per token, int8 GEMM, rescale.

    CUDA: the two Triton kernels. CPU: torch's `_int_mm` when the probe passes (the
    table above), else the float64 reference; both exact in the integer part.
    """
    if x.device.type == "cuda":
        from kernels import triton_w8a8

        qx, x_scale = triton_w8a8.quantize_per_token(x)
        return triton_w8a8.w8a8_linear(qx, x_scale, qweight, w_scale, bias, out_dtype=x.dtype)
    qx, x_scale = quantize_per_token_ref(x)
    if x.device.type == "cpu" and cpu_int_mm_available():
        out = torch._int_mm(qx, qweight.t()).float() * x_scale * w_scale
        return (out if bias is None else out + bias).to(x.dtype)
    return w8a8_linear_ref(qx, x_scale, qweight, w_scale, bias, x.dtype)


__all__ = [
    "cpu_int4_mm_available",
    "cpu_int8_mm_available",
    "cpu_int_mm_available",
    "dequantize_w4_ref",
    "pack_int4_cpu",
    "w4a16_linear",
    "w4a16_linear_cpu",
    "w4a16_linear_ref",
    "w8a8_linear",
    "w8a16_linear",
    "w8a16_linear_cpu",
]
