"""The element-wise steps of a decoder layer as ops: the torch reference (any device) and
the fused CPU kernels (kernels/csrc/cpu_kernels.cpp), chosen by `KernelOps`.

- `add_rms_norm(x, add, weight, eps)`: the residual add and the next RMSNorm. Returns
  (normed, summed): summed = x + add (x itself with no add), normed = RMSNorm(summed) * w,
  normalised in float32, rounded to the dtype, then scaled (as Hugging Face's LlamaRMSNorm).
  The CPU kernel writes `summed` into x's storage: callers pass a residual stream they own.
- `rotate_qk_(qk, cos, sin, positions)`: rotate-half RoPE of q and k heads, in place.

Each reference is a few eager torch ops; each CPU kernel is one pass over the rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # torch's fused kernel: bit-identical to the steps below in float32, fewer ops.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x if add is None else x + add
    return rms_norm(summed, weight, eps), summed


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by cos/sin [T, 1, D/2], computed in float32, cast back."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rotate_qk_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """qk [T, H, D] rotated in place by the float32 tables cos/sin [max_positions, D/2]."""
    qk.copy_(rotate_half(qk, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)))
    return qk


_CPU_DTYPES = (torch.float32, torch.bfloat16)


def _fits_cpu(x: torch.Tensor) -> bool:
    """A CPU tensor in a dtype the kernels take (the model's activations; weights, which
    the model keeps in the same dtype and device, are checked against x's dtype)."""
    return x.dtype in _CPU_DTYPES and x.device.type == "cpu"


def cpu_add_rms_norm(x, add, weight, eps):
    if not (_fits_cpu(x) and x.dtype == weight.dtype and x.dim() == 2 and x.is_contiguous()
            and (add is None or (add.dtype == x.dtype and add.is_contiguous()))):
        return add_rms_norm(x, add, weight, eps)
    from kernels.cpu_kernels import load

    out = torch.empty_like(x)
    load().add_rms_norm(out, x, x, add, weight, eps)
    return out, x


def cpu_rotate_qk_(qk, cos, sin, positions):
    if not (_fits_cpu(qk) and qk.stride(2) == 1 and qk.stride(1) == qk.shape[2] and cos.dtype == torch.float32):
        return rotate_qk_(qk, cos, sin, positions)
    from kernels.cpu_kernels import load

    load().rotary(qk, cos, sin, positions)
    return qk
