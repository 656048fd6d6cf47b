"""Round-to-nearest weight-only quantization of a loaded model (`--quantization int8|int4`).

Two functions, as in gpt-fast: `quantize_weight` makes a layer's quantized tensors,
`convert_model` swaps every decoder `Linear` for the runtime module holding only them.
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
from engine.quantization.affine import pack_int4, quantize_tensor
from kernels.quant_linear import (
    cpu_int4_mm_available,
    cpu_int8_mm_available,
    pack_int4_cpu,
    w4a16_linear_cpu,
    w8a16_linear,
)
from kernels.quant_reference import w4a16_linear_ref

INT4_GROUP_SIZE = 128


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
        return w4a16_linear_ref(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias)


def quantize_weight(weight: torch.Tensor, method: str, cpu_layout: bool = False) -> dict[str, torch.Tensor]:
    """The stored tensors of one [N, K] weight (`cpu_layout`: torch's CPU int4 packing)."""
    if method == "int8":
        qt = quantize_tensor(weight, 8, "channel", symmetric=True)
        return {"qweight": (qt.q - qt.zero).to(torch.int8), "scales": qt.scale.squeeze(1)}
    if method == "int4":
        group_size = int4_group_size(weight.shape[1])
        qt = quantize_tensor(weight, 4, group_size, symmetric=False)
        scales, zeros = qt.scale.t().contiguous(), qt.zero.t().contiguous()  # [K / G, N]
        if cpu_layout:
            packed, scales_and_zeros = pack_int4_cpu(qt.q, scales, zeros, group_size)
            return {"qweight": packed, "scales_and_zeros": scales_and_zeros}
        return {"qweight": pack_int4(qt.q), "scales": scales, "zeros": zeros.to(torch.uint8)}
    raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")


@torch.no_grad()
def convert_model(model: nn.Module, method: str) -> nn.Module:
    """Replace each decoder-layer `Linear` by its quantized module, in place."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and (name.startswith("model.layers.") or name == "lm_head")
    ]
    for name, linear in targets:
        weight = linear.weight.data
        on_cpu = weight.device.type == "cpu"
        if method == "int8" or name == "lm_head":
            tensors = quantize_weight(weight, "int8")
            dtype = torch.bfloat16 if on_cpu and cpu_int8_mm_available() else weight.dtype
            new: nn.Module = Int8Linear(tensors["qweight"], tensors["scales"].to(dtype), linear.bias)
        else:
            tensors = quantize_weight(weight, "int4", cpu_layout=on_cpu and cpu_int4_mm_available())
            if "scales" in tensors:
                tensors["scales"] = tensors["scales"].to(weight.dtype)
            new = Int4Linear(tensors, int4_group_size(weight.shape[1]), linear.bias)
        if new.bias is not None:
            new.bias = new.bias.data  # a plain buffer, not a Parameter
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model
