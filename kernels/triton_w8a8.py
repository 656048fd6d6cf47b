"""W8A8 in Triton: per-token int8 activation quantization, and the int8 x int8 -> int32 GEMM.

Same signatures and numerics as `kernels.quant_reference.quantize_per_token_ref` and
`w8a8_linear_ref`:
- `quantize_per_token(x)`: one program per row; absmax in fp32, then
  q = round_half_even(x * (127 / absmax)) with an IEEE division (`div_rn`: Triton's plain
  fp32 `/` is an approximate division on CUDA) and no FMA contraction, so kernel and
  reference agree bit for bit.
- `w8a8_linear(qx, x_scale, qweight, w_scale, bias, out_dtype)`: `tl.dot` on int8 tiles
  accumulating in int32 (exact), then out = acc * x_scale[m] * w_scale[n] (+ bias) in fp32.
  Tiles by M: 16 rows (decode) up to 128 x 128 x 128 (prefill: int8 tensor-core tiles of
  the size Triton's Hopper matmul tutorials use), grouped launch order so programs that
  share weight columns run together and hit L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import check_device_runs_triton
from kernels.triton_tiles import grouped_tile

_MAX_QUANT_BLOCK = 4096  # row chunk of the quantization kernel: Llama hidden sizes in one pass


@triton.jit
def _round_half_even(y):
    """torch.round / CUDA rint, from floor (the interpreter has no libdevice); exact for |y| < 2^22."""
    f = tl.floor(y)
    diff = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    up = (diff > 0.5) | ((diff == 0.5) & odd)
    return tl.where(up, f + 1.0, f)


@triton.jit
def _quantize_per_token_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] int8
    scale_ptr,  # [M] float32
    K,
    stride_xm: tl.int64,
    stride_qm: tl.int64,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    absmax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    amax = tl.max(absmax, axis=0)
    inv = tl.where(amax > 0.0, tl.math.div_rn(127.0, tl.where(amax > 0.0, amax, 1.0)), 0.0)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(_round_half_even(x * inv), -127.0), 127.0)
        tl.store(q_ptr + row * stride_qm + offs, q.to(tl.int8), mask=offs < K)
    tl.store(scale_ptr + row, tl.math.div_rn(amax, 127.0))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (q int8 [M, K], x_scale float32 [M, 1])."""
    check_device_runs_triton(x.device)
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"expected a floating-point x [M, K], got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m == 0 or k == 0:
        return q, scale.zero_()
    _quantize_per_token_kernel[(m,)](
        x_ptr=x,
        q_ptr=q,
        scale_ptr=scale,
        K=k,
        stride_xm=x.stride(0),
        stride_qm=q.stride(0),
        BLOCK_K=min(triton.next_power_of_2(k), _MAX_QUANT_BLOCK),
        num_warps=4,
        enable_fp_fusion=False,  # an FMA of x * inv into the rounding would break bit-equality
    )
    return q, scale


@triton.jit
def _w8a8_kernel(
    qx_ptr,  # [M, K] int8
    x_scale_ptr,  # [M] float32
    qweight_ptr,  # [N, K] int8
    w_scale_ptr,  # [N]
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm: tl.int64,
    stride_wn: tl.int64,
    stride_om: tl.int64,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m, pid_n = grouped_tile(pid, M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = qx_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_ptrs = qweight_ptr + offs_n[None, :].to(tl.int64) * stride_wn  # read as [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_ptrs + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(w_ptrs + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    x_scale = tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    out = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _w8a8_config(m: int) -> dict[str, int]:
    """Tile sizes by the number of rows: decode is a weight stream, prefill is compute-bound."""
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


def w8a8_linear(
    qx: torch.Tensor,  # [M, K] int8
    x_scale: torch.Tensor,  # [M, 1] float32
    qweight: torch.Tensor,  # [N, K] int8
    w_scale: torch.Tensor,  # [N]
    bias: torch.Tensor | None = None,  # [N]
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    check_device_runs_triton(qx.device)
    if qx.dim() != 2 or qweight.dim() != 2 or qx.dtype != torch.int8 or qweight.dtype != torch.int8:
        raise ValueError(f"expected int8 qx [M, K] and int8 qweight [N, K], got {qx.dtype} {tuple(qx.shape)}, "
                         f"{qweight.dtype} {tuple(qweight.shape)}")
    m, k = qx.shape
    n = qweight.shape[0]
    if qweight.shape[1] != k:
        raise ValueError(f"qx has K={k} columns but qweight is {tuple(qweight.shape)}")
    if x_scale.numel() != m or w_scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"x_scale must have {m} entries, w_scale and bias {n}")
    qx = qx if qx.stride(1) == 1 else qx.contiguous()
    qweight = qweight if qweight.stride(1) == 1 else qweight.contiguous()
    out = torch.empty(m, n, dtype=out_dtype, device=qx.device)
    if m == 0 or n == 0:
        return out
    config = _w8a8_config(m)
    grid = (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]),)
    _w8a8_kernel[grid](
        qx_ptr=qx,
        x_scale_ptr=x_scale.float().contiguous(),
        qweight_ptr=qweight,
        w_scale_ptr=w_scale.contiguous(),
        bias_ptr=bias.contiguous() if bias is not None else w_scale,
        out_ptr=out,
        M=m,
        N=n,
        K=k,
        stride_xm=qx.stride(0),
        stride_wn=qweight.stride(0),
        stride_om=out.stride(0),
        HAS_BIAS=bias is not None,
        **config,
    )
    return out
