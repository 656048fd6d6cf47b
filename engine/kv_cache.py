"""The paged KV cache: per layer, K and V tensors of [num_blocks, block_size, kv_heads, head_dim]
in the compute dtype, or, quantized (`--kv-cache-dtype int8|fp8`), of [.., head_dim + 2]
one-byte codes with each row's bf16 scale after them (kernels/kv_quant.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.huge_pages import huge_pages_wanted, zeros_on_huge_pages
from engine.models.llama import ModelArgs
from kernels import kv_quant

GiB = 1 << 30
_DEFAULT_CPU_BUDGET_GIB = 2.0
_GPU_MEMORY_FRACTION = 0.9


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    """The cache tensors' element type: the compute dtype, or int8 / uint8 (FP8 bits) when quantized."""
    block_size: int

    @classmethod
    def from_model(cls, args: ModelArgs, dtype: torch.dtype, block_size: int,
                   kv_cache_dtype: str = "auto") -> "KVCacheSpec":
        return cls(args.num_hidden_layers, args.num_key_value_heads, args.head_dim,
                   kv_quant.storage_dtype(kv_cache_dtype, dtype), block_size)

    @property
    def quantized(self) -> bool:
        return self.dtype in (torch.int8, torch.uint8)

    @property
    def row_width(self) -> int:
        """Elements of one (token, KV head) row: head_dim, or head_dim codes + the scale's 2 bytes."""
        return kv_quant.row_width(self.head_dim, self.quantized)

    @property
    def bytes_per_token(self) -> int:
        # 2 (K and V) x layers x kv_heads x head_dim x bytes per element (+ a quantized row's
        # 2-byte scale). With GQA this is smaller than 2 x layers x hidden_size x bytes by the
        # query/KV head ratio.
        return 2 * self.num_layers * self.num_kv_heads * self.row_width * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for_budget(self, budget_bytes: float) -> int:
        return int(budget_bytes // self.bytes_per_block)

    def arithmetic(self) -> str:
        """How bytes_per_token comes about, for the start-up log."""
        head = (f"({self.head_dim} x 1 byte + a {kv_quant.SCALE_BYTES}-byte scale)" if self.quantized
                else f"{self.head_dim} x {self.dtype.itemsize} bytes")
        return f"2 x {self.num_layers} layers x {self.num_kv_heads} KV heads x {head}"


def kv_cache_budget_bytes(kv_cache_memory_gib: float | None, device: torch.device) -> float:
    if kv_cache_memory_gib is not None:
        return kv_cache_memory_gib * GiB
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free * _GPU_MEMORY_FRACTION
    return _DEFAULT_CPU_BUDGET_GIB * GiB


def allocate_kv_cache(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the zeroed K and V tensors; on CPU on 2 MB transparent huge pages where the
    kernel gives them (engine/huge_pages.py): the block manager hands blocks out in the order
    they were freed, so after a while a batch's blocks lie all over the cache, and on 4 KB
    pages nearly every key row the attention kernel reads is a TLB miss (the 1B-class model's
    default 2 GiB cache is 524,288 such pages). 32 decode rows of that model attending over
    blocks spread across the cache took 0.89x the time on huge pages, 0.93x at 512 keys a
    sequence, 1.00x with the blocks packed together (docs/BENCHMARKS.md, "The KV cache on
    huge pages")."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
    if device.type == "cpu" and huge_pages_wanted():
        return [(zeros_on_huge_pages(shape, spec.dtype), zeros_on_huge_pages(shape, spec.dtype))
                for _ in range(spec.num_layers)]
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]
