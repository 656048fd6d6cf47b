"""Gemma 3 (text): Llama's attention and gated MLP with Gemma's differences.

- RMSNorm scales by (1 + w): the checkpoint stores the offset from 1 (`GemmaRMSNorm`).
- Four norms per layer: the attention's and the MLP's outputs are normalised too,
  before they join the residual stream (`Gemma3DecoderLayer`).
- Embeddings scaled by sqrt(hidden_size), rounded to the weights' dtype as transformers does.
- GeGLU MLP (`gelu_pytorch_tanh`), q/k norms, softmax scale `query_pre_attn_scalar ** -0.5`,
  head_dim from the config (256 in the released models).
- Interleaved layers from `layer_types`: sliding-window layers rotate with the local RoPE
  base (`rope_parameters["sliding_attention"]`, 10k), full-attention layers with the
  global one (1M, possibly scaled).
- Optional final logit soft-capping (in `LlamaForCausalLM.compute_logits`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from engine.models.args import ModelArgs
from engine.models.llama import DecoderLayer, LlamaForCausalLM, RotaryAt, RotaryEmbedding


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in float32 and cast back, in transformers' order of operations.
    Not an `RMSNorm`: quantization code that folds scales into a norm's weight must not
    treat this offset weight as a plain scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3DecoderLayer(DecoderLayer):
    """x + post_attn_norm(attn(input_norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, args: ModelArgs, layer: int, norm_class: type[nn.Module]) -> None:
        super().__init__(args, layer, norm_class)
        self.pre_feedforward_layernorm = norm_class(args.hidden_size, args.rms_norm_eps)
        self.post_feedforward_layernorm = norm_class(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        """`attn_args`: (positions, rope, kv_cache, meta, ops), as `Attention.forward` takes them."""
        h = self.self_attn(self.input_layernorm(x), *attn_args)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    norm_class = GemmaRMSNorm
    layer_class = Gemma3DecoderLayer

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__(dataclasses.replace(args, qk_norm=True), max_positions)

    def build_rope(self, device: torch.device | None = None) -> None:
        super().build_rope(device)
        local_args = dataclasses.replace(
            self.args, rope_theta=self.args.local_rope_theta or self.args.rope_theta, rope_scaling=None
        )
        local = RotaryEmbedding(local_args, self.max_positions)
        self.local_rope = local if device is None else local.to(device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        # sqrt(hidden) rounded to the weights' dtype first, as transformers' embedding does.
        return x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype).item()

    def layer_ropes(self, positions: torch.Tensor) -> list[RotaryAt]:
        full, local = self.rope.at(positions), self.local_rope.at(positions)
        return [local if layer.self_attn.sliding_window is not None else full for layer in self.model.layers]
