"""The paged KV cache: per layer, K and V tensors of [num_blocks, block_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.llama import ModelArgs

GiB = 1 << 30
_DEFAULT_CPU_BUDGET_GIB = 2.0
_GPU_MEMORY_FRACTION = 0.9


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_model(cls, args: ModelArgs, dtype: torch.dtype, block_size: int) -> "KVCacheSpec":
        return cls(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, dtype, block_size)

    @property
    def bytes_per_token(self) -> int:
        # 2 (K and V) x layers x kv_heads x head_dim x bytes per element. With GQA this is
        # smaller than 2 x layers x hidden_size x bytes by the query/KV head ratio.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_budget(self, budget_bytes: float) -> int:
        return int(budget_bytes // self.bytes_per_block)


def kv_cache_budget_bytes(kv_cache_memory_gib: float | None, device: torch.device) -> float:
    if kv_cache_memory_gib is not None:
        return kv_cache_memory_gib * GiB
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free * _GPU_MEMORY_FRACTION
    return _DEFAULT_CPU_BUDGET_GIB * GiB


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
