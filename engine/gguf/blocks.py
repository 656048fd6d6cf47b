"""GGUF quant blocks -> Pagoda's integer weights, or float.

llama.cpp stores a weight [N, K] row by row in blocks of 32 input columns:

    Q4_0  d fp16, 16 bytes of nibbles     w = d * (q - 8)           q in [0, 15]
    Q4_1  d fp16, m fp16, 16 bytes        w = d * q + m             q in [0, 15]
    Q8_0  d fp16, 32 int8                 w = d * q                 q in [-127, 127]

Nibble j of a block (j < 16) is the low half of byte j, nibble j + 16 the high half.

How they map onto Pagoda's affine form w = scale * (q - zero) (engine/quantization/affine.py):

- Q4_0: scale d, zero 8, group 32: the same integers, exactly.
- Q4_1: scale d, zero -m / d, group 32: the same integers; the zero point is fractional (the
  minimum m is not a multiple of d), so it is kept as a float32, which both INT4 kernels take
  as it is: the CPU int4 kernels (Pagoda's and torch's) compute (q - 8) * scale + offset with
  offset = scale * (8 - zero) = 8 d + m, the AutoGPTQ-layout kernels (reference, Triton)
  (q - zero) * scale. Exact up to float32 rounding of -m / d and up to what each kernel stores:
  the CPU kernels keep scale and offset in bfloat16 (as for every INT4 weight they serve).
- Q8_0: Pagoda's INT8 is one scale per output row, not per block of 32, so the Q8_0 weight is
  requantized per row (w = d_g q exactly, then symmetric per-channel RTN, as
  `--quantization int8` does): not exact, a second rounding of at most half a row step.

Every other type (F16, BF16, the K-quants, ...) is dequantized by the `gguf` package, the
same code transformers' GGUF loader runs.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, dequantize

from engine.quantization.affine import QuantizedTensor
from engine.quantization.rtn import quantize_weight
from engine.quantization.weights import QuantizedLinear

BLOCK = 32
KEPT_TYPES = {GGMLQuantizationType.Q4_0: 4, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 8}
"""GGUF types served on Pagoda's integer paths, and their bits."""
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _blocks(data: np.ndarray, rows: int, block_bytes: int) -> np.ndarray:
    """A tensor's raw bytes as uint8 [rows, K / 32, block_bytes]."""
    return np.ascontiguousarray(data).view(np.uint8).reshape(rows, -1, block_bytes)


def _half(b: np.ndarray) -> torch.Tensor:
    """Two bytes per block -> float32 [rows, K / 32] (fp16 -> fp32 is exact)."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    """16 bytes per block -> int32 [rows, K], nibble order of llama.cpp (low halves first)."""
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [rows, K / 32, 32]
    return torch.from_numpy(q.reshape(q.shape[0], -1).astype(np.int32))


def decode_q4_0(data: np.ndarray, rows: int) -> QuantizedTensor:
    b = _blocks(data, rows, 18)
    scale = _half(b[..., 0:2])
    return QuantizedTensor(_nibbles(b[..., 2:]), scale, torch.full_like(scale, 8, dtype=torch.int32), 4, BLOCK)


def decode_q4_1(data: np.ndarray, rows: int) -> QuantizedTensor:
    b = _blocks(data, rows, 20)
    d, m, q = _half(b[..., 0:2]), _half(b[..., 2:4]), _nibbles(b[..., 4:])
    flat = d == 0  # a constant block: every weight is m (llama.cpp ignores q)
    if not bool(flat.any()):
        return QuantizedTensor(q, d, -m / d, 4, BLOCK)
    scale = torch.where(flat, torch.where(m != 0, m, torch.ones_like(m)), d)
    zero = torch.where(flat, torch.where(m != 0, -1.0, 0.0), -m / torch.where(flat, 1.0, d))
    q = torch.where(flat.repeat_interleave(BLOCK, dim=1), 0, q)  # w = m * (0 - (-1)) = m
    return QuantizedTensor(q, scale, zero.float(), 4, BLOCK)


def decode_q8_0(data: np.ndarray, rows: int) -> QuantizedTensor:
    """Q8_0 as it is: int8 values offset by 128 (Pagoda's symmetric zero point), group 32."""
    b = _blocks(data, rows, 34)
    scale = _half(b[..., 0:2])
    q = torch.from_numpy(np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(rows, -1).astype(np.int32)) + 128
    return QuantizedTensor(q, scale, torch.full_like(scale, 128, dtype=torch.int32), 8, BLOCK)


_DECODERS = {
    GGMLQuantizationType.Q4_0: decode_q4_0,
    GGMLQuantizationType.Q4_1: decode_q4_1,
    GGMLQuantizationType.Q8_0: decode_q8_0,
}


def decode(data: np.ndarray, qtype: GGMLQuantizationType, rows: int) -> QuantizedTensor:
    """The block integers and scales of a Q4_0 / Q4_1 / Q8_0 tensor with `rows` rows."""
    return _DECODERS[qtype](data, rows)


def served_linear(ql: QuantizedLinear) -> QuantizedLinear:
    """What Pagoda serves for a decoded linear: INT4 group 32 as it is; Q8_0 requantized to
    INT8 per output row (the only INT8 layout the kernels have)."""
    if ql.qt.bits == 4:
        return ql
    return QuantizedLinear(quantize_weight(ql.dequantize(), "int8"), bias=ql.bias)  # from exactly the Q8_0 weight


def to_float(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """Any GGUF tensor (named `name`, for errors) as float32 of `shape` (HF order: rows first)."""
    if qtype == GGMLQuantizationType.F32:
        out = np.array(data, dtype=np.float32)  # a copy: the reader's array maps the file read-only
    elif qtype == GGMLQuantizationType.F16:
        out = np.asarray(data).view(np.float16).astype(np.float32)
    else:
        try:
            out = dequantize(np.asarray(data), qtype).astype(np.float32, copy=False)
        except NotImplementedError:
            raise ValueError(
                f"{name}: GGUF tensor type {qtype.name} is not supported (float, Q*, K-quant and IQ* weights are)"
            ) from None
    return torch.from_numpy(np.ascontiguousarray(out).reshape(shape))
