"""Tiny GGUF files for the tests, written as llama.cpp's converter writes them: tensor names from
the `gguf` package's table, Llama's q/k rows permuted, Gemma's norms stored as 1 + w, the
bundled model's tokenizer (copied from its GGUF), each tensor in the type asked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map, quants

from engine.default_model import _gguf_path
from engine.gguf.reader import GGUFFile

_TOKENIZER_FIELDS = ("model", "pre", "tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
                     "padding_token_id", "unknown_token_id")


def tiny_config(arch: str):
    """A 2-layer random-weight config of `arch` with the bundled model's vocabulary."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common, rope_theta=10000.0)
    if arch == "llama3":  # Llama 3.1-style RoPE scaling (a `rope_freqs` tensor in the file)
        return LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    if arch == "qwen2":
        return Qwen2Config(**{k: v for k, v in common.items() if k != "head_dim"}, rope_theta=10000.0)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 32}, rope_theta=10000.0)  # != hidden / heads
    if arch == "gemma3":
        return Gemma3TextConfig(**{**common, "head_dim": 32}, rope_theta=10000.0, sliding_window=8,
                                query_pre_attn_scalar=32)
    raise ValueError(arch)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path, arch: str, config, state_dict: dict[str, torch.Tensor], qtype: GGMLQuantizationType,
    chat_template: str | None = None, extra_tensors: dict[str, np.ndarray] | None = None,
) -> Path:
    """The model as llama.cpp would write it: linears in `qtype` (Q4_0 / Q4_1 / Q8_0 / F16 / F32),
    norms and biases F32, the embedding in Q8_0 when `qtype` is quantized, else in `qtype`."""
    rope = config.rope_parameters
    if arch == "llama3":
        extra_tensors = {**(extra_tensors or {}), "rope_freqs.weight": _llama3_divisors(config, rope)}
        arch = "llama"
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"] if "rope_theta" in rope else rope["full_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    source = GGUFFile(_gguf_path())
    for field in _TOKENIZER_FIELDS:
        key = f"tokenizer.ggml.{field}"
        types = source.fields[key].types
        writer.add_key_value(key, source.fields[key].contents(), types[0], types[-1] if len(types) > 1 else None)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    quantized = qtype not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16)
    for hf_name, tensor in state_dict.items():
        module, _, suffix = hf_name.rpartition(".")
        gguf_name = names.get_name(module)
        if module == "lm_head" and config.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for a tied head
        if gguf_name is None or f"{gguf_name}.{suffix}" in (extra_tensors or {}):
            continue
        w = tensor.float().numpy()
        if arch == "llama" and module.endswith("q_proj"):
            w = _permute(w, config.num_attention_heads)
        elif arch == "llama" and module.endswith("k_proj"):
            w = _permute(w, config.num_key_value_heads)
        if arch == "gemma3" and module.endswith("norm"):
            w = w + 1.0
        kind = qtype if module.endswith("_proj") and suffix == "weight" else GGMLQuantizationType.F32
        if module.endswith("embed_tokens"):
            kind = GGMLQuantizationType.Q8_0 if quantized else qtype
        _add(writer, f"{gguf_name}.{suffix}", w, kind)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: GGUFWriter, name: str, w: np.ndarray, kind: GGMLQuantizationType) -> None:
    if kind == GGMLQuantizationType.F32:
        writer.add_tensor(name, w.astype(np.float32))
    elif kind == GGMLQuantizationType.F16:
        writer.add_tensor(name, w.astype(np.float16))
    else:
        writer.add_tensor(name, quants.quantize(w.astype(np.float32), kind), raw_dtype=kind)


def _llama3_divisors(config, rope) -> np.ndarray:
    """convert_hf_to_gguf.py's `rope_freqs` for a llama3 rope_scaling, written as it writes it."""
    import math

    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)
