"""Mistral: Llama's blocks; the config's `sliding_window` (every layer) is honoured through
`ModelArgs.sliding_windows`, which each layer's attention passes to the paged attention."""

from __future__ import annotations

from engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with every layer's attention limited to the last `sliding_window` positions
    (when the config sets one; Mistral v0.2+ configs set none and attend fully)."""
