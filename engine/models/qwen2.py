"""Qwen2 / Qwen2.5: Llama's blocks with biases on the q, k and v projections (none on o).

transformers' Qwen2 hardcodes those biases rather than reading them from the config, so
this module sets them. Sliding-window layers (`use_sliding_window`, `max_window_layers`)
come from the config's `layer_types` through `ModelArgs.sliding_windows`.
"""

from __future__ import annotations

import dataclasses

from engine.models.args import ModelArgs
from engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__(dataclasses.replace(args, qkv_bias=True), max_positions)
