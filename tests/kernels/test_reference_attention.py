"""kernels/reference.py against a dense float64 attention written independently here.

The reference ops are the CPU path and the semantics every Triton kernel will be tested
against, so they get the awkward cases: odd context lengths around block boundaries,
block size 1, GQA ratios 1/3/8, mixed decode + chunked-prefill batches, shuffled and very
high block ids, and an output buffer poisoned with NaN so a row left unwritten fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kernels.reference import paged_attention, reshape_and_cache

ATOL = 1e-5
RTOL = 1e-5

CONTEXT_LENS = [1, 15, 16, 17, 1025]
BLOCK_SIZES = [1, 16, 32]
# (num_heads, num_kv_heads): GQA ratios 1, 3 and 8.
HEAD_CONFIGS = [(2, 2), (6, 2), (8, 1)]
HEAD_DIMS = [64, 128]


@dataclass(repr=False)  # a failing case would otherwise print whole caches
class Batch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence, contiguous [seq_len, num_kv_heads, head_dim]
    values: list[torch.Tensor]
    q_lens: list[int]
    owned_slots: torch.Tensor  # [num_cache_slots] bool: slots holding some sequence's context


def make_batch(
    seqs: list[tuple[int, int]],  # (seq_len, q_len) per sequence
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int | None = None,
    block_order: str = "sequential",  # "sequential", "shuffled" or "highest"
    seed: int = 0,
) -> Batch:
    """Random K/V written into blocks block by block (not through reshape_and_cache)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    needed = sum(blocks_per_seq)
    num_blocks = num_blocks if num_blocks is not None else needed + 3
    if block_order == "sequential":
        ids = list(range(needed))
    elif block_order == "shuffled":
        ids = torch.randperm(num_blocks, generator=g)[:needed].tolist()
    elif block_order == "highest":
        ids = list(range(num_blocks - 1, num_blocks - 1 - needed, -1))
    else:
        raise ValueError(block_order)

    # Every slot starts random (not zero), so reading a slot a sequence does not own shows.
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    max_blocks = max(blocks_per_seq)
    # Padding entries point at block 0, as the engine pads; block 0 may belong to another sequence.
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    keys, values = [], []
    cursor = 0
    for i, ((seq_len, _), nb) in enumerate(zip(seqs, blocks_per_seq)):
        table = ids[cursor : cursor + nb]
        cursor += nb
        block_tables[i, :nb] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g)
        for j, block in enumerate(table):
            lo, hi = j * block_size, min((j + 1) * block_size, seq_len)
            key_cache[block, : hi - lo] = k[lo:hi]
            value_cache[block, : hi - lo] = v[lo:hi]
            owned[block, : hi - lo] = True
        keys.append(k)
        values.append(v)

    q_lens = [q_len for _, q_len in seqs]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return Batch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        keys=keys,
        values=values,
        q_lens=q_lens,
        owned_slots=owned.view(-1),
    )


def ref_paged_attention(batch: Batch, scale: float, window: int | None = None) -> torch.Tensor:
    """Dense causal attention per sequence in float64 over its contiguous K/V; with a
    `window` W, a query at p sees only keys p - W < k <= p."""
    num_heads = batch.query.shape[1]
    outs = []
    start = 0
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = batch.query[start : start + q_len].double()
        start += q_len
        k = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        hidden = torch.arange(seq_len)[None, :] > q_pos[:, None]  # [q_len, seq_len]: the future
        if window is not None:
            hidden |= torch.arange(seq_len)[None, :] <= q_pos[:, None] - window  # and outside the window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(outs).float()


def run_paged(batch: Batch, scale: float, window: int | None = None) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        out=out,
        sliding_window=window,
    )
    assert result is out
    return out


