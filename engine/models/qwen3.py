"""Qwen3: Llama's blocks with an RMSNorm over each q and k head before RoPE, and a
`head_dim` set by the config, independent of hidden_size / num_heads.

transformers' Qwen3 always has the q/k norms (its config does not say), so this module
sets them; `attention_bias` (all four projections) is read from the config as for Llama.
"""

from __future__ import annotations

import dataclasses

from engine.models.args import ModelArgs
from engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__(dataclasses.replace(args, qk_norm=True), max_positions)
