"""Torch reference ops for weight-only quantized GEMMs (same signatures as the Triton kernels).

W8A16: `qweight` int8 [N, K] (symmetric, zero point folded: w = scales[n] * qweight[n, k]).
W4A16: `qweight` int32 [K / 8, N], 8 nibbles per int32 in AutoGPTQ's sequential order
(nibble j of qweight[i, n] is input column 8 i + j); `scales` [K / group_size, N];
`zeros` [K / group_size, N] integer zero points, or None for the symmetric zero point 8;
w[n, k] = scales[k // g, n] * (q[n, k] - zeros[k // g, n]).
The references dequantize the whole weight, then run one matmul in the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


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
    q = (qweight.unsqueeze(1) >> _SHIFTS.to(qweight.device).view(1, 8, 1)) & 0xF  # [K/8, 8, N]
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
