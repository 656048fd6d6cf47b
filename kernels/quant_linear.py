"""Weight-only INT8 / INT4 linears on CPU: torch's own int8/int4 CPU GEMMs, with a fallback.

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
"""

from __future__ import annotations

import functools

import torch

from kernels.quant_reference import dequantize_w4_ref, w4a16_linear_ref, w8a16_linear_ref


@functools.cache
def cpu_int8_mm_available() -> bool:
    return _cpu_op_works("int8")


@functools.cache
def cpu_int4_mm_available() -> bool:
    return _cpu_op_works("int4")


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


__all__ = [
    "cpu_int4_mm_available",
    "cpu_int8_mm_available",
    "dequantize_w4_ref",
    "pack_int4_cpu",
    "w4a16_linear_cpu",
    "w4a16_linear_ref",
    "w8a16_linear",
    "w8a16_linear_cpu",
]
