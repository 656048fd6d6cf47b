"""Torch reference ops for weight-only quantized GEMMs (same signatures as the Triton kernels).

W8A16: `qweight` int8 [N, K] (symmetric, zero point folded: w = scales[n] * qweight[n, k]).
W4A16: `qweight` int32 [K / 8, N], 8 nibbles per int32 in AutoGPTQ's sequential order
(nibble j of qweight[i, n] is input column 8 i + j); `scales` [K / group_size, N];
`zeros` [K / group_size, N] integer zero points, or None for the symmetric zero point 8;
w[n, k] = scales[k // g, n] * (q[n, k] - zeros[k // g, n]).
The references dequantize the whole weight, then run one matmul in the activation dtype.

W8A8: activations are quantized per token (symmetric int8, one scale per row,
s = absmax / 127, q = round(x * (127 / absmax)) with halves to even; an all-zero row
gets s = 0, q = 0), weights per output channel (`qweight` int8 [N, K], `w_scale` [N]);
the GEMM accumulates int8 x int8 exactly in int32, then
out = acc * x_scale[m] * w_scale[n] (+ bias), in fp32 before the cast to `out_dtype`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

def dequantize_w8_ref(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] float weight of a W8A16 layer."""
    return qweight.to(dtype) * scales.to(dtype).unsqueeze(1)


def w8a16_linear_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    return F.linear(x, dequantize_w8_ref(qweight, scales, x.dtype), bias)


def dequantize_w4_ref(
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor | None,  # [K / G, N] integer zero points; None = 8
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[N, K] float weight of a W4A16 layer."""
    k8, n = qweight.shape
    # Made on qweight's device (a fill kernel), not copied from the host: a host -> device
    # copy is an error inside a CUDA-graph capture.
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(1) >> shifts.view(1, 8, 1)) & 0xF  # [K/8, 8, N]
    q = q.reshape(k8 * 8, n).float()
    z = 8.0 if zeros is None else zeros.float().repeat_interleave(group_size, dim=0)
    w = (q - z) * scales.float().repeat_interleave(group_size, dim=0)  # [K, N]
    return w.t().to(dtype)


def w4a16_linear_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor | None,  # [K / G, N]
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    return F.linear(x, dequantize_w4_ref(qweight, scales, zeros, group_size, x.dtype), bias)


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], x_scale float32 [M, 1]), computed in fp32.

    Multiplying by 127 / absmax (one IEEE division per row) rather than dividing by the
    stored scale is what the Triton kernel does too, so the two agree bit for bit. The
    division is tensor / tensor: torch computes `127.0 / absmax` (scalar / tensor) as
    `absmax.reciprocal() * 127`, two roundings that miss the correctly rounded quotient for
    about a quarter of the values; bf16 / fp16 activations land on exact halves often enough
    (x = absmax / 2 gives 63.5) that a one-ulp-off `inv` rounds them the other way.
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(absmax > 0, torch.full_like(absmax, 127.0) / absmax, torch.zeros_like(absmax))
    q = torch.round(xf * inv).clamp(-127, 127).to(torch.int8)
    return q, absmax / 127.0


def int8_matmul_ref(qx: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """qx int8 [M, K] @ qweight int8 [N, K]^T -> int32 [M, N], exactly.

    In float64 (CPU and CUDA both have it; neither has an integer GEMM for every shape):
    every product and partial sum is an integer below 2^53, so no rounding happens.
    """
    return (qx.double() @ qweight.double().t()).to(torch.int32)


def w8a8_linear_ref(
    qx: torch.Tensor,  # [M, K] int8
    x_scale: torch.Tensor,  # [M, 1] float32
    qweight: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    out = int8_matmul_ref(qx, qweight).float() * x_scale.float() * w_scale.float()[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)
