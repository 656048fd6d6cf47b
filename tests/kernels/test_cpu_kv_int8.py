"""The INT8 KV cache on the C++ CPU kernels (`--kv-cache-dtype int8`, kernels/kv_quant.py):
the write kernel quantizes each (token, head) row exactly as the reference does, and the
attention reads the int8 rows in place (codes widened as they load, scales applied) with
the result of the float64 reference attention over the dequantized K/V, up to float
rounding, and the same bits for a row whatever step it is computed in (the invariant route,
which is the one route that reads int8)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernels, kv_quant, reference
from tests.kernels.invariance_steps import HEAD_DIM, TARGET_LEN, Steps, differing

pytestmark = pytest.mark.skipif(not cpu_kernels.int8_cache_runs(torch.bfloat16, 64),
                                reason="the C++ int8 KV attention needs AVX512-BF16")

BLOCK, HKV = 16, 2


def _write(kernel, key, value, slots, num_blocks=8):
    caches = [torch.zeros(num_blocks, BLOCK, HKV, HEAD_DIM + 2, dtype=torch.int8) for _ in range(2)]
    kernel(key, value, *caches, slots)
    return caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_write_kernel_quantizes_as_the_reference(dtype: torch.dtype) -> None:
    """Bit for bit: codes and bf16 scale of every row, an all-zero row (scale 0), rows whose
    absmax sits exactly on a code (x / scale = 127), padding slots (-1) left untouched,
    K and V as strided views of one fused QKV tensor (as the model passes them)."""
    g = torch.Generator().manual_seed(0)
    T = 40
    qkv = (torch.randn(T, 3 * HKV, HEAD_DIM, generator=g) * torch.logspace(-3, 3, T)[:, None, None]).to(dtype)
    key, value = qkv[:, HKV : 2 * HKV], qkv[:, 2 * HKV :]
    key[3, 1] = 0
    value[5, 0, :] = torch.arange(HEAD_DIM) - HEAD_DIM // 2
    slots = torch.randperm(8 * BLOCK, generator=g)[:T].long()
    slots[7] = -1
    got_k, got_v = _write(cpu_kernels.reshape_and_cache, key, value, slots)
    keep = slots >= 0
    want_k, want_v = _write(reference.reshape_and_cache, key[keep], value[keep], slots[keep])
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert kv_quant.scales(got_k.view(-1, HKV, HEAD_DIM + 2)[slots[3]])[1] == 0  # the zero row
    assert not got_k.view(-1, HKV, HEAD_DIM + 2)[slots[7]].any()  # the padding slot's row is not written


def test_a_quantized_row_reads_back_within_half_a_step() -> None:
    """The format's error bound: each value within half its row's scale (the rounding), the
    scale at most absmax / 127 rounded to bf16."""
    x = torch.randn(64, HKV, HEAD_DIM, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 5
    rows = kv_quant.quantize(x, "int8")
    s = kv_quant.scales(rows)
    assert torch.all((kv_quant.dequantize(rows) - x.float()).abs() <= 0.5 * s[..., None] * (1 + 2**-8))
    assert torch.allclose(s, x.float().abs().amax(-1) / 127, rtol=2**-8)


class Int8Caches:
    """`Steps`' attention with its bf16 caches stored as int8 rows first (the engine's write:
    the reference quantize, bit-identical to the kernel's), then read by `attention`."""

    def __init__(self, attention):
        self.attention = attention

    def __call__(self, query, key_cache, value_cache, *args, **kwargs):
        k, v = (kv_quant.quantize(c, "int8") for c in (key_cache, value_cache))
        return self.attention(query, k, v, *args, **kwargs)


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_a_row_is_the_same_bits_in_every_step_shape(window: int | None) -> None:
    """Decode alone / beside 1-32 others / wide table / blocks elsewhere / beside a prefill
    chunk, and the row inside 16- and 64-token chunks and a whole prefill (the route's
    decode and prefill paths): one set of bits. `invariant=False` is passed on purpose: an
    int8 cache takes the invariant route whatever the flag says."""
    rows = Steps(Int8Caches(cpu_kernels.paged_attention), torch.bfloat16, "cpu").target_row_in_each_step(
        invariant=False, window=window)
    assert not any(row.isnan().any() for row in rows.values())
    assert differing(rows) == []


@pytest.mark.parametrize("window", [None, 100], ids=["full", "window100"])
def test_the_int8_attention_equals_the_float64_reference_on_the_dequantized_cache(window: int | None) -> None:
    """A prefill of the whole prompt and a batch of decodes (mixed lengths, up to 690 keys)
    against the float64 reference over the dequantized K/V: within the bf16 rounding of the
    output and of the softmax weights (which the kernel rounds to bf16 with the value's scale
    folded in). The int8 codes and scales are those of the caches the kernel reads."""

    def in_float64(query, key_cache, value_cache, *args, invariant, **kw):
        dense = [kv_quant.dequantize(kv_quant.quantize(c, "int8")).double() for c in (key_cache, value_cache)]
        return reference.paged_attention(query.double(), *dense, *args, **kw)

    kernel = Steps(Int8Caches(cpu_kernels.paged_attention), torch.bfloat16, "cpu")
    ref = Steps(in_float64, torch.bfloat16, "cpu")
    target = kernel.target
    steps = [[(target, TARGET_LEN, TARGET_LEN)], [(target, TARGET_LEN, 1), *kernel.other_decodes(8)]]
    for parts in steps:
        got = kernel.run_step(parts, invariant=True, window=window)
        want = ref.run_step(parts, invariant=True, window=window)
        for g, w in zip(got, want):
            assert not g.isnan().any()
            assert torch.allclose(g.double(), w, atol=2e-2, rtol=2e-2), (g.double() - w).abs().max()


def test_int8_and_bf16_caches_differ_by_the_quantization_only() -> None:
    """Teeth for the test above: the bf16 cache's output differs from the int8 cache's (so
    the int8 rows are what was read), by about the quantization error, not more."""
    bf16 = Steps(cpu_kernels.paged_attention, torch.bfloat16, "cpu")
    int8 = Steps(Int8Caches(cpu_kernels.paged_attention), torch.bfloat16, "cpu")
    parts = [(bf16.target, TARGET_LEN, 1)]
    a, b = bf16.run_step(parts, invariant=True)[0], int8.run_step(parts, invariant=True)[0]
    assert not torch.equal(a, b)
    assert (a.float() - b.float()).abs().max() < 0.05


def test_refused_shapes_name_the_problem() -> None:
    q = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, BLOCK, 2, 64, dtype=torch.int8)  # no room for the scale
    meta = (torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="head_dim \\+ 2"):
        cpu_kernels.load().paged_attention(torch.empty_like(q), q, cache, cache, *meta, 0.125, 0, 32, 0, 8, 0, 128)
