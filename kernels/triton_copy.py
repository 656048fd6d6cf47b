"""Whole-block KV copies in Triton (copy-on-write of blocks shared by a fork).

Same semantics and signature as `kernels.reference.copy_blocks`. One launch per cache
tensor (2 x layers); a program copies one BLOCK-element chunk of one (src, dst) pair, with
block offsets in int64 so a large cache passes 2**31 elements. Copy-on-write is rare (the
first write of each forked sample), so launch count is not worth fusing across layers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import check_device_runs_triton

_CHUNK = 1024


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,  # [num_blocks, block_numel] (a layer's K or V cache, flattened per block)
    mapping_ptr,  # [num_pairs, 2] int64: (src, dst) block ids
    block_numel: tl.int64,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    chunk = tl.program_id(1)
    src = tl.load(mapping_ptr + pair * 2).to(tl.int64)
    dst = tl.load(mapping_ptr + pair * 2 + 1).to(tl.int64)
    offsets = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < block_numel
    values = tl.load(cache_ptr + src * block_numel + offsets, mask=mask)
    tl.store(cache_ptr + dst * block_numel + offsets, values, mask=mask)


def copy_blocks(
    key_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, num_kv_heads, head_dim]
    value_caches: list[torch.Tensor],  # per layer, same shape
    block_mapping: torch.Tensor,  # [num_pairs, 2] int64: (src, dst) block ids
) -> None:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2 or block_mapping.dtype != torch.int64:
        raise ValueError(f"block_mapping must be [num_pairs, 2] int64, got {tuple(block_mapping.shape)} {block_mapping.dtype}")
    caches = list(key_caches) + list(value_caches)
    if not caches or block_mapping.shape[0] == 0:
        return
    first = caches[0]
    check_device_runs_triton(first.device)
    for cache in caches:
        if cache.shape != first.shape or cache.dtype != first.dtype or not cache.is_contiguous():
            raise ValueError("every KV cache tensor must be contiguous with the same shape and dtype")
        if cache.device != block_mapping.device:
            raise ValueError(f"block_mapping is on {block_mapping.device}, caches on {cache.device}")
    num_blocks = first.shape[0]
    if int(block_mapping.min()) < 0 or int(block_mapping.max()) >= num_blocks:
        raise ValueError(f"block ids must be in [0, {num_blocks})")
    block_numel = first[0].numel()
    grid = (block_mapping.shape[0], triton.cdiv(block_numel, _CHUNK))
    for cache in caches:
        _copy_blocks_kernel[grid](cache_ptr=cache, mapping_ptr=block_mapping, block_numel=block_numel, BLOCK=_CHUNK)
