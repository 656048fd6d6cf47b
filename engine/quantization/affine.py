"""Affine (scale + zero-point) integer quantization, exactly as the textbook writes it.

    s = (r_max - r_min) / (2^b - 1)      z = round(-r_min / s)
    q = clamp(round(r / s) + z, 0, 2^b - 1)      r_hat = s (q - z)

The range always contains 0 (r_min <= 0 <= r_max) so that z is an integer in
[0, 2^b - 1] and a real 0 is represented exactly. Symmetric quantization uses the same
formulas on the range [-max|r|, max|r|], which makes z = 2^(b-1) for every group; the
extreme value max|r| then lands half a step outside the grid and saturates with error
s/2 (no worse than any value between two levels). Values outside [r_min, r_max]
saturate at 0 and 2^b - 1. `torch.round` rounds halves to even.

Granularity: "tensor" (one s, z), "channel" (one per output row), or an int group size
(one per `group_size` consecutive input columns of each row: 32/64/128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Granularity = str | int


@dataclass(slots=True)
class QuantizedTensor:
    q: torch.Tensor  # [N, K] integers in [0, 2^bits - 1] (int32)
    scale: torch.Tensor  # [N, G] float32; G = 1 (channel), K / group_size (group); [1, 1] per tensor
    zero: torch.Tensor  # same shape as scale, integer-valued (int32)
    bits: int
    group_size: int  # input columns sharing one (scale, zero); N * K for per-tensor


def qparams(r_min: torch.Tensor, r_max: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of the range [r_min, r_max] (elementwise over groups)."""
    qmax = 2**bits - 1
    if symmetric:
        a = torch.maximum(r_min.abs(), r_max.abs())
        r_min, r_max = -a, a
    else:
        r_min = r_min.clamp(max=0)
        r_max = r_max.clamp(min=0)
    scale = (r_max - r_min) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any s works
    if symmetric:
        # round(qmax / 2) = 2^(b-1) (a half rounds to even); set exactly, not via float division.
        zero = torch.full_like(scale, 2 ** (bits - 1), dtype=torch.int32)
    else:
        zero = torch.round(-r_min / scale).clamp(0, qmax).to(torch.int32)
    return scale.float(), zero


def quantize(r: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """q = clamp(round(r / s) + z, 0, 2^b - 1), as int32 (scale/zero broadcast against r)."""
    return (torch.round(r.float() / scale) + zero).clamp(0, 2**bits - 1).to(torch.int32)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """r_hat = s (q - z)."""
    return scale * (q - zero).float()


def _grouped(w: torch.Tensor, granularity: Granularity) -> tuple[torch.Tensor, int]:
    """`w` [N, K] viewed as [rows, groups, group_size] for the given granularity."""
    n, k = w.shape
    if granularity == "tensor":
        return w.reshape(1, 1, n * k), n * k
    if granularity == "channel":
        return w.reshape(n, 1, k), k
    if isinstance(granularity, int) and not isinstance(granularity, bool) and granularity > 0:
        if k % granularity:
            raise ValueError(f"group_size {granularity} does not divide the {k} input columns")
        return w.reshape(n, k // granularity, granularity), granularity
    raise ValueError(f"granularity must be 'tensor', 'channel' or a positive group size, got {granularity!r}")


def quantize_tensor(
    w: torch.Tensor,
    bits: int,
    granularity: Granularity = "channel",
    symmetric: bool = False,
    clip_ratios: tuple[float, ...] = (1.0,),
) -> QuantizedTensor:
    """Quantize a 2-D weight [N, K]. `clip_ratios` > 1 entry = clipping search: each group
    shrinks its range by the ratio with the smallest squared reconstruction error (the
    rarely-hit outliers saturate, every other value gets a finer step)."""
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(w.shape)}")
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in [1, 16], got {bits}")
    g, group_size = _grouped(w.float(), granularity)
    r_min = g.amin(dim=-1, keepdim=True)
    r_max = g.amax(dim=-1, keepdim=True)
    best_err = best_scale = best_zero = None
    for ratio in clip_ratios:
        scale, zero = qparams(r_min * ratio, r_max * ratio, bits, symmetric)
        err = (dequantize(quantize(g, scale, zero, bits), scale, zero) - g).pow(2).sum(-1, keepdim=True)
        if best_err is None:
            best_err, best_scale, best_zero = err, scale, zero
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_scale = torch.where(better, scale, best_scale)
            best_zero = torch.where(better, zero, best_zero)
    q = quantize(g, best_scale, best_zero, bits).reshape(w.shape)
    return QuantizedTensor(q, best_scale.squeeze(-1), best_zero.squeeze(-1), bits, group_size)


def clip_search_ratios(steps: int = 20, lowest: float = 0.5) -> tuple[float, ...]:
    """1.0 down to `lowest` in `steps` even steps (AWQ's weight-clipping grid)."""
    return tuple(1.0 - (1.0 - lowest) * i / (steps - 1) for i in range(steps))


def dequantize_tensor(qt: QuantizedTensor) -> torch.Tensor:
    """The float weight [N, K] a QuantizedTensor stands for."""
    n, k = qt.q.shape
    rows, groups = qt.scale.shape
    g = qt.q.reshape(rows, groups, -1)
    return dequantize(g, qt.scale.unsqueeze(-1), qt.zero.unsqueeze(-1)).reshape(n, k)


# --- INT4 packing: 8 nibbles per int32, AutoGPTQ `qweight` layout --------------------
# qweight[k // 8, n] holds q[n, k] in bits 4 * (k % 8) .. 4 * (k % 8) + 3 (sequential
# order along the input dimension, as AutoGPTQ writes it; AutoAWQ packs along N in the
# interleaved order 0,2,4,6,1,3,5,7 instead, a permutation away).

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)
SEQUENTIAL_ORDER = tuple(range(8))


def pack_nibbles(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """values [R, C] in [0, 15] -> int32 [R, C / 8]; nibble i of out[r, c] is values[r, 8 c + order[i]]."""
    r, c = values.shape
    if c % 8:
        raise ValueError(f"{c} columns cannot be packed 8 per int32")
    if values.min() < 0 or values.max() > 15:
        raise ValueError("int4 values must lie in [0, 15]")
    grouped = values.reshape(r, c // 8, 8).to(torch.int64)[:, :, list(order)]
    packed = (grouped << _SHIFTS.to(grouped.device)).sum(-1)  # disjoint bits: the sum is the bitwise or
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_nibbles(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """The inverse of `pack_nibbles`: int32 [R, C / 8] -> int32 [R, C]."""
    r, c8 = packed.shape
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [R, C/8, 8], nibble i
    out = torch.empty_like(nibbles)
    out[:, :, list(order)] = nibbles
    return out.reshape(r, c8 * 8).to(torch.int32)



def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in [0, 15] -> qweight int32 [K / 8, N]."""
    return pack_nibbles(q, SEQUENTIAL_ORDER).t().contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K / 8, N] -> q int32 [N, K] in [0, 15]."""
    return unpack_nibbles(qweight.t().contiguous(), SEQUENTIAL_ORDER)
