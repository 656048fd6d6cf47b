"""CPU tensors on 2 MB transparent huge pages.

A tensor here is an anonymous mapping of its own, started on a 2 MB boundary and advised for
huge pages (MADV_HUGEPAGE: the kernel's `madvise` mode, common in distributions, gives none
to memory that does not ask). Every page is written when the tensor is made, so no first
touch (a 2 MB zeroing) falls inside a step later. The tensor keeps its mapping alive, and
its storage is exactly its bytes (offset 0), as torch's own would be. Where the kernel has
no huge page to give, the pages are ordinary ones.

Who uses it and what it gains (docs/BENCHMARKS.md):
- the CPU KV cache (engine/kv_cache.py): a batch's blocks lie all over the cache, and on 4
  KB pages nearly every key row the attention reads is a TLB miss ("The KV cache on huge
  pages");
- the C++ kernels' packed weights, the 12-bit copies and the greedy head's int8 copy
  (engine/models/llama.py `prepack_linears`, `FusedDecodeLayers`; the INT4 packs in
  engine/quantization/linears.py): at 12-64 rows a linear streams its weight at ~7 GB/s a
  core, and on 4 KB pages the hardware prefetchers stop at every page's end ("The packed
  weights on huge pages").
"""

from __future__ import annotations

import math
import mmap
import os

import torch

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


def huge_pages_wanted() -> bool:
    """Whether the engine puts its CPU KV cache and packed weights on huge pages: where they
    are advisable, unless PAGODA_CPU_HUGE_PAGES=0 (for A/B runs)."""
    return os.environ.get("PAGODA_CPU_HUGE_PAGES", "1") != "0" and huge_pages_advisable()


def pages_fact() -> str:
    """The start-up log's word on the pages of the CPU KV cache and packed weights: huge ones,
    or why not (a slower path)."""
    mode = transparent_huge_pages()
    if huge_pages_wanted():
        return f"on 2 MB transparent huge pages where the kernel has them (mode `{mode}`)"
    why = ("PAGODA_CPU_HUGE_PAGES=0" if huge_pages_advisable() else
           "transparent huge pages off: mode `never`" if mode == "never" else "no transparent huge pages here")
    return f"on 4 KB pages ({why}; attention over spread blocks and the 12-64-row linears are slower)"


def _mapped_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` (at least one huge page) uint8 on a 2 MB boundary of a fresh anonymous mapping,
    its whole 2 MB pages advised for huge pages and its tail (under 2 MB) left on 4 KB ones,
    so no huge page is held for a few bytes (not yet written)."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE_BYTES
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed contiguous CPU tensor of `shape` on huge pages (see the module docstring);
    one under 2 MB is torch.zeros' (no huge page to fill)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = _mapped_bytes(nbytes)
    raw.zero_()
    return raw.view(dtype).view(shape)


def copy_on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` (a CPU tensor, its whole storage) copied onto huge pages: the same dtype, sizes,
    strides and storage offset over a storage of the same bytes, so checks that read the
    storage (a packed weight's trailing marker) see what they saw. One under 2 MB is `t`."""
    storage = t.untyped_storage()
    if storage.nbytes() < HUGE_PAGE_BYTES:
        return t
    raw = _mapped_bytes(storage.nbytes())
    raw.copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)))
    return torch.empty(0, dtype=t.dtype).set_(raw.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def onto_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` moved onto huge pages where the engine wants them (`huge_pages_wanted`), else `t`:
    how the engine places each packed kernel weight and copy at start-up."""
    return copy_on_huge_pages(t) if huge_pages_wanted() else t
