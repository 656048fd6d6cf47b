"""CPU tensors on transparent huge pages (engine/huge_pages.py): the KV cache and the C++
kernels' packed weights. What a user would notice: the memory on 2 MB pages
(/proc/self/smaps' AnonHugePages for its mapping, where the kernel's mode lets a mapping ask
for them) and no more of it than the tensor needs, the same outputs from a weight moved
there, a cache that reads as zeros and takes writes as torch.zeros' did, the memory given
back when the tensor is dropped, PAGODA_CPU_HUGE_PAGES=0 turning it off, and the start-up
log saying which pages."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.huge_pages import (HUGE_PAGE_BYTES, copy_on_huge_pages, huge_pages_advisable, huge_pages_wanted,
                               pages_fact, transparent_huge_pages, zeros_on_huge_pages)
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from kernels import cpu_kernels

needs_thp = pytest.mark.skipif(not huge_pages_advisable(), reason=f"transparent huge pages: {transparent_huge_pages()}")


def _huge_kb_of_mapping(address: int) -> int | None:
    """AnonHugePages (kB) of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


def test_the_cache_reads_as_zeros_and_takes_writes():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16, block_size=16)
    caches = allocate_kv_cache(spec, 300, torch.device("cpu"))  # 4.7 MB a tensor
    assert len(caches) == 2
    for k, v in caches:
        for t in (k, v):
            assert t.shape == (300, 16, 8, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
            assert not t.any()
    k, v = caches[1]
    rows = torch.randn(16, 8, 64).bfloat16()
    k[3] = rows
    assert torch.equal(k[3], rows) and not v.any() and not caches[0][0].any()


@needs_thp
def test_a_large_cache_sits_on_huge_pages_and_is_given_back():
    t = zeros_on_huge_pages((512, 16, 8, 64), torch.bfloat16)  # 8 MB
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    huge_kb = _huge_kb_of_mapping(t.data_ptr())
    assert huge_kb is not None and huge_kb >= 4096, f"AnonHugePages of the cache's mapping: {huge_kb} kB"
    address = t.data_ptr()
    del t
    gc.collect()
    assert _huge_kb_of_mapping(address) is None  # the mapping is gone with the tensor


@needs_thp
@pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the packed weights need AVX512-BF16")
def test_a_packed_weight_on_huge_pages_gives_the_same_bits_and_holds_no_page_for_its_tail():
    g = torch.Generator().manual_seed(0)
    packed = cpu_kernels.pack_bf16_weight(torch.randn(1100, 2048, generator=g).bfloat16())  # 4.5 MB
    moved = copy_on_huge_pages(packed)
    assert moved.data_ptr() != packed.data_ptr() and moved.data_ptr() % HUGE_PAGE_BYTES == 0
    assert moved.untyped_storage().nbytes() == packed.untyped_storage().nbytes()
    for rows in (1, 32):
        x = torch.randn(rows, 2048, generator=g).bfloat16()
        assert torch.equal(cpu_kernels.bf16_linear(x, moved), cpu_kernels.bf16_linear(x, packed))
    huge_kb = _huge_kb_of_mapping(moved.data_ptr())
    whole_pages_kb = packed.untyped_storage().nbytes() // HUGE_PAGE_BYTES * 2048
    assert huge_kb is not None and huge_kb >= 2048
    if transparent_huge_pages() == "madvise":  # `always` may back the tail too, as it would any memory
        assert huge_kb <= whole_pages_kb


def test_a_small_tensor_stays_where_it_is():
    t = torch.randn(1000)
    assert copy_on_huge_pages(t) is t
    assert zeros_on_huge_pages((1000,), torch.float32).sum() == 0


def test_the_switch_and_the_start_up_log(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_HUGE_PAGES", "0")
    assert not huge_pages_wanted()
    assert pages_fact().startswith("on 4 KB pages")
    monkeypatch.delenv("PAGODA_CPU_HUGE_PAGES")
    assert huge_pages_wanted() == huge_pages_advisable()
    assert pages_fact().startswith("on 2 MB transparent huge pages" if huge_pages_advisable() else "on 4 KB pages")
