"""One quantized linear, independent of how any checkpoint lays it out, and its runtime module.

RTN, AWQ and GPTQ produce a `QuantizedLinear`; the checkpoint formats (AutoAWQ, AutoGPTQ,
Pagoda's int8/W8A8) pack it and unpack it back; `runtime_module` turns it into the module
that serves it (linears.py). Everything in between is the textbook affine form of `affine.py`:
w[n, k] = scale[n, g(k)] * (q[n, k] - zero[n, g(k)]) with g(k) = k // group_size, or
g(k) = g_idx[k] when GPTQ's act-order quantized the columns in another order.

Act-order at run time: the columns are permuted so that every group is contiguous again
(`perm = argsort(g_idx)`, vLLM's "exllama shuffle"), the integer kernel runs on the
permuted weight, and the activations are gathered with the same permutation
(`PermutedInputLinear`: one index_select of K values per token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.quantization.affine import QuantizedTensor, dequantize_tensor, qparams, quantize
from engine.quantization.linears import PermutedInputLinear, int4_linear, int8_linear, w8a8_linear_module


@dataclass(slots=True)
class QuantizedLinear:
    qt: QuantizedTensor  # q [N, K]; scale, zero [N, K / group_size]
    g_idx: torch.Tensor | None = None  # [K] group of each input column; None = k // group_size
    bias: torch.Tensor | None = None  # [N] float
    smooth: torch.Tensor | None = None  # [K] W8A8: activations are divided by it

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qt.q.shape)  # type: ignore[return-value]

    def group_index(self) -> torch.Tensor:
        """g(k) for every input column k, [K] int64."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.shape[1]) // self.qt.group_size

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this stands for."""
        if self.g_idx is None:
            return dequantize_tensor(self.qt)
        g = self.group_index()
        return self.qt.scale[:, g] * (self.qt.q - self.qt.zero[:, g]).float()

    def contiguous_groups(self) -> tuple["QuantizedLinear", torch.Tensor | None]:
        """An equivalent QuantizedLinear without g_idx, and the input permutation it needs
        (None when the groups are already k // group_size). ValueError when some group
        does not have exactly group_size columns (no fixed-group kernel can run it)."""
        if self.g_idx is None:
            return self, None
        k = self.shape[1]
        group_size = self.qt.group_size
        perm = torch.argsort(self.g_idx.long(), stable=True)
        if not torch.equal(self.g_idx.long()[perm], torch.arange(k) // group_size):
            raise ValueError(f"g_idx does not split the {k} input columns into groups of {group_size}")
        qt = QuantizedTensor(self.qt.q[:, perm].contiguous(), self.qt.scale, self.qt.zero, self.qt.bits, group_size)
        if torch.equal(perm, torch.arange(k)):
            return QuantizedLinear(qt, None, self.bias, self.smooth), None
        return QuantizedLinear(qt, None, self.bias, self.smooth), perm


def stored_qparams(r_min: torch.Tensor, r_max: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`affine.qparams` with the scale rounded to float16, the precision AutoAWQ / AutoGPTQ
    checkpoints store it in: the integers are then computed against the scale that is served."""
    scale, zero = qparams(r_min, r_max, bits, symmetric)
    return scale.clamp(min=2.0**-24).half().float(), zero


def quantize_groups(
    weight: torch.Tensor, bits: int, group_size: int, r_min: torch.Tensor | None = None, r_max: torch.Tensor | None = None
) -> QuantizedLinear:
    """Asymmetric per-group RTN of [N, K] over each group's range, or the given (clipped)
    ranges [N, K / group_size]; float16-representable scales."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"group_size {group_size} does not divide the {k} input columns")
    g = weight.float().reshape(n, k // group_size, group_size)
    scale, zero = stored_qparams(g.amin(-1) if r_min is None else r_min, g.amax(-1) if r_max is None else r_max, bits, False)
    q = quantize(g, scale.unsqueeze(-1), zero.unsqueeze(-1), bits).reshape(n, k)
    return QuantizedLinear(QuantizedTensor(q, scale, zero, bits, group_size))


def runtime_module(ql: QuantizedLinear, dtype: torch.dtype, device: torch.device, w8a8: bool = False) -> nn.Module:
    """The serving module: INT4 / INT8 weight-only, or (`w8a8`) int8 weights x int8 activations."""
    if w8a8:
        if ql.g_idx is not None:
            raise ValueError("W8A8 weights have no act-order (g_idx)")
        bias = None if ql.bias is None else ql.bias.to(device, dtype)
        smooth = None if ql.smooth is None else ql.smooth.to(device, dtype)
        return w8a8_linear_module(ql.qt, bias, device, smooth)
    ql, perm = ql.contiguous_groups()
    bias = None if ql.bias is None else ql.bias.to(device, dtype)
    if ql.qt.bits == 4:
        module = int4_linear(ql.qt, bias, dtype, device)
    elif ql.qt.bits == 8:
        module = int8_linear(ql.qt, bias, dtype, device)
    else:
        raise ValueError(f"no runtime module for {ql.qt.bits}-bit weights (4 and 8 are served)")
    return module if perm is None else PermutedInputLinear(perm.to(device), module)


def replace_linears(model: nn.Module, results: dict[str, QuantizedLinear], w8a8: bool = False) -> nn.Module:
    """Swap each named module for the runtime module of its QuantizedLinear, in place
    (`w8a8`: decoder linears get int8 activations, the LM head stays weight-only)."""
    for name, ql in results.items():
        weight = model.get_submodule(name).weight
        parent, _, leaf = name.rpartition(".")
        module = runtime_module(ql, weight.dtype, weight.device, w8a8 and name != "lm_head")
        setattr(model.get_submodule(parent), leaf, module)
    return model
