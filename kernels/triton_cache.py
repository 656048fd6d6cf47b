"""KV-cache write in Triton: scatter this step's K and V into their slots.

Same semantics and signature as `kernels.reference.reshape_and_cache`, plus: a negative
slot (-1) skips the token, so a padded batch (CUDA graphs) can carry tokens that own no
slot. One program per token copies all of its KV heads; slot x slot stride is computed
in int64 (a large cache passes 2**31 elements).

A quantized cache (`kernels.kv_quant`: int8 codes or uint8 FP8 E4M3 bits, rows of
head_dim codes + a bf16 scale) is written by the same kernel, quantizing each (token, KV
head) row as `kv_quant.quantize` does (KV_QUANT 1: int8, 2: fp8; 0 is the plain copy).
Every step is exact IEEE arithmetic, so the codes and scales are bit-identical to the
torch reference, under the interpreter and compiled alike: the divisions are
`tl.math.div_rn` (correctly rounded; a plain `/` compiles to the approximate div.full.f32),
the scale's rounding to bf16 and the INT8 round-half-to-even are integer/float formulas
rather than conversions (triton 3.6's interpreter truncates fp32 -> bf16 and has no rint).
The FP8 codes are Triton's `.to(tl.float8e4nv)`, round to nearest even on the GPU
(cvt.rn.satfinite; the values are clamped to +-448 first, as the reference does); the
interpreter's own fp32 -> fp8 conversion is not exactly that (tests/kernels/
test_triton_kv_quant.py says how it is tested there).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import kv_quant
from kernels.triton_runtime import check_device_runs_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_BLOCK_SIZE = 128
# The kernels' KV_QUANT switch: how a cache row is stored.
KV_QUANT_NONE, KV_QUANT_INT8, KV_QUANT_FP8 = 0, 1, 2
# fp32 x + 1.5 * 2**23 - 1.5 * 2**23 rounds x to an integer, half to even, for |x| < 2**22.
_RINT_MAGIC = tl.constexpr(12582912.0)


def kv_quant_mode(cache: torch.Tensor) -> int:
    """The KV_QUANT value for a cache tensor: none (values), int8 codes or fp8 codes."""
    if not kv_quant.is_quantized(cache):
        return KV_QUANT_NONE
    return KV_QUANT_INT8 if kv_quant.kind_of(cache) == "int8" else KV_QUANT_FP8


def check_quantized_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, head_dim: int) -> None:
    """A quantized K/V cache pair against head_dim; raises ValueError.

    Both int8 (INT8 codes) or both uint8 (FP8 E4M3 bits), rows of head_dim + 2 (the codes,
    then the bf16 scale's bytes); FP8 on CUDA needs Triton's float8e4nv conversions, i.e.
    compute capability 8.9+ (Ada, Hopper).
    """
    if not (kv_quant.is_quantized(key_cache) and value_cache.dtype == key_cache.dtype):
        raise ValueError(
            f"key_cache and value_cache must both be int8 or both uint8 (fp8) when quantized, got "
            f"{key_cache.dtype} and {value_cache.dtype}"
        )
    width = key_cache.shape[-1]
    if head_dim % 2 or width != head_dim + kv_quant.SCALE_BYTES:
        raise ValueError(
            f"a quantized ({kv_quant.kind_of(key_cache)}) cache's rows are head_dim + {kv_quant.SCALE_BYTES} "
            f"wide (the codes, then the bf16 scale's bytes) for an even head_dim: head_dim {head_dim} needs "
            f"{head_dim + kv_quant.SCALE_BYTES}, got {width}"
        )
    if kv_quant.kind_of(key_cache) == "fp8" and key_cache.device.type == "cuda":
        major, minor = _capability(key_cache.device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"an fp8 KV cache needs a GPU of compute capability 8.9+ (Triton's float8e4nv), got "
                f"{major}.{minor}; use int8"
            )


@functools.lru_cache(maxsize=16)
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device) -> tuple[int, int]:
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def _store_quantized_rows(
    cache_ptr,  # int8 (INT8 codes) or uint8 (FP8 E4M3 bits) cache
    row_off,  # [ROWS, 1] int64: each row's first element
    x,  # [ROWS, HEAD_DIM] any float dtype
    mask,  # [ROWS, 1] rows to write
    HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    # kv_quant.quantize per row, step for step in fp32.
    x = x.to(tl.float32)
    absmax = tl.max(tl.abs(x), axis=1)  # [ROWS]
    if KV_QUANT == 1:
        top = 127.0
    else:
        top = 448.0
    scale = tl.math.div_rn(absmax, tl.full(absmax.shape, top, tl.float32))
    # Round the scale to bf16 before the codes use it, nearest-even on the bits: add 0x7fff
    # plus the lowest kept bit, drop 16 bits (exact for every finite absmax / top >= 0).
    bits = scale.to(tl.int32, bitcast=True)
    scale_bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16  # [ROWS] the bf16's bits, < 0x8000
    s = (scale_bits << 16).to(tl.float32, bitcast=True)[:, None]
    # An all-zero row has scale 0: codes 0, not 0/0.
    y = tl.where(s > 0, tl.math.div_rn(x, tl.where(s > 0, s, 1.0)), 0.0)
    if KV_QUANT == 1:
        # Round half to even with the fp32 adder (the interpreter has no rint): |y| <= 127 x
        # (1 + 2**-8) here, far below 2**22, so the sum's rounding to an integer (nearest,
        # ties to even) is the only rounding; then the reference's clamp to +-127.
        q = (y + _RINT_MAGIC) - _RINT_MAGIC
        codes = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
    else:
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        codes = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(cache_ptr + row_off + offs_d[None, :], codes, mask=mask)
    # The scale's two bytes after the codes, little-endian: one 16-bit store at an even
    # offset (head_dim and every stride are even, so the address is 2-byte aligned).
    scale_ptr = (cache_ptr + row_off + HEAD_DIM).to(tl.pointer_type(tl.int16))  # [ROWS, 1]
    tl.store(scale_ptr, scale_bits.to(tl.int16)[:, None], mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 2 when KV_QUANT)]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim (+ 2 when KV_QUANT)]
    slot_mapping_ptr,  # [num_tokens] int64 or int32: block_id * block_size + offset, < 0 = skip
    num_kv_heads,
    stride_k_token: tl.int64,
    stride_k_head: tl.int64,
    stride_v_token: tl.int64,
    stride_v_head: tl.int64,
    stride_cache_block: tl.int64,
    stride_cache_token: tl.int64,
    stride_cache_head: tl.int64,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    KV_QUANT: tl.constexpr,  # 0: copy the values; 1: quantize to int8 rows; 2: to fp8 rows
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_HEADS)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (heads < num_kv_heads)[:, None]
    heads64 = heads.to(tl.int64)[:, None]
    # [BLOCK_HEADS, 1]: each (token, head) row's first element in the cache
    row_off = block_id * stride_cache_block + offset * stride_cache_token + heads64 * stride_cache_head
    if KV_QUANT == 0:
        cache_offs = row_off + offs_d[None, :]
        k = tl.load(key_ptr + token * stride_k_token + heads64 * stride_k_head + offs_d[None, :], mask=mask)
        tl.store(key_cache_ptr + cache_offs, k, mask=mask)
        v = tl.load(value_ptr + token * stride_v_token + heads64 * stride_v_head + offs_d[None, :], mask=mask)
        tl.store(value_cache_ptr + cache_offs, v, mask=mask)
    else:
        k_offs = token * stride_k_token + heads64 * stride_k_head + offs_d[None, :]
        k = tl.load(key_ptr + k_offs, mask=mask, other=0.0)
        _store_quantized_rows(key_cache_ptr, row_off, k, mask, HEAD_DIM, KV_QUANT)
        v_offs = token * stride_v_token + heads64 * stride_v_head + offs_d[None, :]
        v = tl.load(value_ptr + v_offs, mask=mask, other=0.0)
        _store_quantized_rows(value_cache_ptr, row_off, v, mask, HEAD_DIM, KV_QUANT)


def check_reshape_and_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Shapes, dtypes, layouts and devices; raises ValueError (slot values are not read).

    The caches hold values in key's dtype ([.., head_dim]) or quantized rows (int8 / uint8,
    [.., head_dim + 2]: `kernels.kv_quant`) of key/value in any supported float dtype.
    """
    if key.dim() != 3 or key_cache.dim() != 4:
        raise ValueError(
            f"key must be [num_tokens, num_kv_heads, head_dim] and key_cache [num_blocks, block_size, "
            f"num_kv_heads, head_dim], got {tuple(key.shape)} and {tuple(key_cache.shape)}"
        )
    if value.shape != key.shape or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value {tuple(value.shape)} / value_cache {tuple(value_cache.shape)} must match "
            f"key {tuple(key.shape)} / key_cache {tuple(key_cache.shape)}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, cache_kv_heads, cache_row = key_cache.shape
    quantized = kv_quant.is_quantized(key_cache)
    if quantized:
        if key.dtype not in SUPPORTED_DTYPES or value.dtype != key.dtype:
            raise ValueError(
                f"key and value must share a dtype among float16, bfloat16 and float32 (quantized into the "
                f"{kv_quant.kind_of(key_cache)} cache), got {key.dtype} and {value.dtype}"
            )
        check_quantized_caches(key_cache, value_cache, head_dim)
        cache_head_dim = cache_row - kv_quant.SCALE_BYTES
    else:
        if key_cache.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be float16, bfloat16 or float32 (or an int8 / uint8 quantized cache), "
                f"got {key_cache.dtype}"
            )
        if any(t.dtype != key_cache.dtype for t in (key, value, value_cache)):
            raise ValueError(
                f"key, value and caches must share a dtype, got {key.dtype}, {value.dtype}, "
                f"{key_cache.dtype}, {value_cache.dtype}"
            )
        cache_head_dim = cache_row
    if head_dim not in SUPPORTED_HEAD_DIMS or (cache_kv_heads, cache_head_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"head_dim must be 64, 128 or 256 and key [.., {num_kv_heads}, {head_dim}] must match the cache's "
            f"[.., {cache_kv_heads}, {cache_row}]" + (" (head_dim + 2 per row: quantized)" if quantized else "")
        )
    if block_size < 1 or block_size & (block_size - 1) or block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], got {block_size}")
    if slot_mapping.dtype not in (torch.int64, torch.int32) or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"slot_mapping must be int64 or int32 of shape ({num_tokens},), got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}"
        )
    if not (key_cache.is_contiguous() and value_cache.is_contiguous() and slot_mapping.is_contiguous()):
        raise ValueError("key_cache, value_cache and slot_mapping must be contiguous")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must be contiguous in head_dim (stride 1)")
    tensors = (key, value, key_cache, value_cache, slot_mapping)
    if any(t.device != key.device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    check_device_runs_triton(key.device)


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or head_dim + 2 quantized
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], or head_dim + 2 quantized
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; -1 = skip
) -> None:
    """`kernels.reference.reshape_and_cache` in Triton; slot -1 skips the token.

    Into an int8 / uint8 cache each (token, KV head) row is quantized as `kv_quant.quantize`
    writes it (codes + bf16 scale), bit for bit.
    """
    check_reshape_and_cache_args(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        key_cache_ptr=key_cache,
        value_cache_ptr=value_cache,
        slot_mapping_ptr=slot_mapping,
        num_kv_heads=num_kv_heads,
        stride_k_token=key.stride(0),
        stride_k_head=key.stride(1),
        stride_v_token=value.stride(0),
        stride_v_head=value.stride(1),
        stride_cache_block=key_cache.stride(0),
        stride_cache_token=key_cache.stride(1),
        stride_cache_head=key_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        KV_QUANT=kv_quant_mode(key_cache),
        num_warps=4,
    )
