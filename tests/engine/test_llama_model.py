"""engine/models/llama.py, loaded by engine.loader, against transformers' LlamaForCausalLM.

Tiny random checkpoints saved by Hugging Face, run through our model over a real paged KV
cache: one full prefill, then a chunked prefill followed by decodes, logits compared with
HF's full-sequence logits at every position we compute.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.loader import load_model
from engine.models.llama import LlamaForCausalLM, RotaryEmbedding
from kernels.ops import get_ops

ATOL = 1e-4
RTOL = 1e-4
MAX_POSITIONS = 128
BLOCK_SIZE = 16
NUM_BLOCKS = 12
CPU = torch.device("cpu")

ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    # Wavelengths of head_dim 16 at theta 1e4 span 6 to 6e4, so with an original context
    # of 32 the high (kept), medium (blended) and low (slowed) bands are all exercised.
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}

CASES = {
    "default-untied": ("default", False, 2),
    "default-tied": ("default", True, 3),
    "linear-untied": ("linear", False, 2),
    "llama3-tied": ("llama3", True, 4),
    "llama3-untied": ("llama3", False, 2),
}


def save_hf_model(path: Path, rope: str, tied: bool, num_layers: int) -> HFLlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=MAX_POSITIONS,
        rope_parameters=dict(ROPE[rope]),
        tie_word_embeddings=tied,
        # Large weights make attention sharp, so a wrong position encoding moves the logits.
        initializer_range=0.3,
        attn_implementation="eager",
    )
    model = HFLlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def hf_logits(model: HFLlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids[None, :]).logits[0].float()


def input_ids_of(length: int) -> torch.Tensor:
    return torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(length))


def block_table(num_tokens: int) -> list[int]:
    # Blocks out of order, none of them block 0, so a table/slot mix-up shows.
    order = [7, 2, 11, 4, 9, 1, 10, 3]
    return order[: (num_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE]


class PagedRunner:
    """One sequence over a real paged KV cache, fed in steps of any number of tokens."""

    def __init__(self, model: LlamaForCausalLM, total_tokens: int) -> None:
        self.model = model
        spec = KVCacheSpec.from_model(model.args, torch.float32, BLOCK_SIZE)
        self.kv_caches = allocate_kv_cache(spec, NUM_BLOCKS, CPU)
        self.ops = get_ops("torch", CPU)
        self.table = block_table(total_tokens)
        self.num_computed = 0

    def step(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Run the next len(input_ids) tokens; returns logits for each of them."""
        n = input_ids.shape[0]
        positions = torch.arange(self.num_computed, self.num_computed + n)
        slots = [self.table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions.tolist()]
        self.num_computed += n
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=torch.tensor([self.table], dtype=torch.int32),
            seq_lens=torch.tensor([self.num_computed], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            logits_indices=torch.arange(n, dtype=torch.int64),
        )
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.ops)
        return self.model.compute_logits(hidden).float()


@pytest.mark.parametrize(("rope", "tied", "num_layers"), list(CASES.values()), ids=list(CASES))
def test_prefill_logits_match_hf(tmp_path: Path, rope: str, tied: bool, num_layers: int) -> None:
    hf = save_hf_model(tmp_path, rope, tied, num_layers)
    model = load_model(tmp_path, torch.float32, CPU, MAX_POSITIONS)
    assert model.args.tie_word_embeddings is tied
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied

    T = 80  # beyond llama3's original context of 32
    ids = input_ids_of(T)
    expected = hf_logits(hf, ids)
    ours = PagedRunner(model, T).step(ids)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=RTOL)

    if rope != "default":
        # The scaled case must be able to fail: unscaled RoPE gives visibly different logits.
        model.rope = RotaryEmbedding(replace(model.args, rope_scaling=None), MAX_POSITIONS)
        unscaled = PagedRunner(model, T).step(ids)
        assert (unscaled - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_chunked_prefill_then_decodes_match_hf(tmp_path: Path, rope: str) -> None:
    hf = save_hf_model(tmp_path, rope, tied=False, num_layers=3)
    model = load_model(tmp_path, torch.float32, CPU, MAX_POSITIONS)
    T = 60
    ids = input_ids_of(T)
    expected = hf_logits(hf, ids)

    runner = PagedRunner(model, T)
    # Chunk boundaries mid-block (21, then 57 = 3 blocks + 9): the second chunk and every
    # decode read the first chunk's K/V back from the cache.
    chunks = [(0, 21), (21, 57), (57, 58), (58, 59), (59, 60)]
    for start, end in chunks:
        logits = runner.step(ids[start:end])
        torch.testing.assert_close(logits, expected[start:end], atol=ATOL, rtol=RTOL, msg=lambda m: f"tokens {start}..{end}: {m}")