def check(batch: Batch, window: int | None = None) -> None:
    scale = batch.query.shape[-1] ** -0.5
    torch.testing.assert_close(
        run_paged(batch, scale, window), ref_paged_attention(batch, scale, window), atol=ATOL, rtol=RTOL
    )


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seq_len", CONTEXT_LENS, ids=lambda n: f"ctx{n}")
def test_decode(seq_len: int, block_size: int) -> None:
    # A second, shorter decode in the batch pads its block table row with block 0.
    check(make_batch([(seq_len, 1), (3, 1)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size))


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seq_len", CONTEXT_LENS, ids=lambda n: f"ctx{n}")
def test_full_prefill(seq_len: int, block_size: int) -> None:
    check(make_batch([(seq_len, seq_len)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size))


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seq_len", [16, 17, 1025], ids=lambda n: f"ctx{n}")
def test_prefill_chunk_after_cached_tokens(seq_len: int, block_size: int) -> None:
    # The chunk starts mid-block: its first query token sees cached tokens of its own block.
    q_len = seq_len - 7
    check(make_batch([(seq_len, q_len)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size))


@pytest.mark.parametrize("head_dim", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("heads", HEAD_CONFIGS, ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_gqa_mixed_batch(heads: tuple[int, int], head_dim: int) -> None:
    num_heads, num_kv_heads = heads
    seqs = [(17, 1), (40, 9), (1, 1), (33, 33), (16, 1)]
    check(make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16))


MIXED_BATCHES = {
    "decodes_then_chunks": [(15, 1), (17, 1), (1, 1), (100, 37), (64, 64), (1025, 1)],
    "chunks_then_decodes": [(33, 2), (5, 5), (48, 1), (129, 1), (31, 30)],
    "interleaved": [(2, 1), (90, 45), (16, 1), (3, 3), (1025, 100), (200, 1)],
}


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("seqs", list(MIXED_BATCHES.values()), ids=list(MIXED_BATCHES))
def test_mixed_decode_and_prefill_batch(seqs: list[tuple[int, int]], block_size: int) -> None:
    check(make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size, seed=1))


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
def test_shuffled_block_table(block_size: int) -> None:
    seqs = [(37, 1), (70, 20), (16, 16), (5, 1)]
    needed = sum(math.ceil(s / block_size) for s, _ in seqs)
    check(
        make_batch(
            seqs,
            num_heads=8,
            num_kv_heads=1,
            head_dim=64,
            block_size=block_size,
            num_blocks=2 * needed + 5,
            block_order="shuffled",
            seed=2,
        )
    )


def test_highest_block_ids_of_a_large_cache() -> None:
    # 2**16 + 5 blocks; the sequences live in the last blocks, the table lists them backwards.
    seqs = [(33, 1), (20, 20), (9, 4)]
    check(
        make_batch(
            seqs,
            num_heads=2,
            num_kv_heads=1,
            head_dim=64,
            block_size=4,
            num_blocks=2**16 + 5,
            block_order="highest",
            seed=3,
        )
    )


@pytest.mark.parametrize(
    "seqs",
    [[(17, 1), (3, 1)], [(40, 9)], [(17, 1), (40, 9), (5, 5)]],
    ids=["decodes", "prefill_chunk", "mixed"],
)
def test_slots_not_owned_do_not_leak(seqs: list[tuple[int, int]]) -> None:
    # Block-tail slots past seq_len and padded table entries (block 0) can hold anything a
    # freed block left behind. Non-finite garbage there must not reach the output.
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=4)
    flat_k = batch.key_cache.view(-1, 2, 64)
    flat_v = batch.value_cache.view(-1, 2, 64)
    flat_k[~batch.owned_slots] = float("nan")
    flat_v[~batch.owned_slots] = float("inf")
    check(batch)


@pytest.mark.parametrize("block_size", BLOCK_SIZES, ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("num_tokens", [1, 17, 100], ids=lambda n: f"tokens{n}")
def test_reshape_and_cache_writes_exactly_the_mapped_slots(num_tokens: int, block_size: int) -> None:
    g = torch.Generator().manual_seed(5)
    num_blocks, num_kv_heads, head_dim = 40 * 32 // block_size + 1, 2, 64
    num_slots = num_blocks * block_size
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    slot_mapping = torch.randperm(num_slots, generator=g)[:num_tokens].to(torch.int64)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    for slot, k, v in zip(slot_mapping.tolist(), key, value):
        block, offset = divmod(slot, block_size)
        torch.testing.assert_close(key_cache[block, offset], k, atol=0, rtol=0)
        torch.testing.assert_close(value_cache[block, offset], v, atol=0, rtol=0)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert key_cache.view(num_slots, -1)[untouched].isnan().all()
    assert value_cache.view(num_slots, -1)[untouched].isnan().all()


def test_reshape_and_cache_highest_slots_of_a_large_cache() -> None:
    block_size, num_blocks = 16, 2**16 + 1
    num_slots = num_blocks * block_size
    key_cache = torch.full((num_blocks, block_size, 1, 8), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    slot_mapping = torch.tensor([num_slots - 1, num_slots - block_size - 3, 2**20 + 7], dtype=torch.int64)
    key = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(6))
    value = torch.randn(3, 1, 8, generator=torch.Generator().manual_seed(7))

    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    torch.testing.assert_close(key_cache.view(num_slots, 1, 8)[slot_mapping], key, atol=0, rtol=0)
    torch.testing.assert_close(value_cache.view(num_slots, 1, 8)[slot_mapping], value, atol=0, rtol=0)
    assert int((~key_cache.isnan()).sum()) == key.numel()
    assert int((~value_cache.isnan()).sum()) == value.numel()


def test_reference_check_catches_a_wrong_block_table() -> None:
    # The comparison above must be able to fail: swap two sequences' block rows.
    batch = make_batch([(40, 1), (40, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    batch.block_tables = batch.block_tables.flip(0).contiguous()
    scale = 64**-0.5
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run_paged(batch, scale), ref_paged_attention(batch, scale), atol=ATOL, rtol=RTOL)


def test_plans_reused_within_a_forward_scope_follow_the_metadata():
    """Inside one forward (`reuse_attention_plans`) the layers share one gather plan; a
    different batch's metadata, or a non-contiguous query (q sliced from the fused q/k
    rotation), still gets its own correct answer, and nothing is kept after the scope."""
    from kernels.reference import _plans, reuse_attention_plans

    decodes = make_batch([(17, 1), (33, 1), (5, 1)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, seed=1)
    mixed = make_batch([(40, 7), (16, 1), (9, 9)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, seed=2)
    scale = 0.125
    with reuse_attention_plans():
        for _ in range(2):  # "two layers" of the same step
            for batch in (decodes, mixed):
                torch.testing.assert_close(run_paged(batch, scale), ref_paged_attention(batch, scale), atol=ATOL, rtol=RTOL)
        wide = torch.randn(decodes.query.shape[0], 8, 64)
        wide[:, :6] = decodes.query
        sliced = wide[:, :6]
        assert not sliced.is_contiguous()
        got = paged_attention(sliced, decodes.key_cache, decodes.value_cache, decodes.block_tables,
                              decodes.seq_lens, decodes.query_start_loc, scale)
        torch.testing.assert_close(got, ref_paged_attention(decodes, scale), atol=ATOL, rtol=RTOL)
    assert _plans.entry is None


@pytest.mark.parametrize("block_order", ["sequential", "shuffled"])
@pytest.mark.parametrize("seq_len", [1, 16, 33])
def test_single_decode_reads_consecutive_blocks_in_place(block_order, seq_len):
    """One decoding sequence whose blocks are consecutive is read without a gather; shuffled
    blocks take the gather. Both equal the dense attention."""
    check(make_batch([(seq_len, 1)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, block_order=block_order, seed=seq_len))


# Sliding windows smaller and larger than the block size (16), and one wider than every
# context (the same as none): decodes, full prefills, chunks after cached tokens, mixed.
WINDOWS = [1, 5, 16, 23, 2000]
WINDOW_BATCHES = {
    "decodes": [(40, 1), (3, 1), (17, 1), (100, 1)],
    "prefills": [(40, 40), (7, 7), (33, 33)],
    "chunks": [(60, 20), (33, 9), (100, 37)],
    "mixed": [(15, 1), (100, 37), (64, 64), (129, 1), (31, 30)],
}


@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("seqs", list(WINDOW_BATCHES.values()), ids=list(WINDOW_BATCHES))
def test_sliding_window(seqs: list[tuple[int, int]], window: int) -> None:
    check(make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, block_order="shuffled",
                     num_blocks=40, seed=window), window)


@pytest.mark.parametrize("seq_len", [5, 16, 40], ids=lambda n: f"ctx{n}")
def test_sliding_window_single_decode_read_in_place(seq_len: int) -> None:
    """The consecutive-blocks fast path reads only the window's keys."""
    check(make_batch([(seq_len, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, seed=seq_len), window=7)


def test_sliding_window_plans_per_window_within_a_forward_scope() -> None:
    """Alternating layers (Gemma 3: local, global, local, ...) reuse one plan per window."""
    from kernels.reference import reuse_attention_plans

    batch = make_batch([(40, 1), (20, 1), (70, 9)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=9)
    scale = 0.125
    with reuse_attention_plans():
        for window in (8, None, 8, None, 30):
            torch.testing.assert_close(
                run_paged(batch, scale, window), ref_paged_attention(batch, scale, window), atol=ATOL, rtol=RTOL
            )


def test_sliding_window_check_can_fail() -> None:
    """A window that is ignored gives visibly different outputs than the windowed reference."""
    batch = make_batch([(40, 1), (30, 12)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=10)
    scale = 64**-0.5
    with pytest.raises(AssertionError):
        torch.testing.assert_close(run_paged(batch, scale), ref_paged_attention(batch, scale, 8), atol=ATOL, rtol=RTOL)
    with pytest.raises(ValueError, match="sliding_window"):
        run_paged(batch, scale, 0)
