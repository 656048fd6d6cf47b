"""What attention needs to know about one step's flattened batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: cached tokens after this step's writes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of new tokens per seq
    logits_indices: torch.Tensor  # [num_sampled] int64: flat index of each sampling token
    # Every sampling row is greedy and the sampler reads only its argmax (sampler.py
    # `argmax_suffices`): the CPU LM head may compute exact logits only where a token can be
    # the argmax (kernels/greedy_head.py).
    argmax_only: bool = False
