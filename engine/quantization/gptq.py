"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each column's
rounding error onto the columns not yet quantized, weighted by the inverse Hessian of
the layer's squared output error, H = 2 X^T X / num_tokens (X: the calibration inputs).

The algorithm is the reference one (IST-DASLab `gptq`, AutoGPTQ `fasterquant`):
- dead inputs (H_kk = 0) get H_kk = 1 and a zero weight column;
- act-order (`act_order=True`, AutoGPTQ's `desc_act`): columns in order of decreasing
  H_kk, so the most-used inputs are quantized while the most columns are left to absorb
  their error; `g_idx[k]` then names the group of input column k;
- dampening: H += damp * mean(diag H) * I, then the upper Cholesky factor U of H^-1
  (U[i, i:] is row i of the inverse Hessian of the columns i.. that remain);
- within a block of `block_size` columns the updates are applied eagerly, to the
  columns right of the block lazily, once per block (one GEMM instead of K rank-1 updates).
Group parameters (scale, zero) are taken from a group's values at the moment its first
column is reached, including every update applied so far, the lazy ones included — so
the result is exactly that of the unbatched OBQ recursion for any block size (a test
checks it), where the reference code reads the lazily-not-yet-updated columns. Scales
are rounded to float16 and asymmetric zero points kept >= 1 (`group_qparams`), so the
AutoGPTQ checkpoint (fp16 scales, "gptq" format storing zero - 1) holds exactly what
the error compensation assumed; a group that would want zero 0 (no negative weight
worth a half step) gets the grid one step lower instead.
"""

from __future__ import annotations

from typing import Callable

import torch

from engine.models.llama import LlamaForCausalLM
from engine.quantization.affine import QuantizedTensor, dequantize, quantize
from engine.quantization.calibration import DECODER_LINEARS, LayerwiseCalibration, quantize_layers
from engine.quantization.weights import QuantizedLinear, stored_qparams

def group_qparams(values: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of `values` [N, G] as GPTQ stores them."""
    scale, zero = stored_qparams(values.amin(dim=1), values.amax(dim=1), bits, symmetric)
    return scale, zero if symmetric else zero.clamp(min=1)


def hessian(x: torch.Tensor) -> torch.Tensor:
    """H = 2 X^T X / num_tokens of inputs x [num_tokens, K] (float32 [K, K])."""
    x = x.reshape(-1, x.shape[-1]).float()
    return (2.0 / x.shape[0]) * (x.t() @ x)


@torch.no_grad()
def gptq_quantize_weight(
    weight: torch.Tensor,  # [N, K]
    hessian: torch.Tensor,  # [K, K]
    bits: int = 4,
    group_size: int | None = 128,  # None: one group per row (per-channel)
    symmetric: bool = True,
    act_order: bool = False,
    block_size: int = 128,
    damp: float = 0.01,
) -> QuantizedLinear:
    """GPTQ of one weight. Computes in float32 (float64 if the weight is float64)."""
    n, k = weight.shape
    group = k if group_size is None else group_size
    if k % group:
        raise ValueError(f"group_size {group} does not divide the {k} input columns")
    if block_size < 1 or not 0 <= damp:
        raise ValueError(f"need block_size >= 1 and damp >= 0, got {block_size}, {damp}")
    dt = torch.float64 if weight.dtype == torch.float64 else torch.float32
    W = weight.to(dt).clone()
    H = hessian.to(dt).clone()
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = torch.argsort(H.diagonal(), descending=True, stable=True) if act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * H.diagonal().mean())
    try:
        U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    except torch.linalg.LinAlgError as e:
        raise ValueError("the Hessian is not positive definite: use more calibration tokens or a larger damp") from e

    Q = torch.zeros(n, k, dtype=torch.int32)
    scales = torch.zeros(n, k // group, dtype=torch.float32)
    zeros = torch.zeros(n, k // group, dtype=torch.int32)
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group == 0:
                g = col // group
                inside = W1[:, i : i + group]  # this block: fully updated
                beyond = min(col + group, k) - i2  # later blocks: add this block's pending update
                if beyond > 0:
                    pending = Err1[:, :i] @ U[i1:col, i2 : i2 + beyond]
                    inside = torch.cat([inside, W[:, i2 : i2 + beyond] - pending], dim=1)
                s, z = group_qparams(inside, bits, symmetric)
                scales[:, g], zeros[:, g] = s, z
                s, z = s.to(dt), z
            w = W1[:, i]
            q = quantize(w, s, z, bits)
            Q[:, col] = q
            err = (w - dequantize(q, s, z).to(dt)) / U1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * U1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    g_idx = None
    if perm is not None:
        inverse = torch.argsort(perm)
        Q = Q[:, inverse]
        g_idx = (inverse // group).to(torch.int32)  # column perm[j] sits at position j
    return QuantizedLinear(QuantizedTensor(Q, scales, zeros, bits, group), g_idx)


@torch.no_grad()
def gptq_quantize_layer(
    calib: LayerwiseCalibration, index: int, bits: int = 4, group_size: int | None = 128,
    symmetric: bool = True, act_order: bool = False,
) -> dict[str, QuantizedLinear]:
    """GPTQ of decoder layer `index`, its linears in order (AutoGPTQ's `true_sequential`):
    each one's Hessian comes from inputs computed with the linears before it already
    quantized. Leaves the layer fake-quantized and `calib` past it (quantized outputs)."""
    layer = calib.layer(index)
    results = {}
    for name in DECODER_LINEARS:
        x = calib.capture(index, [name])[name]
        linear = layer.get_submodule(name)
        ql = gptq_quantize_weight(linear.weight, hessian(x), bits, group_size, symmetric, act_order)
        ql.bias = None if linear.bias is None else linear.bias.detach().clone()
        linear.weight.copy_(ql.dequantize().to(linear.weight.dtype))
        results[name] = ql
    calib.advance(index)
    return results


def gptq_quantize_model(
    model: LlamaForCausalLM,
    sequences: torch.Tensor,  # [num_sequences, seq_len] calibration tokens
    bits: int = 4,
    group_size: int | None = 128,
    symmetric: bool = True,
    act_order: bool = False,
    on_layer: Callable[[int, int], None] | None = None,
) -> dict[str, QuantizedLinear]:
    """GPTQ of every decoder linear, layer by layer; the model's weights are left
    fake-quantized (the dequantized values). Returns {module name: QuantizedLinear}.
    `on_layer(done, num_layers)` is called after each layer (progress)."""
    calib = LayerwiseCalibration(model, sequences)
    return quantize_layers(
        model, lambda index: gptq_quantize_layer(calib, index, bits, group_size, symmetric, act_order), on_layer)
