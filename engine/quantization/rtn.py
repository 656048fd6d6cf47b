"""Round-to-nearest weight-only quantization of a loaded model (`--quantization int8|int4`).

As in gpt-fast: `quantize_weight` makes a layer's integers and scales, `int8_linear` /
`int4_linear` build the runtime module holding only them (also used for checkpoints that
arrive quantized), `convert_model` swaps every decoder `Linear` for one.
The LM head becomes INT8 per-channel under both methods: at batch 1 it is the largest
GEMM (49152 x 576 in SmolLM2, as many bytes as all 30 decoder layers' linears in int8),
so a float head capped INT8 decode at 1.25x float (52.5 -> 65.7 tok/s, `loadtest.bench_quant`
on a quiet machine); with the int8 head the speedup is not yet measured on a quiet one. When the head is tied to the embeddings, the embedding table stays float for
the lookup and the head gets its own int8 copy (+1 byte per vocab x hidden weight). It
stays int8, not int4, under `int4`: the logits are the most error-sensitive output.

INT8: symmetric, per output channel, stored as int8 `q - 128` (zero point folded) with
one scale per row. INT4: asymmetric, group 128 along the input dimension — or the
largest of 64/32 that divides K when 128 does not (SmolLM2's K = 576 = 4.5 x 128 uses
64; its K = 1536 layers use 128) — with integer zero points.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import Linear
from engine.quantization import METHODS
from engine.quantization.affine import QuantizedTensor, pack_int4, quantize_tensor
from kernels.quant_linear import (
    cpu_int4_mm_available,
    cpu_int8_mm_available,
    pack_int4_cpu,
    w4a16_linear,
    w4a16_linear_cpu,
    w8a16_linear,
)

INT4_GROUP_SIZE = 128
CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel accepts


def int4_group_size(in_features: int, preferred: int = INT4_GROUP_SIZE) -> int:
    for g in (preferred, 64, 32):
        if g <= preferred and in_features % g == 0:
            return g
    raise ValueError(f"no INT4 group size in ({preferred}, 64, 32) divides K={in_features}")


class Int8Linear(nn.Module):
    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N]
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a16_linear(x, self.qweight, self.scales, self.bias)


class Int4Linear(nn.Module):
    """Holds torch's CPU int4 layout when that kernel works here, else the AutoGPTQ layout."""

    def __init__(self, tensors: dict[str, torch.Tensor], group_size: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.group_size = group_size
        self.cpu_packed = "scales_and_zeros" in tensors
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_packed:
            return w4a16_linear_cpu(x, self.qweight, self.scales_and_zeros, self.group_size, self.bias)
        return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedTensor:
    """RTN of one [N, K] weight: int8 symmetric per channel, or int4 asymmetric per group."""
    if method == "int8":
        return quantize_tensor(weight, 8, "channel", symmetric=True)
    if method == "int4":
        return quantize_tensor(weight, 4, int4_group_size(weight.shape[1]), symmetric=False)
    raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")


def int8_linear(qt: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Int8Linear:
    """The serving module of a symmetric per-channel INT8 weight (zero point 128 folded into int8)."""
    scale_dtype = torch.bfloat16 if device.type == "cpu" and cpu_int8_mm_available() else dtype
    qweight = (qt.q - qt.zero).to(torch.int8)
    return Int8Linear(qweight.to(device), qt.scale.squeeze(1).to(device, scale_dtype), bias)


def int4_linear(qt: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Int4Linear:
    """The serving module of a per-group INT4 weight: torch's CPU int4 layout where that
    kernel runs (group sizes 32..256), else the AutoGPTQ layout of the reference op."""
    scales, zeros = qt.scale.t().contiguous(), qt.zero.t().contiguous()  # [K / G, N]
    if device.type == "cpu" and cpu_int4_mm_available() and qt.group_size in CPU_INT4_GROUP_SIZES:
        packed, scales_and_zeros = pack_int4_cpu(qt.q, scales, zeros, qt.group_size)
        tensors = {"qweight": packed, "scales_and_zeros": scales_and_zeros}
    else:
        tensors = {"qweight": pack_int4(qt.q), "scales": scales.to(dtype), "zeros": zeros.to(torch.uint8)}
    return Int4Linear({k: v.to(device) for k, v in tensors.items()}, qt.group_size, bias)


@torch.no_grad()
def convert_model(model: nn.Module, method: str) -> nn.Module:
    """Replace each decoder-layer `Linear` by its quantized module, in place."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    if method == "w8a8":
        from engine.quantization.w8a8 import convert_model_w8a8

        return convert_model_w8a8(model)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and (name.startswith("model.layers.") or name == "lm_head")
    ]
    for name, linear in targets:
        weight = linear.weight.data
        if method == "int8" or name == "lm_head":
            new: nn.Module = int8_linear(quantize_weight(weight, "int8"), linear.bias, weight.dtype, weight.device)
        else:
            new = int4_linear(quantize_weight(weight, "int4"), linear.bias, weight.dtype, weight.device)
        if new.bias is not None:
            new.bias = new.bias.data  # a plain buffer, not a Parameter
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model
