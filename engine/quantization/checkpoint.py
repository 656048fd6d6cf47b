"""Quantized checkpoint layouts: AutoAWQ, AutoGPTQ, and Pagoda's INT8 / W8A8.

Each layout maps one checkpoint module (`...q_proj`, unfused as in Hugging Face
checkpoints) to and from a `QuantizedLinear` (weights.py). `config.json` carries
`quantization_config`; `parse_quantization_config` reads it, `quantization_config`
writes it. The loader (engine/loader.py) concatenates the shards of our fused layers
(q/k/v -> qkv_proj, gate/up -> gate_up_proj) along N; the writer (`shard_tensors`)
splits them again.

AutoAWQ, `{"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": true,
"version": "gemm"}`, per module:
    qweight  int32 [K, N / 8]   nibble i of qweight[k, j] is q[8 j + AWQ_ORDER[i], k]
    qzeros   int32 [K / G, N / 8]   zero points, packed along N in the same order
    scales   fp16  [K / G, N]
    w = scales * (q - zero)  (zeros stored as they are)

AutoGPTQ, `{"quant_method": "gptq", "bits": 4, "group_size": G, "desc_act": bool,
"sym": bool, "checkpoint_format": "gptq" | "gptq_v2"}`, per module:
    qweight  int32 [K / 8, N]   nibble j of qweight[i, n] is q[n, 8 i + j]
    qzeros   int32 [K / G, N / 8]   nibble j of qzeros[g, c] is the zero of column 8 c + j
    scales   fp16  [K / G, N]
    g_idx    int32 [K]   group of each input column (act-order: not k // G)
    w = scales[g_idx[k]] * (q - zero[g_idx[k]])
  The historical "gptq" (v1) format stores zero - 1 (and AutoGPTQ/GPTQModel clamp a zero
  of 0 to a stored 0, i.e. it comes back as 1): readers add 1 (vLLM's exllama/gptq
  kernels do; "gptq_v2" stores the zero itself). Symmetric 4-bit has zero 8, stored 7.
  We write v1, what every reader accepts: our GPTQ keeps zero points >= 1 (gptq.py), so
  nothing is clamped. `group_size: -1` means one group per row.

Pagoda INT8 / W8A8 (our own; nobody else's INT8 layouts are simple),
`{"quant_method": "pagoda", "format": "int8" | "w8a8", "bits": 8}`, per module:
    qweight       int8    [N, K]   symmetric: w = weight_scale[n] * qweight[n, k]
    weight_scale  float32 [N]
    smooth        float32 [K]   optional (W8A8): activations are divided by it first
  "int8" serves `Int8Linear` (weight-only), "w8a8" serves `W8A8Linear` (per-token int8
  activations) for decoder linears; an `lm_head` stored this way is INT8 weight-only in
  both (as `--quantization int8|w8a8` makes it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.quantization.affine import (
    SEQUENTIAL_ORDER,
    QuantizedTensor,
    pack_int4,
    pack_nibbles,
    unpack_int4,
    unpack_nibbles,
)
from engine.quantization.weights import QuantizedLinear

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PAGODA_FORMATS = ("int8", "w8a8")


@dataclass(slots=True, frozen=True)
class CheckpointQuantization:
    """What `quantization_config` says, in the terms the loader needs."""

    layout: str  # "awq" | "gptq" | "int8" | "w8a8"
    bits: int
    group_size: int | None  # None: one group per row
    sym: bool = False
    desc_act: bool = False
    zero_offset: int = 0  # added to stored zeros (1 for GPTQ v1)

    def group(self, in_features: int) -> int:
        return in_features if self.group_size is None else self.group_size


def parse_quantization_config(cfg: dict[str, Any]) -> CheckpointQuantization:
    """`quantization_config` of config.json -> CheckpointQuantization; ValueError for what we cannot serve."""
    method = str(cfg.get("quant_method", "")).lower()
    if method == "pagoda":
        fmt = cfg.get("format")
        if fmt not in PAGODA_FORMATS:
            raise ValueError(f"pagoda quantization format must be one of {PAGODA_FORMATS}, got {fmt!r}")
        return CheckpointQuantization(layout=fmt, bits=8, group_size=None, sym=True)
    if method not in ("awq", "gptq"):
        raise ValueError(f"quant_method {method!r} is not supported (awq, gptq, pagoda)")
    bits = int(cfg.get("bits", cfg.get("w_bit", 0)))
    if bits != 4:
        raise ValueError(f"only 4-bit {method} checkpoints are supported, got bits={bits}")
    group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    group = None if group_size == -1 else group_size
    if group is not None and (group < 8 or group % 8):
        raise ValueError(f"group_size must be -1 or a multiple of 8, got {group_size}")
    if method == "awq":
        version = str(cfg.get("version", "gemm")).lower()
        if version != "gemm" or not cfg.get("zero_point", True):
            raise ValueError(f"only AWQ version 'gemm' with zero_point=true is supported, got {version!r}")
        return CheckpointQuantization("awq", 4, group)
    fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    return CheckpointQuantization(
        "gptq", 4, group, sym=bool(cfg.get("sym", True)), desc_act=bool(cfg.get("desc_act", False)),
        zero_offset=1 if fmt == "gptq" else 0,
    )


def quantization_config(layout: str, bits: int, group_size: int | None, sym: bool = False, desc_act: bool = False) -> dict[str, Any]:
    """The `quantization_config` that `pack` with these settings needs in config.json."""
    group = -1 if group_size is None else group_size
    if layout == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    if layout == "gptq":
        return {
            "quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True,
        }
    if layout in PAGODA_FORMATS:
        return {"quant_method": "pagoda", "format": layout, "bits": 8}
    raise ValueError(f"unknown layout {layout!r}")


# ---- one module <-> QuantizedLinear ----------------------------------------------------------------
def pack(ql: QuantizedLinear, spec: CheckpointQuantization) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one (unfused) module; the bias is the caller's."""
    qt = ql.qt
    if spec.layout in PAGODA_FORMATS:
        if qt.bits != 8 or qt.group_size != qt.q.shape[1] or not bool((qt.zero == 128).all()):
            raise ValueError("Pagoda INT8 layouts hold symmetric per-channel 8-bit weights")
        out = {"qweight": (qt.q - qt.zero).to(torch.int8), "weight_scale": qt.scale.squeeze(1).float()}
        if ql.smooth is not None:
            out["smooth"] = ql.smooth.float()
        return out
    if qt.bits != 4:
        raise ValueError(f"{spec.layout} checkpoints hold 4-bit weights, got {qt.bits}")
    scales = qt.scale.t().contiguous().to(torch.float16)  # [K / G, N]
    zeros = qt.zero.t().contiguous()  # [K / G, N]
    if spec.layout == "awq":
        if ql.g_idx is not None:
            raise ValueError("AWQ checkpoints have no act-order (g_idx)")
        return {
            "qweight": pack_nibbles(qt.q.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_nibbles(zeros, AWQ_ORDER),
            "scales": scales,
        }
    stored = (zeros - spec.zero_offset).clamp(0, 15)
    if not torch.equal(stored + spec.zero_offset, zeros):
        raise ValueError("a zero point of 0 cannot be stored in the GPTQ v1 format (it stores zero - 1)")
    return {
        "qweight": pack_int4(qt.q),
        "qzeros": pack_nibbles(stored, SEQUENTIAL_ORDER),
        "scales": scales,
        "g_idx": ql.group_index().to(torch.int32),
    }


def unpack(tensors: dict[str, torch.Tensor], spec: CheckpointQuantization) -> QuantizedLinear:
    """One module's checkpoint tensors (`qweight`, ... and optionally `bias`) -> QuantizedLinear."""
    bias = tensors.get("bias")
    bias = None if bias is None else bias.float()
    try:
        if spec.layout in PAGODA_FORMATS:
            qweight = tensors["qweight"]
            n, k = qweight.shape
            q = qweight.to(torch.int32) + 128
            qt = QuantizedTensor(q, tensors["weight_scale"].float().reshape(n, 1), torch.full((n, 1), 128, dtype=torch.int32), 8, k)
            smooth = tensors.get("smooth")
            return QuantizedLinear(qt, None, bias, None if smooth is None else smooth.float())
        scales = tensors["scales"].float()  # [K / G, N]
        if spec.layout == "awq":
            q = unpack_nibbles(tensors["qweight"], AWQ_ORDER).t().contiguous()  # [N, K]
            zeros = unpack_nibbles(tensors["qzeros"], AWQ_ORDER)
            g_idx = None
        else:
            q = unpack_int4(tensors["qweight"])
            zeros = unpack_nibbles(tensors["qzeros"], SEQUENTIAL_ORDER) + spec.zero_offset
            g_idx = tensors.get("g_idx")
    except KeyError as e:
        raise ValueError(f"a {spec.layout} module lacks its {e.args[0]!r} tensor") from e
    n, k = q.shape
    group = spec.group(k)
    if k % group or tuple(scales.shape) != (k // group, n) or tuple(zeros.shape) != (k // group, n):
        raise ValueError(
            f"{spec.layout} tensors disagree: q [{n}, {k}], group {group}, scales {tuple(scales.shape)}, "
            f"zeros {tuple(zeros.shape)}"
        )
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, torch.arange(k, dtype=torch.int32) // group):
            g_idx = None  # the plain order: no permutation needed
    qt = QuantizedTensor(q, scales.t().contiguous(), zeros.t().contiguous(), 4, group)
    return QuantizedLinear(qt, g_idx, bias)


def concat_shards(shards: list[QuantizedLinear]) -> QuantizedLinear:
    """Shards of a fused layer (q, k, v or gate, up) stacked along N."""
    if len(shards) == 1:
        return shards[0]
    first = shards[0]
    for s in shards[1:]:
        if s.qt.bits != first.qt.bits or s.qt.group_size != first.qt.group_size or s.shape[1] != first.shape[1]:
            raise ValueError("the shards of a fused layer must share bits, group size and input features")
        if (s.g_idx is None) != (first.g_idx is None) or (s.g_idx is not None and not torch.equal(s.g_idx, first.g_idx)):
            raise ValueError("the shards of a fused layer (q/k/v or gate/up) have different g_idx")
        if (s.smooth is None) != (first.smooth is None) or (s.smooth is not None and not torch.equal(s.smooth, first.smooth)):
            raise ValueError("the shards of a fused layer (q/k/v or gate/up) have different smoothing factors")
    biases = [s.bias for s in shards]
    if any(b is None for b in biases) and not all(b is None for b in biases):
        raise ValueError("some shards of a fused layer have a bias and some do not")
    qt = QuantizedTensor(
        torch.cat([s.qt.q for s in shards]), torch.cat([s.qt.scale for s in shards]),
        torch.cat([s.qt.zero for s in shards]), first.qt.bits, first.qt.group_size,
    )
    bias = None if biases[0] is None else torch.cat(biases)
    return QuantizedLinear(qt, first.g_idx, bias, first.smooth)


def split_shards(ql: QuantizedLinear, sizes: list[int]) -> list[QuantizedLinear]:
    """The inverse of `concat_shards`: rows of `sizes` each."""
    out, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        qt = QuantizedTensor(ql.qt.q[rows], ql.qt.scale[rows], ql.qt.zero[rows], ql.qt.bits, ql.qt.group_size)
        out.append(QuantizedLinear(qt, ql.g_idx, None if ql.bias is None else ql.bias[rows], ql.smooth))
        start += size
    return out
