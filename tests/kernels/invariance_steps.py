"""Steps of different shapes around one query position, for the attention kernels' batch-
invariance tests (tests/kernels/test_triton_attention_invariance.py, test_cpu_attention_invariance.py).

The same sequence (its keys, values and queries drawn from its own generator) is run in
steps of different shapes, as the engine builds them: a decode alone, a decode beside 1, 3,
8 and 32 other sequences (long ones among them, so a split-K or thread-split route would
split the keys), the block table padded as wide as CUDA graphs pad it, its blocks elsewhere
in the cache (a prefix-cache hit), and the same position as a row of a prefill chunk of 16
or 64 tokens or of the whole prompt. `attention` is the kernel under test, with the
reference op's signature plus `sliding_window` and `invariant`.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 64, 16
# The position under test: past 512 keys, so a default route splits a decode's keys.
TARGET_LEN = 600


class Sequence:
    """One sequence's keys, values and per-position queries, the same in every step."""

    def __init__(self, seed: int, length: int, dtype: torch.dtype) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        self.values = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype)
        self.queries = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=g).to(dtype)


class Steps:
    """The target sequence and the others, for one kernel, dtype and device."""

    def __init__(self, attention: Callable, dtype: torch.dtype, device: str) -> None:
        self.attention, self.dtype, self.device = attention, dtype, device
        self.target = Sequence(seed=0, length=TARGET_LEN + 40, dtype=dtype)
        self.others = [Sequence(seed=100 + i, length=700, dtype=dtype) for i in range(32)]

    def run_step(
        self,
        parts: list[tuple[Sequence, int, int]],  # (sequence, seq_len: keys cached so far, q_len)
        *,
        invariant: bool,
        table_width: int | None = None,  # blocks per table row (CUDA graphs: max_model_len's)
        shuffle_blocks: bool = False,  # the sequences' blocks at other places in the cache
        window: int | None = None,
    ) -> list[torch.Tensor]:
        """One step's attention; each part's output rows [q_len, heads, head_dim] on CPU."""
        blocks = [math.ceil(seq_len / BLOCK_SIZE) for _, seq_len, _ in parts]
        width = table_width or max(blocks)
        num_blocks = sum(blocks) + 2
        order = (torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)) if shuffle_blocks
                 else torch.arange(num_blocks))
        # Slots nobody owns hold garbage, as a freed block would.
        key_cache = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=self.dtype)
        value_cache = torch.full_like(key_cache, float("inf"))
        table = torch.zeros(len(parts), width, dtype=torch.int32)
        queries, cursor = [], 0
        for i, ((seq, seq_len, q_len), n) in enumerate(zip(parts, blocks)):
            ids = order[cursor : cursor + n]
            cursor += n
            table[i, :n] = ids.to(torch.int32)
            for j, block in enumerate(ids.tolist()):
                lo, hi = j * BLOCK_SIZE, min((j + 1) * BLOCK_SIZE, seq_len)
                key_cache[block, : hi - lo] = seq.keys[lo:hi]
                value_cache[block, : hi - lo] = seq.values[lo:hi]
            queries.append(seq.queries[seq_len - q_len : seq_len])
        starts = [0]
        for _, _, q_len in parts:
            starts.append(starts[-1] + q_len)
        device = self.device
        out = self.attention(
            torch.cat(queries).to(device), key_cache.to(device), value_cache.to(device), table.to(device),
            torch.tensor([s for _, s, _ in parts], dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device), HEAD_DIM**-0.5,
            sliding_window=window, invariant=invariant,
        ).cpu()
        return [out[starts[i] : starts[i + 1]] for i in range(len(parts))]

    def other_decodes(self, n: int) -> list[tuple[Sequence, int, int]]:
        """n other decodes of mixed lengths, long ones among them (30 .. 690 keys)."""
        return [(self.others[i], 30 + (i * 97) % 661, 1) for i in range(n)]

    def target_row_in_each_step(self, invariant: bool, window: int | None = None,
                                whole_prompt: bool = True) -> dict[str, torch.Tensor]:
        """The output row of the target's query at position TARGET_LEN - 1 in each kind of step."""
        p = TARGET_LEN  # keys cached when the row is computed (its own included)
        target, rows = self.target, {}

        def decode(name: str, parts: list, index: int = 0, **kw) -> None:
            rows[name] = self.run_step(parts, invariant=invariant, window=window, **kw)[index][-1]

        decode("decode alone", [(target, p, 1)])
        for n in (1, 3, 8, 32):
            others = self.other_decodes(n)
            decode(f"decode beside {n}", [*others[: n // 2], (target, p, 1), *others[n // 2 :]], n // 2)
        decode("decode, table as wide as a CUDA graph's", [(target, p, 1), *self.other_decodes(3)], table_width=64)
        decode("decode, blocks elsewhere (prefix-cache hit)", [(target, p, 1)], shuffle_blocks=True)
        decode("decode beside a prefill chunk", [(self.others[0], 200, 64), (target, p, 1)], 1)
        for chunk in (16, 64):
            # The row as the last of a chunk, and as a row inside a chunk that runs past it.
            rows[f"last row of a {chunk}-token chunk"] = self.run_step([(target, p, chunk)], invariant=invariant,
                                                                       window=window)[0][-1]
            inside = self.run_step([(target, p + 5, chunk)], invariant=invariant, window=window)[0]
            rows[f"row inside a {chunk}-token chunk"] = inside[chunk - 6]
        if whole_prompt:
            whole = self.run_step([(target, p, p)], invariant=invariant, window=window, shuffle_blocks=True)[0]
            rows["whole prompt in one prefill"] = whole[-1]
        return rows


def differing(rows: dict[str, torch.Tensor]) -> list[str]:
    base = rows["decode alone"]
    return [name for name, row in rows.items() if not torch.equal(row, base)]
