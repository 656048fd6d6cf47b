"""Build a model from a GGUF file's metadata folder (folder.py) and the file's tensors.

The model class comes from the folder's config.json as for any folder (the registry by
`model_type`); the weights come from the GGUF file: Q4_0 / Q4_1 / Q8_0 linears become the
runtime INT4 / INT8 modules straight from their integers (their float weight is never
allocated), everything else loads as float. `load_format="dequantize"` loads every tensor as
float instead: the weights the file's float conversion holds.

`--quantization` applies to the linears the file leaves float (F16, K-quants, ...); those
kept quantized stay as the file has them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from engine.gguf.blocks import BLOCK, served_linear
from engine.gguf.reader import GGUFFile
from engine.gguf.tensors import GGUFWeights, log, read_weights
from engine.models.args import ModelArgs
from engine.models.llama import STACKED_PARAMS
from engine.models.registry import model_class
from engine.quantization.affine import pack_int4
from engine.quantization.checkpoint import concat_shards
from engine.quantization.linears import Int4Linear, cpu_int4_tensors
from engine.quantization.weights import QuantizedLinear, runtime_module


def load_gguf_model(
    cfg, gguf: Path, dtype: torch.dtype, device: torch.device, max_positions: int,
    quantization: str | None, load_format: str, copy_weight: Callable, lm_head_quantization: str = "auto",
) -> nn.Module:
    """The model of `cfg` (the metadata folder's config) with the weights of `gguf`.
    `copy_weight` is engine/loader.py's `(model, params, pending, name, tensor, source)`: it
    fills a parameter (or a fused layer's shard) with a checked shape; passed in by the
    loader that routes GGUF folders here."""
    args = ModelArgs.from_hf_config(cfg)
    weights = read_weights(GGUFFile(str(gguf)), cfg, keep_quantized=load_format != "dequantize")
    quantized = _fuse(weights)
    log(weights.summary())

    with torch.device("meta"):
        model = model_class(args.model_type)(args, max_positions)
    for name, ql in quantized.items():
        linear = model.get_submodule(name)
        if tuple(linear.weight.shape) != ql.shape:
            raise ValueError(f"{name}: the GGUF weight is {list(ql.shape)}, the model needs {list(linear.weight.shape)}")
        linear.weight = linear.bias = None  # the runtime module below replaces it
    model.to_empty(device=device)
    model.to(dtype)
    if args.tie_word_embeddings and model.lm_head.weight is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.build_rope(device)  # non-persistent RoPE tables were built on meta

    params = dict(model.named_parameters())
    pending = {name: p.numel() for name, p in params.items()}
    with torch.no_grad():
        for name, tensor in weights.floats.items():
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue
            copy_weight(model, params, pending, name, tensor, "GGUF")
    missing = sorted(name for name, left in pending.items() if left)
    if missing:
        raise ValueError(f"GGUF file {gguf} lacks weights for {missing[:5]}")
    for name, ql in quantized.items():
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, _runtime_module(ql, dtype, device))
    if quantization is not None:
        from engine.quantization.rtn import convert_model

        convert_model(model, quantization, lm_head_quantization)  # only the float Linears left
    return model.eval().requires_grad_(False)


def _fuse(weights: GGUFWeights) -> dict[str, QuantizedLinear]:
    """Quantized q/k/v and gate/up stacked into our fused layers. A fused layer whose parts
    are not all kept alike (say q, k in Q4_1 and v in Q6_K) is float: its quantized parts
    are dequantized into `weights.floats`."""
    groups: dict[str, dict[int, str]] = {}
    for name in weights.quantized:
        parent, _, leaf = name.rpartition(".")
        fused, index = STACKED_PARAMS.get(leaf, (leaf, 0))
        groups.setdefault(f"{parent}.{fused}" if parent else fused, {})[index] = name
    out = {}
    for fused, parts in groups.items():
        leaf = fused.rpartition(".")[2]
        expected = 1 + max((i for f, i in STACKED_PARAMS.values() if f == leaf), default=0)
        shards = [weights.quantized[parts[i]] for i in sorted(parts)]
        alike = len(parts) == expected and len({(s.qt.bits, s.qt.group_size, s.shape[1]) for s in shards}) == 1
        if alike:  # a quantized module carries its float bias (Qwen2's q/k/v)
            biased = [dataclasses.replace(s, bias=weights.floats.pop(f"{parts[i]}.bias", None))
                      for i, s in zip(sorted(parts), shards)]
            out[fused] = served_linear(concat_shards(biased))
        else:
            for name in parts.values():
                weights.dequantize(name)
    return out


def _runtime_module(ql: QuantizedLinear, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`runtime_module`, except for Q4_1's fractional zero points, which `int4_linear` would
    round to integers: they go to the kernels as float32 (see blocks.py; the CPU kernels
    fold them into each group's offset)."""
    qt = ql.qt
    if qt.bits != 4 or not torch.is_floating_point(qt.zero):
        return runtime_module(ql, dtype, device)
    scales, zeros = qt.scale.t().contiguous(), qt.zero.t().contiguous()  # [K / 32, N]
    tensors = cpu_int4_tensors(qt.q, scales, zeros, BLOCK) if device.type == "cpu" else None
    if tensors is None:
        tensors = {"qweight": pack_int4(qt.q), "scales": scales.to(dtype), "zeros": zeros.float()}
    bias = None if ql.bias is None else ql.bias.to(device, dtype)
    return Int4Linear({k: v.to(device) for k, v in tensors.items()}, BLOCK, bias)
