"""`ModelArgs`: what the model modules, the KV cache and tensor parallelism read from a
Hugging Face config, for every supported architecture.

One dataclass for all of them: the fields every decoder has (sizes, heads, RoPE) plus the
few that vary between architectures (per-layer sliding windows, q/k norms, the MLP's
activation, Gemma 3's attention scale and local RoPE base). A field an architecture does
not use keeps its Llama default. What transformers' modeling code hardcodes instead of
reading from the config (Qwen2's q/k/v biases, Qwen3's q/k norms) is set by the
architecture's module (`engine/models/qwen2.py`, ...), not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
_LAYER_TYPES = ("full_attention", "sliding_attention")


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
    attention_bias: bool = False  # bias on q/k/v and o (Llama's `attention_bias`)
    mlp_bias: bool = False
    model_type: str = "llama"
    qkv_bias: bool = False  # bias on q/k/v only, none on o (Qwen2)
    qk_norm: bool = False  # RMSNorm of each q and k head over head_dim, before RoPE (Qwen3, Gemma 3)
    # Per layer: a query at position p sees keys p - window < k <= p; None = full causal.
    # Empty = every layer full.
    sliding_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the gated MLP's activation
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma 3); None: head_dim
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers (Gemma 3); None: rope_theta
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)

    def sliding_window(self, layer: int) -> int | None:
        """The window of decoder layer `layer` (None: full causal attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArgs":
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope, local_rope = _rope_parameters(cfg)
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        local_theta = None
        if local_rope is not None:
            local_type = local_rope.get("rope_type", local_rope.get("type", "default"))
            if local_type != "default":
                raise ValueError(
                    f"sliding-window layers with rope_type {local_type!r} are not supported (default only)"
                )
            local_theta = float(local_rope.get("rope_theta", theta))
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"MLP activation {act!r} is not supported (supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        for name in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if getattr(cfg, name, None):
                raise ValueError(f"{name}={getattr(cfg, name)!r} is not supported")
        scalar = getattr(cfg, "query_pre_attn_scalar", None)
        softcap = getattr(cfg, "final_logit_softcapping", None)
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
            model_type=getattr(cfg, "model_type", "llama"),
            sliding_windows=_sliding_windows(cfg),
            hidden_act=act,
            query_pre_attn_scalar=None if scalar is None else float(scalar),
            local_rope_theta=local_theta,
            final_logit_softcapping=None if softcap is None else float(softcap),
        )


def _rope_parameters(cfg: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(RoPE parameters of the full-attention layers, those of the sliding-window layers or
    None when they share them). transformers 5 keeps theta and scaling in
    `rope_parameters`, keyed by layer type when the types differ (Gemma 3); older configs
    use `rope_theta` + `rope_scaling`."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)  # in transformers 5 an alias of rope_parameters
    if legacy:
        rope = {**legacy, **rope}
    local = None
    if any(t in rope for t in _LAYER_TYPES):
        local = rope.get("sliding_attention")
        rope = dict(rope.get("full_attention") or {})
    return rope, local


def _sliding_windows(cfg: Any) -> tuple[int | None, ...]:
    """Each layer's window: `layer_types` names the sliding layers (Qwen2/3, Gemma 3);
    without it a `sliding_window` applies to every layer (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported (supported: {', '.join(_LAYER_TYPES)})")
    if not window:
        return ()
    if layer_types is None:
        return (int(window),) * cfg.num_hidden_layers
    return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)


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
