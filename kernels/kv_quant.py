"""The quantized KV cache's format (`--kv-cache-dtype int8|fp8`) and its torch reference.

A KV cache in the compute dtype stores each token's K (and V) as `[kv_heads, head_dim]`
values of 2 bytes (bf16). A quantized cache stores each (token, KV head) row as
`head_dim` one-byte codes followed by the row's scale, a bfloat16 in the row's last two
bytes:

    cache[block, offset, head] = [q_0 .. q_{D-1} | scale as bf16 bits]     (D + 2 bytes)

so the cache tensors are `[num_blocks, block_size, kv_heads, head_dim + 2]` of int8
(INT8) or uint8 (FP8 E4M3 bits), and everything that moves whole blocks (copy-on-write,
the prefix cache, the pad block) moves the scales with them. Per token and head, symmetric:

    INT8: scale = bf16(absmax / 127),  q = clamp(round_half_even(x / scale), -127, 127)
    FP8:  scale = bf16(absmax / 448),  q = e4m3(clamp(x / scale, -448, 448))

and a row reads back as `q * scale` (docs/QUANTIZATION.md, "KV cache", says why per token
and head, symmetric, and what error that gives). The scale is rounded to bf16 *before* the
codes are computed with it, so storing it in 2 bytes adds no error: the codes are exact for
the stored scale. An all-zero row gets scale 0 and codes 0. A bf16 cache row of a 64-wide
head is 128 bytes; quantized it is 66: 1.94x the tokens in the same memory.

The attention kernels (C++ on CPU, Triton on CUDA) read these rows in place and
dequantize as they load; the write kernels quantize. These functions define the semantics
the kernels are tested against (and run the torch backend).
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
"""`--kv-cache-dtype` values: `auto` stores K/V in the compute dtype; `int8`/`fp8` quantize."""
SCALE_BYTES = 2
"""Bytes of each row's scale (a bfloat16) after its codes."""
INT8_MAX = 127.0
FP8_MAX = 448.0  # E4M3's largest finite value


def storage_dtype(kv_cache_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' element type: the compute dtype (`auto`), int8 or uint8 (FP8 bits)."""
    if kv_cache_dtype == "auto":
        return compute_dtype
    if kv_cache_dtype == "int8":
        return torch.int8
    if kv_cache_dtype == "fp8":
        return torch.uint8
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def is_quantized(cache: torch.Tensor) -> bool:
    """Whether a cache tensor holds quantized rows (codes + scale) rather than values."""
    return cache.dtype in (torch.int8, torch.uint8)


def kind_of(cache: torch.Tensor) -> str:
    """`int8` or `fp8` for a quantized cache tensor."""
    return "int8" if cache.dtype == torch.int8 else "fp8"


def row_width(head_dim: int, quantized: bool) -> int:
    """Elements of one (token, KV head) row of the cache tensor: head_dim, or its codes and the scale's bytes."""
    if quantized and head_dim % 2:
        raise ValueError(f"a quantized KV cache needs an even head_dim (its scale is 2-byte aligned), got {head_dim}")
    return head_dim + SCALE_BYTES if quantized else head_dim


def quantize(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows `x [..., D]` (any float dtype) as cache rows `[..., D + 2]` of `kind`'s codes and bf16 scale."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    top = INT8_MAX if kind == "int8" else FP8_MAX
    scale = (absmax / top).to(torch.bfloat16)
    s = scale.float()
    safe = torch.where(s > 0, s, torch.ones_like(s))
    y = torch.where(s > 0, xf / safe, torch.zeros_like(xf))
    if kind == "int8":
        codes = torch.round(y).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif kind == "fp8":
        codes = y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        raise ValueError(f"quantize: kind must be int8 or fp8, got {kind!r}")
    scale_bytes = scale.contiguous().view(codes.dtype)  # [..., 2]: the bf16's bytes, little-endian
    return torch.cat([codes, scale_bytes.view(*codes.shape[:-1], SCALE_BYTES)], dim=-1)


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each cache row `[..., D + 2]`."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.bfloat16).float().squeeze(-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Cache rows `[..., D + 2]` (int8 or uint8 = FP8) as float32 values `[..., D]`: codes x scale."""
    codes = rows[..., :-SCALE_BYTES]
    if rows.dtype == torch.int8:
        values = codes.float()
    elif rows.dtype == torch.uint8:
        values = codes.contiguous().view(torch.float8_e4m3fn).float()
    else:
        raise ValueError(f"dequantize: int8 or uint8 cache rows expected, got {rows.dtype}")
    return values * scales(rows).unsqueeze(-1)
