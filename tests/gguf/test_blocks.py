"""Q4_0 / Q4_1 / Q8_0 blocks decoded into Pagoda's integers: the weights they stand for are
the ones llama.cpp computes with (the `gguf` package's dequantize), and the runtime modules
serve them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import dequantize, quants

from engine.gguf.blocks import decode, served_linear, to_float
from engine.gguf.loader import _runtime_module
from engine.gguf.tensors import qk_row_order
from engine.quantization.affine import pack_int4
from engine.quantization.linears import Int4Linear, Int8Linear
from engine.quantization.weights import QuantizedLinear
from kernels.quant_reference import dequantize_w4_ref

N, K = 48, 96


def weight(seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    w = gen.standard_normal((N, K)).astype(np.float32) * 0.05
    w[3] += 0.2  # a row whose minimum is far from zero: Q4_1's offset matters
    return w


def llama_cpp_weight(data: np.ndarray, qtype: T) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, qtype).reshape(N, K).astype(np.float32))


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q8_0], ids=lambda t: t.name)
def test_q4_0_and_q8_0_integers_are_the_files_exactly(qtype):
    data = quants.quantize(weight(), qtype)
    qt = decode(data, qtype, N)
    assert qt.group_size == 32 and qt.bits == (4 if qtype == T.Q4_0 else 8)
    assert torch.equal(qt.zero, torch.full_like(qt.zero, 8 if qtype == T.Q4_0 else 128))
    got = qt.scale.repeat_interleave(32, dim=1) * (qt.q - qt.zero.repeat_interleave(32, dim=1)).float()
    assert torch.equal(got, llama_cpp_weight(data, qtype))


def test_q4_1_is_asymmetric_int4_with_a_fractional_zero_point():
    data = quants.quantize(weight(), T.Q4_1)
    qt = decode(data, T.Q4_1, N)
    assert qt.bits == 4 and qt.group_size == 32 and qt.zero.dtype == torch.float32
    assert int(qt.q.min()) >= 0 and int(qt.q.max()) <= 15
    expected = llama_cpp_weight(data, T.Q4_1)
    # The AutoGPTQ-layout kernels (reference, Triton) compute (q - zero) * scale: the float
    # zero point reproduces d * q + m up to float32 rounding.
    served = dequantize_w4_ref(pack_int4(qt.q), qt.scale.t().contiguous(), qt.zero.t().contiguous(), 32)
    assert torch.allclose(served, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))


def test_q4_1_constant_block_is_exact():
    """d = 0 (every weight of the block is m) has no finite zero point: it is stored as
    scale m, zero -1, q 0."""
    block = np.zeros((1, 20), np.uint8)
    block[0, 2:4] = np.array([0.75], np.float16).view(np.uint8)  # m
    block[0, 4:] = 0x5A  # nibbles llama.cpp ignores when d = 0
    data = np.tile(block, (2, 3))  # 2 rows x 3 blocks
    qt = decode(data, T.Q4_1, 2)
    got = qt.scale.repeat_interleave(32, dim=1) * (qt.q - qt.zero.repeat_interleave(32, dim=1))
    assert torch.equal(got, torch.full((2, 96), 0.75))


@pytest.mark.parametrize("qtype, module", [(T.Q4_0, Int4Linear), (T.Q4_1, Int4Linear), (T.Q8_0, Int8Linear)],
                         ids=["Q4_0", "Q4_1", "Q8_0"])
def test_runtime_module_computes_with_the_files_weights(qtype, module):
    data = quants.quantize(weight(), qtype)
    linear = _runtime_module(served_linear(QuantizedLinear(decode(data, qtype, N))), torch.float32, torch.device("cpu"))
    assert isinstance(linear, module)
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
    expected = x @ llama_cpp_weight(data, qtype).t()
    # bf16 activations, scales and offsets on torch's CPU integer kernels; Q8_0 also
    # requantized per row (Pagoda's INT8 has one scale per row).
    assert (linear(x) - expected).abs().max() <= 0.02 * expected.abs().max()


def test_q8_0_requantized_per_row_is_within_half_a_row_step():
    data = quants.quantize(weight(), T.Q8_0)
    ql = served_linear(QuantizedLinear(decode(data, T.Q8_0, N)))
    w = llama_cpp_weight(data, T.Q8_0)
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((ql.dequantize() - w).abs() <= step / 2 + 1e-7).all()


def test_qk_row_order_undoes_llama_cpps_permutation():
    rows, heads = 24, 3
    w = np.arange(rows * 2, dtype=np.float32).reshape(rows, 2)
    permuted = w.reshape(heads, 2, rows // heads // 2, 2).swapaxes(1, 2).reshape(w.shape)  # convert_hf_to_gguf
    assert torch.equal(torch.from_numpy(permuted)[qk_row_order(rows, heads)], torch.from_numpy(w))


def test_float_types_and_k_quants_dequantize_to_float32():
    w = weight()
    assert torch.equal(to_float(w.astype(np.float16), T.F16, (N, K), "t"), torch.from_numpy(w.astype(np.float16).astype(np.float32)))
    with pytest.raises(ValueError, match=r"^t: GGUF tensor type F64 is not supported"):
        to_float(w.astype(np.float64), T.F64, (N, K), "t")


def test_q4_1_without_the_cpu_int4_kernels_serves_float_zero_points(monkeypatch):
    """Where neither CPU int4 kernel is used (CUDA, or a CPU without AVX512-BF16 and a torch
    without its int4 kernel), Q4_1 goes to the AutoGPTQ-layout kernels with its float32 zero
    points, not rounded ones."""
    import engine.gguf.loader as gguf_loader

    monkeypatch.setattr(gguf_loader, "cpu_int4_tensors", lambda *args: None)
    data = quants.quantize(weight(), T.Q4_1)
    linear = _runtime_module(served_linear(QuantizedLinear(decode(data, T.Q4_1, N))), torch.float32, torch.device("cpu"))
    assert isinstance(linear, Int4Linear) and not linear.cpu_packed and linear.zeros.dtype == torch.float32
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(1))
    expected = x @ llama_cpp_weight(data, T.Q4_1).t()
    assert torch.allclose(linear(x), expected, rtol=0, atol=1e-5 * float(expected.abs().max()))
