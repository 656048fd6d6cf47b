"""KV-cache write in Triton: scatter this step's K and V into their slots.

Same semantics and signature as `kernels.reference.reshape_and_cache`, plus: a negative
slot (-1) skips the token, so a padded batch (CUDA graphs) can carry tokens that own no
slot. One program per token copies all of its KV heads; slot x slot stride is computed
in int64 (a large cache passes 2**31 elements).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import check_device_runs_triton

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
MAX_BLOCK_SIZE = 128


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
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
    cache_offs = block_id * stride_cache_block + offset * stride_cache_token + heads64 * stride_cache_head + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_k_token + heads64 * stride_k_head + offs_d[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_offs, k, mask=mask)
    v = tl.load(value_ptr + token * stride_v_token + heads64 * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(value_cache_ptr + cache_offs, v, mask=mask)


def check_reshape_and_cache_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Shapes, dtypes, layouts and devices; raises ValueError (slot values are not read)."""
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
    _, block_size, cache_kv_heads, cache_head_dim = key_cache.shape
    if key_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {key_cache.dtype}")
    if any(t.dtype != key_cache.dtype for t in (key, value, value_cache)):
        raise ValueError(
            f"key, value and caches must share a dtype, got {key.dtype}, {value.dtype}, "
            f"{key_cache.dtype}, {value_cache.dtype}"
        )
    if head_dim not in SUPPORTED_HEAD_DIMS or (cache_kv_heads, cache_head_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"head_dim must be 64, 128 or 256 and key [.., {num_kv_heads}, {head_dim}] must match the cache's "
            f"[.., {cache_kv_heads}, {cache_head_dim}]"
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
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, block_id * block_size + offset; -1 = skip
) -> None:
    """`kernels.reference.reshape_and_cache` in Triton; slot -1 skips the token."""
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
        num_warps=4,
    )
