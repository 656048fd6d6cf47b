"""The paged KV cache: per layer, K and V tensors of [num_blocks, block_size, kv_heads, head_dim]
in the compute dtype, or, quantized (`--kv-cache-dtype int8|fp8`), of [.., head_dim + 2]
one-byte codes with each row's bf16 scale after them (kernels/kv_quant.py)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

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
    """Per layer, the zeroed K and V tensors; on CPU on transparent huge pages where the host
    gives them (`zeros_on_huge_pages`)."""
    shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.row_width)
    if device.type == "cpu" and huge_pages_advisable():
        return [(zeros_on_huge_pages(shape, spec.dtype), zeros_on_huge_pages(shape, spec.dtype))
                for _ in range(spec.num_layers)]
    return [
        (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
        for _ in range(spec.num_layers)
    ]


# A CPU KV cache on 2 MB transparent huge pages. A decode step reads each sequence's blocks
# of every layer's K and V, blocks the block manager hands out in the order they were freed,
# so after a while a batch's blocks lie all over the cache: on 4 KB pages nearly every key
# row the attention kernel reads is a TLB miss (the 1B-class model's default 2 GiB cache is
# 524,288 such pages). 32 decode rows of that model attending over blocks spread across the
# cache took 0.85x the time on huge pages, 0.92x at 512 keys a sequence, 0.97x with the
# blocks packed together (docs/BENCHMARKS.md, "The KV cache on huge pages").
HUGE_PAGE_BYTES = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


def transparent_huge_pages() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), None where unknown."""
    try:
        text = open(_THP_SETTING).read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_pages_advisable() -> bool:
    """Whether advising a mapping for huge pages can give it any: the mode is `always` or
    `madvise` and Python's mmap has MADV_HUGEPAGE."""
    return transparent_huge_pages() in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


def cpu_pages_fact() -> str:
    """The start-up log's word on a CPU KV cache's pages: huge ones, or why not (a slower path)."""
    mode = transparent_huge_pages()
    if huge_pages_advisable():
        return f"on 2 MB transparent huge pages where the kernel has them (mode `{mode}`)"
    return (f"on 4 KB pages (transparent huge pages {'off: mode `never`' if mode == 'never' else 'unavailable'}; "
            f"attention over blocks spread across the cache is up to ~15% slower)")


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in an anonymous mapping of its own, started on a 2 MB boundary and
    advised for transparent huge pages (MADV_HUGEPAGE; the kernel's `madvise` mode, common
    in distributions, gives none to memory that does not ask). Every page is written once
    here, as torch.zeros writes its tensor, so no first touch (a 2 MB zeroing) falls inside
    a step. The tensor keeps the mapping alive; where the kernel has no huge page to give,
    the pages are ordinary ones, as torch.zeros' would be."""
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE_BYTES
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes + HUGE_PAGE_BYTES - offset)
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    tensor.zero_()
    return tensor
