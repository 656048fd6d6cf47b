"""GPTQ and AWQ (engine/quantization/gptq.py, awq.py).

GPTQ's batched, Cholesky-based loop is checked against the plain OBQ recursion written
out here (explicit inverse Hessian, one column at a time, Gaussian elimination of the
quantized column), bit for bit. Both methods must beat round-to-nearest on what they
optimise: a real SmolLM2 layer's output error on calibration tokens.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from engine.loader import load_model
from engine.quantization.affine import dequantize, qparams, quantize
from engine.quantization.awq import awq_quantize_layer
from engine.quantization.calibration import DECODER_LINEARS, LayerwiseCalibration, calibration_token_ids
from engine.quantization.gptq import group_qparams, gptq_quantize_layer, gptq_quantize_weight, hessian

CPU = torch.device("cpu")
LAYER = 3
GROUP = 64  # divides SmolLM2's K = 576 and 1536


def obq_direct(W: torch.Tensor, H: torch.Tensor, bits: int, group: int, sym: bool, damp: float = 0.01) -> torch.Tensor:
    """Unbatched OBQ (group parameters as GPTQ stores them): quantize column c, move the other unquantized columns by
    -err / Hinv[c, c] * Hinv[c, :], drop c from the inverse Hessian. Returns q [N, K]."""
    W, H = W.clone(), H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    Hinv = torch.linalg.inv(H)
    n, k = W.shape
    Q = torch.zeros(n, k, dtype=torch.int32)
    for c in range(k):
        if c % group == 0:
            g = W[:, c : c + group]
            s, z = group_qparams(g, bits, sym)
            s = s.double()
        Q[:, c] = quantize(W[:, c], s, z, bits)
        err = W[:, c] - dequantize(Q[:, c], s, z).double()
        W[:, c + 1 :] -= (err / Hinv[c, c])[:, None] * Hinv[c, c + 1 :][None, :]
        Hinv = Hinv - Hinv[:, c : c + 1] @ Hinv[c : c + 1, :] / Hinv[c, c]
    return Q


def correlated_inputs(num_tokens: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen, dtype=torch.float64) / k**0.5
    return torch.randn(num_tokens, k, generator=gen, dtype=torch.float64) @ mix * torch.linspace(0.2, 3.0, k, dtype=torch.float64)


@pytest.mark.parametrize("block_size", [5, 8, 24], ids=["block-5-splits-groups", "block-8", "block-whole"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_gptq_equals_unbatched_obq(block_size: int, sym: bool) -> None:
    gen = torch.Generator().manual_seed(block_size)
    W = torch.randn(6, 24, generator=gen, dtype=torch.float64)
    H = hessian(correlated_inputs(200, 24, seed=1)).double()
    got = gptq_quantize_weight(W, H, bits=4, group_size=8, symmetric=sym, block_size=block_size)
    assert got.g_idx is None and got.qt.scale.shape == (6, 3)
    assert torch.equal(got.qt.q, obq_direct(W, H, 4, 8, sym))


def test_gptq_act_order_is_obq_in_the_permuted_order() -> None:
    gen = torch.Generator().manual_seed(7)
    W = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    H = hessian(correlated_inputs(100, 16, seed=2)).double()
    got = gptq_quantize_weight(W, H, bits=4, group_size=4, symmetric=True, act_order=True, block_size=6)
    perm = torch.argsort(H.diagonal(), descending=True, stable=True)
    expected = obq_direct(W[:, perm], H[perm][:, perm], 4, 4, True)
    assert torch.equal(got.qt.q[:, perm], expected)
    assert torch.equal(got.g_idx[perm], torch.arange(16, dtype=torch.int32) // 4)  # groups follow the order
    assert not torch.equal(perm, torch.arange(16))  # the case must actually permute
    # dequantize() reads each column's group through g_idx
    w_hat = got.dequantize()
    s, z = got.qt.scale, got.qt.zero
    col = int(perm[5])  # 6th column quantized: group 1
    torch.testing.assert_close(w_hat[:, col], (s[:, 1] * (got.qt.q[:, col] - z[:, 1])).float())


def test_gptq_rejects_a_singular_hessian_with_a_clear_error() -> None:
    H = torch.zeros(8, 8)
    H[0, 1] = H[1, 0] = 5.0  # indefinite, and damping 0 cannot fix it
    H[0, 0] = H[1, 1] = 1.0
    with pytest.raises(ValueError, match="not positive definite"):
        gptq_quantize_weight(torch.randn(4, 8), H, group_size=8, damp=0.0)


@pytest.fixture(scope="module")
def smollm_layer(default_model_path: Path):
    """The default model, calibration tokens, and layer LAYER's float output on them."""
    model = load_model(default_model_path, torch.float32, CPU, 256)
    tok = AutoTokenizer.from_pretrained(str(default_model_path))
    sequences = calibration_token_ids(tok, 4, 128)
    calib = LayerwiseCalibration(model, sequences)
    for i in range(LAYER):
        calib.advance(i)
    return model, calib.hidden.clone(), sequences, calib.layer_forward(LAYER)


def layer_error(model, hidden: torch.Tensor, sequences: torch.Tensor, expected: torch.Tensor) -> float:
    calib = LayerwiseCalibration(model, sequences)
    return (calib.layer_forward(LAYER, hidden) - expected).pow(2).mean().item()


def rtn_layer_error(model, hidden, sequences, expected) -> float:
    rtn = copy.deepcopy(model)
    layer = rtn.model.layers[LAYER]
    for name in DECODER_LINEARS:
        w = layer.get_submodule(name).weight
        n, k = w.shape
        g = w.detach().reshape(n, k // GROUP, GROUP)
        s, z = qparams(g.amin(-1, keepdim=True), g.amax(-1, keepdim=True), 4, symmetric=False)
        w.copy_(dequantize(quantize(g, s, z, 4), s, z).reshape(n, k))
    return layer_error(rtn, hidden, sequences, expected)


def test_gptq_layer_output_error_below_rtn(smollm_layer) -> None:
    model, hidden, sequences, expected = smollm_layer
    quantized = copy.deepcopy(model)
    calib = LayerwiseCalibration(quantized, sequences)
    calib.hidden = hidden.clone()
    results = gptq_quantize_layer(calib, LAYER, 4, GROUP, symmetric=False)
    assert set(results) == set(DECODER_LINEARS)
    gptq = layer_error(quantized, hidden, sequences, expected)
    rtn = rtn_layer_error(model, hidden, sequences, expected)
    assert gptq < 0.6 * rtn, (gptq, rtn)  # measured: 0.37x


def test_awq_layer_output_error_below_rtn(smollm_layer) -> None:
    model, hidden, sequences, expected = smollm_layer
    quantized = copy.deepcopy(model)
    calib = LayerwiseCalibration(quantized, sequences)
    calib.hidden = hidden.clone()
    results = awq_quantize_layer(calib, LAYER, 4, GROUP)
    layer, float_layer = quantized.model.layers[LAYER], model.model.layers[LAYER]
    # The scales went into the norms (the float function is kept, the weights are the quantized ones).
    assert not torch.equal(layer.input_layernorm.weight, float_layer.input_layernorm.weight)
    for name, ql in results.items():
        torch.testing.assert_close(layer.get_submodule(name).weight, ql.dequantize())
    awq = layer_error(quantized, hidden, sequences, expected)
    rtn = rtn_layer_error(model, hidden, sequences, expected)
    assert awq < 0.6 * rtn, (awq, rtn)  # measured: 0.38x
