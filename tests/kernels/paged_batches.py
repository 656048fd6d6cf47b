"""Paged-attention test batches in any dtype/device, and a dense float64 reference.

Shared by the Triton kernel tests. Like test_reference_attention.make_batch, K/V are
written block by block into the cache (not through reshape_and_cache), and slots no
sequence owns hold random data (or NaN/inf) so reading one shows. `huge=True` builds a
cache past 2**31 elements without touching it: `torch.empty` memory is only mapped
when written, so only the blocks in use (and block 0) cost real memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(repr=False)  # a failing case would otherwise print whole caches
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_dim] float64 on CPU, as stored
    values: list[torch.Tensor]
    q_lens: list[int]
    owned_slots: torch.Tensor  # [num_blocks * block_size] bool on CPU (huge: None)

    @property
    def scale(self) -> float:
        return self.query.shape[-1] ** -0.5

    def args(self) -> tuple:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.query_start_loc)


def make_batch(
    seqs: list[tuple[int, int]],  # (seq_len, q_len) per sequence
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_blocks: int | None = None,
    block_order: str = "sequential",  # "sequential", "shuffled" or "highest"
    huge: bool = False,
    seed: int = 0,
) -> PagedBatch:
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

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if huge:
        key_cache = torch.empty(shape, dtype=dtype, device=device)
        value_cache = torch.empty(shape, dtype=dtype, device=device)
        # Blocks in use (tails past seq_len) and block 0 (table padding) hold garbage.
        for block in set(ids) | {0}:
            key_cache[block] = float("nan")
            value_cache[block] = float("inf")
        owned = None
    else:
        # Every slot starts random (not zero), so reading a slot a sequence does not own shows.
        key_cache = torch.randn(shape, generator=g).to(dtype).to(device)
        value_cache = torch.randn(shape, generator=g).to(dtype).to(device)
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
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=g).to(dtype)
        for j, block in enumerate(table):
            lo, hi = j * block_size, min((j + 1) * block_size, seq_len)
            key_cache[block, : hi - lo] = k[lo:hi].to(device)
            value_cache[block, : hi - lo] = v[lo:hi].to(device)
            if owned is not None:
                owned[block, : hi - lo] = True
        keys.append(k.double())
        values.append(v.double())

    q_lens = [q_len for _, q_len in seqs]
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    return PagedBatch(
        query=query.to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        q_lens=q_lens,
        owned_slots=owned.view(-1) if owned is not None else None,
    )


def ref_paged_attention(batch: PagedBatch, window: int | None = None) -> torch.Tensor:
    """Dense causal attention per sequence in float64 over its contiguous K/V; [num_tokens, heads, d] on CPU.
    With a `window` W, a query at p sees only keys p - W < k <= p."""
    query = batch.query.cpu().double()
    num_heads = query.shape[1]
    outs = []
    start = 0
    for k, v, q_len in zip(batch.keys, batch.values, batch.q_lens):
        seq_len = k.shape[0]
        group = num_heads // k.shape[1]
        q = query[start : start + q_len]
        start += q_len
        k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = torch.arange(seq_len - q_len, seq_len)
        hidden = torch.arange(seq_len)[None, :] > q_pos[:, None]  # [q_len, seq_len]: the future
        if window is not None:
            hidden |= torch.arange(seq_len)[None, :] <= q_pos[:, None] - window  # and outside the window
        scores = scores.masked_fill(hidden, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v))
    return torch.cat(outs)


# Tolerances against the float64 reference, by dtype. 16-bit: inputs are already rounded
# (the reference sees the stored values); the error left is the output rounding and the
# probabilities cast to the V dtype before the second dot.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close_to_reference(out: torch.Tensor, batch: PagedBatch, window: int | None = None) -> None:
    expected = ref_paged_attention(batch, window)
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCES[out.dtype])
