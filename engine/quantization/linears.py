"""The runtime modules that serve quantized linears, and the builders that make them from
a `QuantizedTensor` (affine.py). Nothing here chooses a method: `rtn.convert_model` (load-time
`--quantization`) and `weights.runtime_module` (quantized checkpoints) call these builders.

    module              weights                                     activations   kernel (kernels/quant_linear.py)
    Int8Linear          int8 [N, K], symmetric per output channel    float         w8a16_linear
    Int4Linear          int4, asymmetric per group along K            float         w4a16_linear(_cpu)
    W8A8Linear          int8 [N, K], symmetric per output channel    int8 per token w8a8_linear
    PermutedInputLinear any of the above on permuted input columns (GPTQ act-order)

INT8 weights are stored as `q - 128` (the symmetric zero point folded into int8) with one
scale per row. INT4 on CPU in the layout of the fastest kernel that runs here
(`cpu_int4_tensors`): Pagoda's C++ int4 kernel's (AVX512-BF16: batch-invariant, on the
work pool), else torch's CPU int4 layout, else AutoGPTQ's (the reference; CUDA's Triton).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.quantization.affine import QuantizedTensor, pack_int4
from kernels import cpu_kernels
from kernels.linear import gemv_enabled
from kernels.quant_linear import (
    cpu_int4_mm_available,
    cpu_int8_mm_available,
    int4_scale_offset,
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
    """One of three layouts, by its tensors (`cpu_int4_tensors`): `kernel_weight`, Pagoda's C++
    int4 kernel's; `qweight` + `scales_and_zeros`, torch's CPU int4 kernel's; `qweight` +
    `scales` + `zeros`, AutoGPTQ's (the Triton kernel on CUDA, else the reference)."""

    invariant = False  # as Int8Linear's

    def __init__(self, tensors: dict[str, torch.Tensor], group_size: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.group_size = group_size
        self.kernel = "kernel_weight" in tensors  # Pagoda's int4 kernel (batch-invariant)
        self.cpu_packed = self.kernel or "scales_and_zeros" in tensors  # a CPU kernel's layout, not the reference's
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel:
            out = cpu_kernels.int4_linear(x.to(torch.bfloat16), self.kernel_weight, self.group_size).to(x.dtype)
            return out if self.bias is None else out + self.bias
        if self.cpu_packed:
            return w4a16_linear_cpu(x, self.qweight, self.scales_and_zeros, self.group_size, self.bias)
        return w4a16_linear(x, self.qweight, self.scales, self.zeros, self.group_size, self.bias,
                            invariant=self.invariant)


def cpu_int4_tensors(
    q: torch.Tensor,  # [N, K] int in [0, 15]
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor,  # [K / G, N] zero points, integer or float (GGUF Q4_1)
    group_size: int,
) -> dict[str, torch.Tensor] | None:
    """An `Int4Linear`'s tensors in the layout of the fastest CPU kernel that runs here for
    this group size, or None where only the AutoGPTQ layout's reference would: Pagoda's int4
    kernel where the bf16 one runs (`gemv_enabled`: AVX512-BF16; any group size that is a
    multiple of 16 and divides K), else torch's (`_weight_int4pack_mm_for_cpu`, group sizes
    32-256; OpenMP's fork-join team, and not batch-invariant)."""
    if gemv_enabled() and group_size % 16 == 0 and q.shape[1] % group_size == 0:
        kernel_weight = cpu_kernels.pack_int4_weight(q.to(torch.uint8), int4_scale_offset(scales, zeros), group_size)
        from engine.huge_pages import onto_huge_pages

        return {"kernel_weight": onto_huge_pages(kernel_weight)}
    if cpu_int4_mm_available() and group_size in CPU_INT4_GROUP_SIZES:
        packed, scales_and_zeros = pack_int4_cpu(q, scales, zeros, group_size)
        return {"qweight": packed, "scales_and_zeros": scales_and_zeros}
    return None


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
    """The serving module of a per-group INT4 weight: on CPU the layout of the fastest kernel
    that runs here (`cpu_int4_tensors`), else (CUDA, or no CPU kernel) the AutoGPTQ layout."""
    scales, zeros = qt.scale.t().contiguous(), qt.zero.t().contiguous()  # [K / G, N]
    if device.type == "cuda" and not (qt.group_size % 8 == 0 and qt.q.shape[1] % qt.group_size == 0):
        # The Triton kernel takes any multiple of 8 (group -1 is G = K): refused here, at
        # load, rather than served by the dequantizing reference on every call.
        raise ValueError(
            f"INT4 group size {qt.group_size} (K={qt.q.shape[1]}) is not served on CUDA: the W4A16 kernel "
            "needs a multiple of 8 that divides K"
        )
    tensors = cpu_int4_tensors(qt.q, scales, zeros, qt.group_size) if device.type == "cpu" else None
    if tensors is None:
        tensors = {"qweight": pack_int4(qt.q), "scales": scales.to(dtype), "zeros": zeros.to(torch.uint8)}
    return Int4Linear({k: v.to(device) for k, v in tensors.items()}, qt.group_size, bias)


def w8a8_linear_module(
    qt: QuantizedTensor, bias: torch.Tensor | None, device: torch.device, smooth: torch.Tensor | None = None
) -> W8A8Linear:
    """The serving module of a symmetric per-channel int8 weight with int8 activations."""
    qweight = _symmetric_int8(qt, "W8A8")
    return W8A8Linear(qweight.to(device), qt.scale.squeeze(1).to(device), bias, smooth)
