"""Llama-family decoder in plain torch over a flattened (varlen) batch of tokens.

RMSNorm, RoPE (default / linear / llama3 scaling), grouped-query attention through the
paged-KV ops in `kernels/`, SwiGLU MLP, tied or untied embeddings. transformers is used
for the config only, never for the forward pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata
from kernels.linear import linear, pack_weight
from kernels.ops import KernelOps

# Checkpoint tensors that load into a slice of a fused parameter: (fused name, shard index).
STACKED_PARAMS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArgs":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        # transformers 5 keeps theta and scaling in `rope_parameters`; older configs use
        # `rope_theta` + `rope_scaling`.
        rope = dict(getattr(cfg, "rope_parameters", None) or {})
        legacy = getattr(cfg, "rope_scaling", None)
        if legacy:
            rope = {**legacy, **rope}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_hidden_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            num_key_value_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        )


def rope_inv_freq(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor, as transformers computes them."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(args)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim / 2]
        self.register_buffer("cos", freqs.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_scaling, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] of these positions."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate_qk(self, positions: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        """Rotate q and k heads side by side ([T, H + Hkv, D], one pass): their columns are
        adjacent in the fused QKV projection, and both turn by the same angles."""
        return _rotate(qk, *self.cos_sin(positions))

    def at(self, positions: torch.Tensor) -> "RotaryAt":
        """This rotation with the cos/sin of `positions` looked up once, for all the layers of a forward."""
        return RotaryAt(self, positions)


class RotaryAt:
    """A `RotaryEmbedding` bound to one forward's positions (what every layer rotates by)."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rope = rope
        self.positions = positions
        self._cos_sin = rope.cos_sin(positions)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos_sin if positions is self.positions else self.rope.cos_sin(positions)

    rotate_qk = RotaryEmbedding.rotate_qk  # the same rotation, through this cos_sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Linear(nn.Module):
    """`x @ weight.T + bias`; `out_features` as a list makes a fused layer of row shards."""

    def __init__(self, in_features: int, out_features: int | list[int], bias: bool) -> None:
        super().__init__()
        self.shard_sizes = list(out_features) if isinstance(out_features, list) else [out_features]
        total = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None
        # oneDNN's blocked copy of `weight` (kernels/linear.py), set by `prepack_linears`
        # once the weights are final; a plain attribute, outside the state dict.
        self.packed: torch.Tensor | None = None

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        start = sum(self.shard_sizes[:index])
        return param.narrow(0, start, self.shard_sizes[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


def prepack_linears(model: nn.Module) -> int:
    """Give every float `Linear` of a model whose weights will no longer change (the
    serving runtime, not calibration) its oneDNN-packed weight; returns how many got one
    (none off the CPU: `pack_weight` takes CPU weights only).
    The dense weight stays (tied embeddings, sharding and quantization read it), so a
    packed layer holds its weight twice in host memory but streams one copy per call."""
    count = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.weight is not None:
            module.packed = pack_weight(module.weight)
            count += module.packed is not None
    return count


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's fused kernel: bit-identical to the steps below in float32, fewer ops.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Same order of operations as HF LlamaRMSNorm: normalise in fp32, cast, then scale.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        # One GEMM for Q, K and V; the checkpoint's q/k/v_proj load into its row shards.
        self.qkv_proj = Linear(args.hidden_size, [self.q_size, self.kv_size, self.kv_size], args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, args.attention_bias)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding | RotaryAt,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        # q and k rotate in one pass: their columns are adjacent in the fused projection.
        qk = rope.rotate_qk(positions, qkv[:, : self.q_size + self.kv_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim))
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, self.head_dim)
        key_cache, value_cache = kv_cache
        ops.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        o = ops.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.intermediate_size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, [args.intermediate_size] * 2, args.mlp_bias)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, args.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF checkpoints, so safetensors load by name."""

    def __init__(self, args: ModelArgs, max_positions: int) -> None:
        super().__init__()
        self.args = args
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = RotaryEmbedding(args, max_positions)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        ops: KernelOps,
    ) -> torch.Tensor:
        """Returns the final hidden states of the tokens at `meta.logits_indices`."""
        x = self.model.embed_tokens(input_ids)
        rope = self.rope.at(positions)  # cos/sin looked up once, not once per layer
        with ops.forward_scope():  # the layers share this step's metadata (and what ops derive from it)
            for layer, kv_cache in zip(self.model.layers, kv_caches):
                h = layer.input_layernorm(x)
                x = x + layer.self_attn(h, positions, rope, kv_cache, meta, ops)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        # Only the positions that sample need the final norm and the (large) LM head.
        return self.model.norm(x[meta.logits_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
