"""The runtime modules that serve quantized linears, and the builders that make them from
a `QuantizedTensor` (affine.py). Nothing here chooses a method: `rtn.convert_model` (load-time
`--quantization`) and `weights.runtime_module` (quantized checkpoints) call these builders.

    module              weights                                     activations   kernel (kernels/quant_linear.py)
    Int8Linear          int8 [N, K], symmetric per output channel    float         w8a16_linear
    Int4Linear          int4, asymmetric per group along K            float         w4a16_linear(_cpu)
    W8A8Linear          int8 [N, K], symmetric per output channel    int8 per token w8a8_linear
    PermutedInputLinear any of the above on permuted input columns (GPTQ act-order)

INT8 weights are stored as `q - 128` (the symmetric zero point folded into int8) with one
scale per row; INT4 in torch's CPU int4 layout where that kernel runs, else AutoGPTQ's.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.affine import QuantizedTensor, pack_int4
from kernels.quant_linear import (
    cpu_int4_mm_available,
    cpu_int8_mm_available,
    pack_int4_cpu,
    w4a16_linear,
    w4a16_linear_cpu,
    w8a8_linear,
    w8a16_linear,
)

CPU_INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel accepts


class Int8Linear(nn.Module):
    # --batch-invariant (set by the worker): the Triton kernel's one config at every row count.
    invariant = False

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", qweight)  # [N, K] int8
        self.register_buffer("scales", scales)  # [N]
        self.register_buffer("bias", bias)
        # On an AVX512-BF16 CPU, the C++ int8 kernel's packed copy of `qweight`
        # (`cpu_kernels.pack_int8_weight`, set by engine/models/llama.py `prepack_linears`):
        # then every call runs that kernel, at any row count (batch-invariant).
        self.kernel_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w8a16_linear(x, self.qweight, self.scales, self.bias, invariant=self.invariant,
                            kernel_weight=self.kernel_weight)


class Int4Linear(nn.Module):
    """Holds torch's CPU int4 layout when that kernel works here, else the AutoGPTQ layout."""

    invariant = False  # as Int8Linear's

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
        return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                            invariant=self.invariant)


class W8A8Linear(nn.Module):
    """int8 weights x int8 activations: each token's activations quantized at run time (one
    scale per row, absmax / 127), then one int8 x int8 -> int32 GEMM."""

    def __init__(
        self,
        qweight: torch.Tensor,  # [N, K] int8
        weight_scale: torch.Tensor,  # [N]
        bias: torch.Tensor | None,  # [N]
        smooth: torch.Tensor | None = None,  # [K]: x / smooth when not folded into the previous op
    ) -> None:
        super().__init__()
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ValueError(f"qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale.float())
        self.register_buffer("bias", bias)
        self.register_buffer("smooth", smooth)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.smooth is not None:
            x = x / self.smooth
        return w8a8_linear(x, self.qweight, self.weight_scale, self.bias)


class PermutedInputLinear(nn.Module):
    """`inner(x[:, perm])`: a linear whose stored input columns are permuted (GPTQ act-order)."""

    def __init__(self, perm: torch.Tensor, inner: nn.Module) -> None:
        super().__init__()
        self.register_buffer("perm", perm)
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


def _symmetric_int8(qt: QuantizedTensor, what: str) -> torch.Tensor:
    """The int8 [N, K] of a symmetric per-channel 8-bit weight (zero point 128 folded in)."""
    if qt.bits != 8 or qt.group_size != qt.q.shape[1] or not bool((qt.zero == 128).all()):
        raise ValueError(f"{what} linears must be 8-bit, symmetric (zero point 128), one scale per output channel")
    return (qt.q - qt.zero).to(torch.int8)


def int8_linear(qt: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Int8Linear:
    """The serving module of a symmetric per-channel INT8 weight."""
    scale_dtype = torch.bfloat16 if device.type == "cpu" and cpu_int8_mm_available() else dtype
    qweight = _symmetric_int8(qt, "INT8 weight-only")
    return Int8Linear(qweight.to(device), qt.scale.squeeze(1).to(device, scale_dtype), bias)


def int4_linear(qt: QuantizedTensor, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> Int4Linear:
    """The serving module of a per-group INT4 weight: torch's CPU int4 layout where that
    kernel runs (group sizes 32..256), else the AutoGPTQ layout of the reference op."""
    scales, zeros = qt.scale.t().contiguous(), qt.zero.t().contiguous()  # [K / G, N]
    if device.type == "cuda" and not (qt.group_size % 8 == 0 and qt.q.shape[1] % qt.group_size == 0):
        # The Triton kernel takes any multiple of 8 (group -1 is G = K): refused here, at
        # load, rather than served by the dequantizing reference on every call.
        raise ValueError(
            f"INT4 group size {qt.group_size} (K={qt.q.shape[1]}) is not served on CUDA: the W4A16 kernel "
            "needs a multiple of 8 that divides K"
        )
    if device.type == "cpu" and cpu_int4_mm_available() and qt.group_size in CPU_INT4_GROUP_SIZES:
        packed, scales_and_zeros = pack_int4_cpu(qt.q, scales, zeros, qt.group_size)
        tensors = {"qweight": packed, "scales_and_zeros": scales_and_zeros}
    else:
        tensors = {"qweight": pack_int4(qt.q), "scales": scales.to(dtype), "zeros": zeros.to(torch.uint8)}
    return Int4Linear({k: v.to(device) for k, v in tensors.items()}, qt.group_size, bias)


def w8a8_linear_module(
    qt: QuantizedTensor, bias: torch.Tensor | None, device: torch.device, smooth: torch.Tensor | None = None
) -> W8A8Linear:
    """The serving module of a symmetric per-channel int8 weight with int8 activations."""
    qweight = _symmetric_int8(qt, "W8A8")
    return W8A8Linear(qweight.to(device), qt.scale.squeeze(1).to(device), bias, smooth)
