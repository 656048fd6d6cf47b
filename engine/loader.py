"""Build a model from a Hugging Face folder: config via transformers, weights from safetensors."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from engine.models.llama import LlamaForCausalLM, ModelArgs

_SUPPORTED = {"llama", "mistral", "qwen2"}


def load_hf_config(path: Path):
    cfg = AutoConfig.from_pretrained(str(path))
    if cfg.model_type not in _SUPPORTED:
        raise ValueError(f"model_type {cfg.model_type!r} is not supported (Llama-family only: {sorted(_SUPPORTED)})")
    return cfg


def load_model(path: Path, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    args = ModelArgs.from_hf_config(load_hf_config(path))
    with torch.device("meta"):
        model = LlamaForCausalLM(args, max_positions)
    params = dict(model.named_parameters())
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    loaded: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if name not in params:
                    if name == "lm_head.weight" and args.tie_word_embeddings:
                        continue
                    raise ValueError(f"unexpected tensor {name!r} in {file.name}")
                tensor = f.get_tensor(name)
                param = params[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                _set_param(model, name, tensor.to(device=device, dtype=dtype))
                loaded.add(name)
    missing = set(params) - loaded
    if args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {path} lacks {sorted(missing)[:5]}")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (RoPE tables) were built on meta: rebuild them for real.
    model.rope = type(model.rope)(args, max_positions).to(device)
    return model.eval()


def _set_param(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))
