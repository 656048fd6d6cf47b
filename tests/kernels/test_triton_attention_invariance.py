"""Batch invariance of the Triton attention (`--batch-invariant`): a query row's output bits
do not depend on the step around it.

The same sequence (its keys, values and queries drawn from its own generator) is run in
steps of different shapes, as the engine builds them: a decode alone, a decode beside 1, 3,
8 and 32 other sequences (long ones among them, so the default config would split the keys),
the block table padded as wide as CUDA graphs pad it, its blocks elsewhere in the cache (a
prefix-cache hit), and the same position as a row of a prefill chunk of 16 or 64 tokens or
of the whole prompt. In invariant mode every one of these gives the same bits for that
position; the last test shows the comparison has teeth: the default config does not.

Without CUDA the kernel runs in the Triton interpreter in float32 (small shapes); with CUDA
compiled in bf16, where the default config's split-K and tile choices change the bits too.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.triton_attention import choose_config, paged_attention  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("kernels.triton_attention was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE, DTYPE = ("cuda", torch.bfloat16) if ON_CUDA else ("cpu", torch.float32)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 6, 2, 64, 16
# The position under test: past 512 keys, so the default config splits a decode's keys.
TARGET_LEN = 600


class Sequence:
    """One sequence's keys, values and per-position queries, the same in every step."""

    def __init__(self, seed: int, length: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.keys = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=g).to(DTYPE)
        self.values = torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=g).to(DTYPE)
        self.queries = torch.randn(length, NUM_HEADS, HEAD_DIM, generator=g).to(DTYPE)


def run_step(
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
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)) if shuffle_blocks else torch.arange(num_blocks)
    # Slots nobody owns hold garbage, as a freed block would.
    key_cache = torch.full((num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), float("nan"), dtype=DTYPE)
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
    query = torch.cat(queries).to(DEVICE)
    out = paged_attention(
        query, key_cache.to(DEVICE), value_cache.to(DEVICE), table.to(DEVICE),
        torch.tensor([s for _, s, _ in parts], dtype=torch.int32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int32, device=DEVICE), HEAD_DIM**-0.5,
        sliding_window=window, invariant=invariant,
    ).cpu()
    return [out[starts[i] : starts[i + 1]] for i in range(len(parts))]


TARGET = Sequence(seed=0, length=TARGET_LEN + 40)
OTHERS = [Sequence(seed=100 + i, length=700) for i in range(32)]


def other_decodes(n: int) -> list[tuple[Sequence, int, int]]:
    """n other decodes of mixed lengths, long ones among them (30 .. 690 keys)."""
    return [(OTHERS[i], 30 + (i * 97) % 661, 1) for i in range(n)]


def target_row_in_each_step(invariant: bool, window: int | None = None) -> dict[str, torch.Tensor]:
    """The output row of TARGET's query at position TARGET_LEN - 1 in each kind of step."""
    p = TARGET_LEN  # keys cached when the row is computed (its own included)
    rows = {}

    def decode(name: str, parts: list, index: int = 0, **kw) -> None:
        rows[name] = run_step(parts, invariant=invariant, window=window, **kw)[index][-1]

    decode("decode alone", [(TARGET, p, 1)])
    for n in (1, 3, 8, 32):
        decode(f"decode beside {n}", [*other_decodes(n)[: n // 2], (TARGET, p, 1), *other_decodes(n)[n // 2 :]], n // 2)
    decode("decode, table as wide as a CUDA graph's", [(TARGET, p, 1), *other_decodes(3)], table_width=64)
    decode("decode, blocks elsewhere (prefix-cache hit)", [(TARGET, p, 1)], shuffle_blocks=True)
    decode("decode beside a prefill chunk", [(OTHERS[0], 200, 64), (TARGET, p, 1)], 1)
    for chunk in (16, 64):
        # The row as the last of a chunk, and as a row inside a chunk that runs past it.
        rows[f"last row of a {chunk}-token chunk"] = run_step([(TARGET, p, chunk)], invariant=invariant, window=window)[0][-1]
        inside = run_step([(TARGET, p + 5, chunk)], invariant=invariant, window=window)[0]
        rows[f"row inside a {chunk}-token chunk"] = inside[chunk - 6]
    if not ON_CUDA:  # the interpreter's cost is quadratic in the prompt: one whole prefill
        whole = run_step([(TARGET, p, p)], invariant=invariant, window=window, shuffle_blocks=True)[0]
        rows["whole prompt in one prefill"] = whole[-1]
    return rows


def differing(rows: dict[str, torch.Tensor]) -> list[str]:
    base = rows["decode alone"]
    return [name for name, row in rows.items() if not torch.equal(row, base)]


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_a_row_is_the_same_bits_in_every_step_shape(window: int | None) -> None:
    rows = target_row_in_each_step(invariant=True, window=window)
    assert not any(row.isnan().any() for row in rows.values())
    assert differing(rows) == []


def test_invariant_config_is_one_config_whatever_the_batch() -> None:
    configs = {
        choose_config(tokens, seqs, 2, 3, 64, max_context=context, invariant=True)
        for tokens, seqs in ((1, 1), (3, 3), (64, 64), (100, 3), (512, 1))
        for context in (16, 1040, 8192)
    }
    assert len(configs) == 1 and next(iter(configs)).num_splits == 1


def test_the_comparison_has_teeth() -> None:
    """The default config splits a lone long decode and uses decode tiles: some of the same
    steps then give other bits for the same position (what invariant mode removes)."""
    assert choose_config(1, 1, NUM_KV_HEADS, 3, HEAD_DIM, max_context=TARGET_LEN + 8).num_splits > 1
    alone = run_step([(TARGET, TARGET_LEN, 1)], invariant=False)[0][-1]
    wide = run_step([(TARGET, TARGET_LEN, 1)], invariant=False, table_width=64)[0][-1]  # 4 splits, not 2
    in_chunk = run_step([(TARGET, TARGET_LEN, 16)], invariant=False)[0][-1]  # no split, prefill tiles
    assert not torch.equal(alone, wide) or not torch.equal(alone, in_chunk), (
        "the default config gave identical bits: the test above proves nothing")
