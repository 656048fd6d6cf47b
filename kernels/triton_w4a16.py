"""W4A16 GEMM in Triton: `x @ dequantize(qweight).T`, dequantizing inside the kernel.

Same signature and layout as `kernels.quant_reference.w4a16_linear_ref` (AutoGPTQ
`qweight` [K / 8, N] int32, sequential nibbles along K; per-group scales and optional
integer zeros [K / G, N]). One program computes a BLOCK_M x BLOCK_N tile, walking K in
BLOCK_K steps (BLOCK_K divides every supported group size, so each step reads one group
row of scales/zeros per column). A GEMV-specialised path for 1-16 rows is not here yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import check_device_runs_triton

_BLOCK_K = 32  # divides group sizes 32/64/128; 4 int32 rows of qweight


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K // 8, N] int32
    scales_ptr,  # [K // GROUP_SIZE, N]
    zeros_ptr,  # [K // GROUP_SIZE, N] integer zero points (unused unless HAS_ZEROS)
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm: tl.int64,
    stride_qk: tl.int64,
    stride_sk: tl.int64,
    stride_zk: tl.int64,
    stride_om: tl.int64,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
        packed = tl.load(
            qweight_ptr + (offs_k[:, None] // 8).to(tl.int64) * stride_qk + offs_n[None, :], mask=mask_n[None, :], other=0
        )
        q = (packed >> ((offs_k[:, None] % 8) * 4)) & 0xF  # [BLOCK_K, BLOCK_N]
        group = k0 // GROUP_SIZE
        scale = tl.load(scales_ptr + group * stride_sk + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group * stride_zk + offs_n, mask=mask_n, other=0).to(tl.float32)
        else:
            zero = tl.full((BLOCK_N,), 8.0, dtype=tl.float32)
        w = (q.to(tl.float32) - zero[None, :]) * scale[None, :]
        acc += tl.dot(x.to(x_ptr.dtype.element_ty), w.to(x_ptr.dtype.element_ty))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor | None,  # [K / G, N]
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    check_device_runs_triton(x.device)
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"expected x [M, K] and int32 qweight [K/8, N], got {tuple(x.shape)}, {qweight.dtype}")
    m, k = x.shape
    n = qweight.shape[1]
    if group_size not in (32, 64, 128) or k % group_size or qweight.shape[0] * 8 != k:
        raise ValueError(f"K={k} must match qweight {tuple(qweight.shape)} and be a multiple of group_size {group_size} (32/64/128)")
    if scales.shape != (k // group_size, n) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"scales/zeros must be [{k // group_size}, {n}]")
    x = x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = 16, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x_ptr=x,
        qweight_ptr=qweight,
        scales_ptr=scales,
        zeros_ptr=zeros if zeros is not None else scales,
        bias_ptr=bias if bias is not None else scales,
        out_ptr=out,
        M=m,
        N=n,
        K=k,
        stride_xm=x.stride(0),
        stride_qk=qweight.stride(0),
        stride_sk=scales.stride(0),
        stride_zk=zeros.stride(0) if zeros is not None else 0,
        stride_om=out.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=_BLOCK_K,
    )
    return out
