"""Round-to-nearest quantization of a loaded model: `--quantization int8|int4|w8a8`.

As in gpt-fast: `quantize_weight` makes a layer's integers and scales, the builders of
linears.py make the runtime module holding only them, and `convert_model` (the dispatch
of the load-time methods in `engine.quantization.METHODS`) swaps every decoder `Linear`
for one, in place.

INT8: symmetric, per output channel. INT4: asymmetric, group 128 along the input
dimension, or the largest of 64/32 that divides K when 128 does not (SmolLM2's
K = 576 = 4.5 x 128 uses 64; its K = 1536 layers use 128), with integer zero points.
W8A8: the INT8 weights with int8 per-token activations (`W8A8Linear`), no calibration;
SmoothQuant's calibrated variant is w8a8.py.

The LM head (`--lm-head-quantization`, `lm_head_int8`): INT8 weight-only or left in the
compute dtype; never int4 (the logits are the most error-sensitive output) and its
activations stay float. `auto` decides per method and device:

- `int8`, `w8a8`: INT8 everywhere (on CUDA through the W8A16 kernel: half bf16's bytes).
- `int4` on CUDA: the compute dtype, as AutoAWQ and AutoGPTQ keep it. Llama-3-8B's head
  (128256 x 4096) is as large as ~1/4 of the INT4 decoder weights, and an INT8 head there
  read through the old dequantizing path capped INT4 at ~1.8x bf16.
- `int4` on CPU: INT8, as before. At batch 1 the head is the largest GEMM (49152 x 576 in
  SmolLM2, as many bytes as all 30 decoder layers' linears in int8) and torch's int8 CPU
  kernel reads it faster than oneDNN reads the float one (docs/BENCHMARKS.md, quantized
  decode: a float head cost INT8 decode 1.52x -> 1.25x float).

When an INT8 head is tied to the embeddings, the embedding table stays float for the
lookup and the head gets its own int8 copy (+1 byte per vocab x hidden weight).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.llama import Linear
from engine.quantization import LM_HEAD_QUANTIZATIONS, METHODS
from engine.quantization.affine import QuantizedTensor, quantize_tensor
from engine.quantization.linears import int4_linear, int8_linear, w8a8_linear_module

INT4_GROUP_SIZE = 128


def lm_head_int8(method: str, setting: str, device: torch.device) -> bool:
    """Whether `--quantization method` makes the LM head INT8 on `device` (`setting`: one of
    LM_HEAD_QUANTIZATIONS)."""
    if setting not in LM_HEAD_QUANTIZATIONS:
        raise ValueError(f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATIONS}, got {setting!r}")
    if setting != "auto":
        return setting == "int8"
    return method != "int4" or device.type != "cuda"


def int4_group_size(in_features: int, preferred: int = INT4_GROUP_SIZE) -> int:
    for g in (preferred, 64, 32):
        if g <= preferred and in_features % g == 0:
            return g
    raise ValueError(f"no INT4 group size in ({preferred}, 64, 32) divides K={in_features}")


def quantize_weight(weight: torch.Tensor, method: str) -> QuantizedTensor:
    """RTN of one [N, K] weight: int8 symmetric per channel, or int4 asymmetric per group."""
    if method == "int8":
        return quantize_tensor(weight, 8, "channel", symmetric=True)
    if method == "int4":
        return quantize_tensor(weight, 4, int4_group_size(weight.shape[1]), symmetric=False)
    raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")


@torch.no_grad()
def convert_model(model: nn.Module, method: str, lm_head: str = "auto") -> nn.Module:
    """Replace each decoder-layer `Linear` by its `method` module and, when `lm_head_int8`
    says so for `lm_head` on the model's device, the LM head by an INT8 weight-only one;
    in place."""
    if method not in METHODS:
        raise ValueError(f"quantization must be one of {METHODS}, got {method!r}")
    head = getattr(model, "lm_head", None)
    head_device = head.weight.device if isinstance(head, Linear) and head.weight is not None else torch.device("cpu")
    quantize_head = lm_head_int8(method, lm_head, head_device)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, Linear) and (name.startswith("model.layers.") or (name == "lm_head" and quantize_head))
    ]
    for name, linear in targets:
        weight = linear.weight.data
        bias = None if linear.bias is None else linear.bias.data  # a plain buffer, not a Parameter
        if method == "int8" or name == "lm_head":
            new: nn.Module = int8_linear(quantize_weight(weight, "int8"), bias, weight.dtype, weight.device)
        elif method == "int4":
            new = int4_linear(quantize_weight(weight, "int4"), bias, weight.dtype, weight.device)
        else:
            new = w8a8_linear_module(quantize_weight(weight, "int8"), bias, weight.device)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    return model
