"""Quantized linears: torch's own int8/int4 CPU GEMMs with a fallback; Triton on CUDA.

Weight-only (W8A16, W4A16) on CPU: `torch._weight_int8pack_mm` and
`aten._weight_int4pack_mm_for_cpu` are vectorised for bfloat16 activations only (fp32 and
fp16 activations are an order of magnitude slower), so the fast path casts x to bf16, runs
torch's integer kernel and casts the output back. That beats the float path at decode
batch sizes and is not slower at prefill. Dequantize-then-matmul streams a float weight
again on top of the integer read, so it is slower than float; it stays as the fallback
that works everywhere (CUDA, a torch without these private ops). The cost: activations
and outputs are rounded to bf16 (relative 2^-9) around each quantized GEMM; the int8/int4
rounding of the weights is larger (tests bound the end-to-end effect). The private ops
are probed once against the reference (`_cpu_op_works`); any failure selects the
reference path. W8A16 on an AVX512-BF16 CPU runs Pagoda's C++ int8 kernel instead, at
every row count, once the engine has packed the weight for it (`Int8Linear.kernel_weight`):
one arithmetic per output whatever the rows (batch-invariant), and at decode it streams the
int8 weight ~1.7x faster than torch's kernel (kernels/cpu_kernels.py `int8_linear`).
W4A16 likewise runs Pagoda's C++ int4 kernel on such a CPU (`Int4Linear` then holds only
its layout: engine/quantization/linears.py `cpu_int4_tensors`, kernels/cpu_kernels.py
`int4_linear`); torch's int4 kernel here serves where that kernel does not build.

W8A8 (`w8a8_linear`: int8 weights, activations quantized per token at run time) on CPU
runs `torch._int_mm` (int8 x int8 -> int32) on the stored [N, K] weight (a transposed
view; a [K, N] copy is no faster): the fastest W8A8 path, and far ahead of float at
prefill sizes (int8 dot products). At M = 1 the per-token activation quantization (a few
small torch ops) makes it slower than the weight-only path, which stays the CPU decode
choice (`--quantization int8`). `_int_mm` is exact in the integer part, so it is probed
for equality (`cpu_int_mm_available`); a failure selects the float64 reference. On CUDA,
W8A16, W4A16 and W8A8 run the Triton kernels (`kernels/triton_w8a16.py`,
`kernels/triton_w4a16.py`, `kernels/triton_w8a8.py`) regardless of `--kernel-backend`;
W4A16 group sizes the kernel does not take are refused when the model is loaded
(`engine.quantization.linears.int4_linear`), not served by the slow reference.

Per-call timings of every path, with the commands that produce them: docs/BENCHMARKS.md,
"CPU GEMM paths, per call".
"""

from __future__ import annotations

import functools

import torch

from kernels import cpu_kernels
from kernels.quant_reference import (
    dequantize_w4_ref,
    int8_matmul_ref,
    quantize_per_token_ref,
    w4a16_linear_ref,
    w8a8_linear_ref,
    w8a16_linear_ref,
)


def use_triton(device: torch.device) -> bool:
    """Whether the quantized GEMMs on `device` run the Triton kernels: on CUDA, always. (A
    function so that a CPU test under the Triton interpreter can route the CUDA way.)"""
    return device.type == "cuda"


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
            out = _int8pack_mm(x, qweight, scales)  # torch's op itself, whatever rows w8a16_linear_cpu routes
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
    kernel_weight: torch.Tensor | None = None,  # qweight packed by cpu_kernels.pack_int8_weight
) -> torch.Tensor:
    """W8A16 on CPU: with `kernel_weight` (the engine's Int8Linear once prepacked, where the
    C++ kernels have AVX512-BF16) Pagoda's int8 kernel at every row count (batch-invariant:
    one arithmetic per output whatever the rows), else torch's `_weight_int8pack_mm`."""
    if kernel_weight is not None:
        out = cpu_kernels.int8_linear(x.to(torch.bfloat16), kernel_weight, scales).to(x.dtype)
    else:
        out = _int8pack_mm(x, qweight, scales)
    return out if bias is None else out + bias


def _int8pack_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's int8 weight-only kernel on bf16 activations, output in x's dtype."""
    return torch._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scales).to(x.dtype)


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
    return packed, int4_scale_offset(scales, zeros)


def int4_scale_offset(
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor | None,  # [K / G, N] zero points (integer, or float: GGUF Q4_1); None = 8
) -> torch.Tensor:
    """bf16 [K / G, N, 2]: (scale, offset) per group and output with offset = scale * (8 - zero),
    so that w = (q - 8) * scale + offset: the form both CPU int4 kernels take (torch's and
    Pagoda's, kernels/cpu_kernels.py `pack_int4_weight`)."""
    offset = scales * (8 - (8 if zeros is None else zeros.float()))
    return torch.stack([scales.float(), offset.float()], dim=-1).to(torch.bfloat16).contiguous()


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


def w8a16_linear(x, qweight, scales, bias=None, *, invariant=False, kernel_weight=None):  # noqa: ANN001 - the reference's signature
    """The Triton kernel on CUDA (reads the int8 weight once, no dequantized copy; `invariant`:
    one config at every M); on CPU Pagoda's int8 kernel given its packed `kernel_weight`, else
    torch's int8 kernel when it works here (scales must then be bf16); else the reference."""
    if use_triton(x.device):
        from kernels import triton_w8a16

        return triton_w8a16.w8a16_linear(x, qweight, scales, bias, invariant=invariant)
    if x.device.type == "cpu" and kernel_weight is not None:
        return w8a16_linear_cpu(x, qweight, scales.to(torch.bfloat16), bias, kernel_weight)
    if x.device.type == "cpu" and cpu_int8_mm_available():
        return w8a16_linear_cpu(x, qweight, scales.to(torch.bfloat16), bias)
    return w8a16_linear_ref(x, qweight, scales, bias)


def w4a16_linear(x, qweight, scales, zeros, group_size, bias=None, *, invariant=False):  # noqa: ANN001 - the reference's signature
    """AutoGPTQ-layout W4A16: the Triton kernel on CUDA (every group size that is a multiple
    of 8; `int4_linear` refuses others at load; `invariant`: one config at every M), else
    the reference."""
    if use_triton(x.device):
        from kernels import triton_w4a16

        return triton_w4a16.w4a16_linear(x, qweight, scales, zeros, group_size, bias, invariant=invariant)
    return w4a16_linear_ref(x, qweight, scales, zeros, group_size, bias)


def w8a8_linear(
    x: torch.Tensor,  # [M, K] float
    qweight: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N] float32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """Dynamic W8A8 in x's dtype: quantize x per token, int8 GEMM, rescale.

    CUDA: the two Triton kernels. CPU: torch's `_int_mm` when the probe passes, else the
    float64 reference; both exact in the integer part.
    """
    if use_triton(x.device):
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
    "int4_scale_offset",
    "pack_int4_cpu",
    "use_triton",
    "w4a16_linear",
    "w4a16_linear_cpu",
    "w4a16_linear_ref",
    "w8a8_linear",
    "w8a16_linear",
    "w8a16_linear_cpu",
]
