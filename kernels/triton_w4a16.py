"""W4A16 GEMM in Triton: `x @ dequantize(qweight).T`, dequantizing inside the kernel.

Same signature and layout as `kernels.quant_reference.w4a16_linear_ref` (AutoGPTQ
`qweight` [K / 8, N] int32, sequential nibbles along K; per-group scales and optional
integer zeros [K / G, N]; any group size that is a multiple of 8 and divides K, so
AutoGPTQ's group_size -1, one group per row, is G = K, and 256 runs too). Each program loads a [BLOCK_K / 8, BLOCK_N] tile of packed
int32 once, shifts it out to [BLOCK_K / 8, 8, BLOCK_N] nibbles, applies the scale and
zero of each packed row (gathered: 8 consecutive k always share a group) and reshapes to
the [BLOCK_K, BLOCK_N] operand of a 16-bit `tl.dot` (fp32 accumulate).

Two launch shapes of the one kernel (`_w4a16_config`):
- decode, M <= 16: one 16-row tile (tensor-core minimum; padding rows are masked loads,
  free in a weight-bound GEMV), narrow N tiles and split-K so that ~2 programs per SM
  stream weights: Llama-3-8B's down_proj (N = 4096) has only 64 N tiles for 132 SMs.
  Split-K partials go to an fp32 [SPLIT_K, M, N] buffer the launcher sums (deterministic,
  unlike atomics; for that down_proj, 5 splits on an H200, the buffer is written and read
  once: 0.3% of the weight bytes at M = 1, 9% at M = 16).
- prefill, M > 16: 64- or 128-row tiles in grouped launch order (weight tiles reused
  from L2 across row tiles), no split.

Batch-invariant mode (`invariant=True`, `--batch-invariant`): one config at every M
(`INVARIANT_CONFIG`: 64-row tiles, BLOCK_K 64, no split), so a row's K loop, its
accumulation order and its single rounding do not depend on how many rows share the call.
The default configs change BLOCK_K and split-K with M (and split-K with the SM count).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.triton_runtime import check_device_runs_triton
from kernels.triton_tiles import grouped_tile

DECODE_MAX_ROWS = 16
_INTERPRETER_SMS = 4  # the interpreter has no SMs; small enough that tests reach split-K


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K]
    qweight_ptr,  # [K // 8, N] int32
    scales_ptr,  # [K // GROUP_SIZE, N]
    zeros_ptr,  # [K // GROUP_SIZE, N] integer zero points (unused unless HAS_ZEROS)
    bias_ptr,  # [N] (unused unless HAS_BIAS)
    out_ptr,  # [M, N] when SPLIT_K == 1, else fp32 partials [SPLIT_K, M, N]
    M,
    N,
    K,
    K_PER_SPLIT,  # multiple of BLOCK_K
    stride_xm: tl.int64,
    stride_qk: tl.int64,
    stride_sk: tl.int64,
    stride_zk: tl.int64,
    stride_om: tl.int64,
    stride_os: tl.int64,
    GROUP_SIZE: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
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
    shifts = tl.arange(0, 8) * 4
    k_start = tl.program_id(1) * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & (offs_k[None, :] < K),
            other=0.0,
        )
        rows = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # packed rows = groups of 8 consecutive k
        mask_w = (rows[:, None] < K // 8) & mask_n[None, :]
        packed = tl.load(qweight_ptr + rows[:, None].to(tl.int64) * stride_qk + offs_n[None, :], mask=mask_w, other=0)
        group_rows_k = (rows // (GROUP_SIZE // 8)).to(tl.int64)
        scale = tl.load(scales_ptr + group_rows_k[:, None] * stride_sk + offs_n[None, :], mask=mask_w, other=0.0)
        q = (packed[:, None, :] >> shifts[None, :, None]) & 0xF  # [BLOCK_K / 8, 8, BLOCK_N]
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group_rows_k[:, None] * stride_zk + offs_n[None, :], mask=mask_w, other=0)
            w = (q.to(tl.float32) - zero.to(tl.float32)[:, None, :]) * scale.to(tl.float32)[:, None, :]
        else:
            w = (q.to(tl.float32) - 8.0) * scale.to(tl.float32)[:, None, :]
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))
        acc += tl.dot(x.to(x_ptr.dtype.element_ty), w.to(x_ptr.dtype.element_ty), input_precision=DOT_PRECISION)
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        out = out_ptr + tl.program_id(1) * stride_os + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out, acc, mask=mask)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_k_output(x: torch.Tensor, n: int, config: dict[str, int]) -> tuple[torch.Tensor, tuple[int, int]]:
    """The output buffer and launch grid of a weight-only GEMM with `config`'s tiles: [M, N]
    in x's dtype without split-K; with it, float32 partial sums [SPLIT_K, M, N] that the
    caller reduces (and scales, biases and casts) after the kernel."""
    m, split_k = x.shape[0], config["SPLIT_K"]
    if split_k == 1:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    return out, (triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"]), split_k)


# --batch-invariant: the one config of every M (the middle row of `_w4a16_config`, unsplit).
INVARIANT_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4,
                    "SPLIT_K": 1}


def _w4a16_config(m: int, n: int, k: int, num_sms: int, invariant: bool = False) -> dict[str, int]:
    """Tiles and split-K for an [M, K] x [K, N] product (the decode / prefill shapes above)."""
    if invariant:
        return {**INVARIANT_CONFIG, "K_PER_SPLIT": k}
    if m <= DECODE_MAX_ROWS:
        config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 4}
    elif m <= 64:
        config = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}
    else:
        return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
                "SPLIT_K": 1, "K_PER_SPLIT": k}
    tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(n, config["BLOCK_N"])
    k_blocks = triton.cdiv(k, config["BLOCK_K"])
    wanted = min(max(triton.cdiv(2 * num_sms, tiles), 1), k_blocks)
    k_per_split = triton.cdiv(k_blocks, wanted) * config["BLOCK_K"]
    return {**config, "SPLIT_K": triton.cdiv(k, k_per_split), "K_PER_SPLIT": k_per_split}


def supports_group_size(group_size: int, k: int) -> bool:
    """Whether the kernel takes groups of `group_size` along K: the 8 nibbles of a packed
    int32 must share a group (a multiple of 8) and the groups must tile K."""
    return group_size > 0 and group_size % 8 == 0 and k % group_size == 0


def w4a16_linear(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [K / 8, N] int32
    scales: torch.Tensor,  # [K / G, N]
    zeros: torch.Tensor | None,  # [K / G, N]
    group_size: int,
    bias: torch.Tensor | None = None,  # [N]
    *,
    invariant: bool = False,  # one config at every M (--batch-invariant)
) -> torch.Tensor:
    check_device_runs_triton(x.device)
    if x.dim() != 2 or qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"expected x [M, K] and int32 qweight [K/8, N], got {tuple(x.shape)}, {qweight.dtype}")
    m, k = x.shape
    n = qweight.shape[1]
    if not supports_group_size(group_size, k) or qweight.shape[0] * 8 != k:
        raise ValueError(
            f"K={k} must match qweight {tuple(qweight.shape)} and be a multiple of group_size {group_size} "
            "(a positive multiple of 8)"
        )
    if scales.shape != (k // group_size, n) or (zeros is not None and zeros.shape != scales.shape):
        raise ValueError(f"scales/zeros must be [{k // group_size}, {n}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    qweight, scales = qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    config = _w4a16_config(m, n, k, _num_sms(x.device), invariant)
    split_k = config["SPLIT_K"]
    out, grid = split_k_output(x, n, config)
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
        stride_om=out.stride(-2),
        stride_os=out.stride(0) if split_k > 1 else 0,
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None and split_k == 1,
        # fp32 inputs: exact fp32 products (tl.dot would default to tf32 on the GPU), as the attention kernel.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **config,
    )
    if split_k == 1:
        return out
    out = out.sum(dim=0)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)
