"""W8A16 GEMM in Triton: `x @ (scales[:, None] * qweight).T` reading the int8 weight once.

Same signature and layout as `kernels.quant_reference.w8a16_linear_ref` (`qweight` int8
[N, K], symmetric, one scale per output channel). The reference dequantizes the whole
weight to the activation dtype every call (an int8 read, a 16-bit write and a 16-bit read
per weight: ~5-7 bytes against bf16's 2), which made `--quantization int8` slower than no
quantization on a GPU. Here each program loads a [BLOCK_K, BLOCK_N] tile of int8 (1 byte
per weight), converts it to the activation dtype in registers (every int8 is exact in
fp16 and bf16) and feeds a 16-bit `tl.dot` with fp32 accumulation; the per-channel scale
does not depend on k, so it is applied once to the accumulator at the end.

The launch shapes are W4A16's (`kernels.triton_w4a16._w4a16_config`): for decode (M <= 16)
one 16-row tile, narrow N tiles and split-K so ~2 programs per SM stream the weight
(partials summed by the launcher, deterministic); for prefill 64/128-row tiles in grouped
order, no split. A split's partials are unscaled fp32; the launcher scales their sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import check_device_runs_triton
from kernels.triton_tiles import grouped_tile
from kernels.triton_w4a16 import _num_sms, _w4a16_config, split_k_output


@triton.jit
def _w8a16_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [N, K] int8
    scales_ptr,  # [N]
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    out_ptr,  # [M, N] when SPLIT_K == 1, else fp32 unscaled partials [SPLIT_K, M, N]
    M,
    N,
    K,
    K_PER_SPLIT,  # multiple of BLOCK_K
    stride_xm: tl.int64,
    stride_qn: tl.int64,
    stride_om: tl.int64,
    stride_os: tl.int64,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 activations (exact fp32 products), else "tf32" (unused)
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        q = tl.load(  # [BLOCK_N, BLOCK_K]: rows of the weight, contiguous along k
            qweight_ptr + offs_n[:, None].to(tl.int64) * stride_qn + offs_k[None, :],
            mask=mask_n[:, None] & mask_k[None, :],
            other=0,
        )
        w = tl.trans(q.to(x_ptr.dtype.element_ty))  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x.to(x_ptr.dtype.element_ty), w, input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        acc *= tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        out = out_ptr + tl.program_id(1) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=mask)


def w8a16_config(m: int, n: int, k: int, device: torch.device, invariant: bool = False) -> dict[str, int]:
    """Tiles and split-K of an [M, K] x [K, N] product on `device` (W4A16's shapes; with
    `invariant`, its one config of every M)."""
    return _w4a16_config(m, n, k, _num_sms(device), invariant)


def w8a16_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
    *,
    invariant: bool = False,  # one config at every M (--batch-invariant)
) -> torch.Tensor:
    check_device_runs_triton(x.device)
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"expected x [M, K] and int8 qweight [N, K], got {tuple(x.shape)}, {qweight.dtype}")
    m, k = x.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"qweight {tuple(qweight.shape)} does not take K={k} inputs")
    if scales.shape != (n,):
        raise ValueError(f"scales must be [{n}], got {tuple(scales.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    scales = scales.contiguous()
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    config = w8a16_config(m, n, k, x.device, invariant)
    split_k = config["SPLIT_K"]
    out, grid = split_k_output(x, n, config)
    _w8a16_kernel[grid](
        x_ptr=x,
        qweight_ptr=qweight,
        scales_ptr=scales,
        bias_ptr=bias if bias is not None else scales,
        out_ptr=out,
        M=m,
        N=n,
        K=k,
        stride_xm=x.stride(0),
        stride_qn=qweight.stride(0),
        stride_om=out.stride(-2),
        stride_os=out.stride(0) if split_k > 1 else 0,
        HAS_BIAS=bias is not None and split_k == 1,
        # fp32 inputs: exact fp32 products (tl.dot would default to tf32 on the GPU), as the attention kernel.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **config,
    )
    if split_k == 1:
        return out
    out = out.sum(dim=0) * scales.float()
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
