"""The CPU KV cache on transparent huge pages (engine/kv_cache.py): what a user would notice
is the cache's memory on 2 MB pages (/proc/self/smaps' AnonHugePages for its mapping, where
the kernel's mode lets a mapping ask for them), a cache that reads as zeros and takes writes
like torch.zeros' did, its memory given back when the cache is dropped, and the start-up
log saying which pages it got."""

from __future__ import annotations

import gc

import pytest
import torch

from engine.kv_cache import (HUGE_PAGE_BYTES, KVCacheSpec, allocate_kv_cache, cpu_pages_fact, huge_pages_advisable,
                             transparent_huge_pages, zeros_on_huge_pages)


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
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16, block_size=16)
    caches = allocate_kv_cache(spec, 9, torch.device("cpu"))
    assert len(caches) == 2
    for k, v in caches:
        for t in (k, v):
            assert t.shape == (9, 16, 2, 16) and t.dtype == torch.bfloat16 and t.is_contiguous()
            assert not t.any()
    k, v = caches[1]
    rows = torch.randn(16, 2, 16).bfloat16()
    k[3] = rows
    assert torch.equal(k[3], rows) and not v.any() and not caches[0][0].any()


@pytest.mark.skipif(not huge_pages_advisable(), reason=f"transparent huge pages: {transparent_huge_pages()}")
def test_a_large_cache_sits_on_huge_pages_and_is_given_back():
    t = zeros_on_huge_pages((512, 16, 8, 64), torch.bfloat16)  # 8 MB
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    huge_kb = _huge_kb_of_mapping(t.data_ptr())
    assert huge_kb is not None and huge_kb >= 4096, f"AnonHugePages of the cache's mapping: {huge_kb} kB"
    address = t.data_ptr()
    del t
    gc.collect()
    assert _huge_kb_of_mapping(address) is None  # the mapping is gone with the tensor


def test_the_start_up_log_says_which_pages():
    fact = cpu_pages_fact()
    if huge_pages_advisable():
        assert fact.startswith("on 2 MB transparent huge pages")
    else:
        assert fact.startswith("on 4 KB pages")
