"""Build a model from a Hugging Face folder: config via transformers, weights from safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine.models.llama import STACKED_PARAMS, LlamaForCausalLM, ModelArgs, RotaryEmbedding

_SUPPORTED = {"llama", "mistral", "qwen2"}


def load_hf_config(path: Path):
    cfg = AutoConfig.from_pretrained(str(path))
    if cfg.model_type not in _SUPPORTED:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported (Llama-family only: {sorted(_SUPPORTED)})")
    return cfg


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, max_positions: int, quantization: str | None = None
) -> LlamaForCausalLM:
    args = ModelArgs.from_hf_config(load_hf_config(path))
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions)
    model.to_empty(device=device)
    model.to(dtype)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (RoPE tables) were built on meta: rebuild them for real.
    model.rope = RotaryEmbedding(args, max_positions).to(device)

    params = dict(model.named_parameters())
    pending = {name: p.numel() for name, p in params.items()}  # elements still to load
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    if name == "lm_head.weight" and args.tie_word_embeddings:
                        continue
                    target_name, target = _target(model, params, name)
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise ValueError(
                            f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
                    pending[target_name] -= tensor.numel()
    missing = sorted(name for name, left in pending.items() if left)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for {missing[:5]}")
    if quantization is not None:
        from engine.quantization.rtn import convert_model

        convert_model(model, quantization)
    return model.eval().requires_grad_(False)


def _target(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str) -> tuple[str, torch.Tensor]:
    """The parameter (or the shard of a fused parameter) a checkpoint tensor loads into."""
    if name in params:
        return name, params[name].data
    module_name, _, attr = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    if leaf in STACKED_PARAMS:
        fused, index = STACKED_PARAMS[leaf]
        fused_name = f"{parent}.{fused}.{attr}"
        if fused_name in params:
            layer = model.get_submodule(f"{parent}.{fused}")
            return fused_name, layer.shard(params[fused_name].data, index)
    raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
