"""The C++ CPU kernels (kernels/cpu_kernels.py) against the dense float64 reference and
the torch reference ops: paged attention read in place (decodes, short and long prefill
chunks, after cached tokens, sliding windows, GQA ratios, head dims 64/128/256, bf16),
the KV write, and the fused element-wise ops."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels import cpu_kernels, elementwise, reference
from tests.kernels.paged_batches import assert_close_to_reference, make_batch

# On Linux (CI, the project's machines) the kernels must build: a failed build fails here
# instead of skipping everything below.
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the CPU kernels are built on Linux only")


def test_the_kernels_build_here():
    assert cpu_kernels.load() is not None, cpu_kernels.unavailable_reason()

# A chunk long enough for the flash-attention route (float32) and the blocked loop (bf16:
# 25 tokens x every group here are more than BLOCK_MIN_ROWS query rows).
LONG = cpu_kernels.SHORT_CHUNK + 9

BATCHES = {
    "decodes": [(1, 1), (17, 1), (33, 1), (100, 1)],
    "short chunks after cache": [(40, 7), (16, 16), (50, 3)],
    "long chunk, no cache": [(LONG, LONG), (9, 1)],
    "long chunk after cache": [(LONG + 40, LONG), (33, 1), (20, 5)],
    "mixed": [(5, 1), (LONG + 70, LONG), (64, 16), (1, 1), (31, 2)],
    # Enough sequences (>= 4 per thread) that each work item takes all of a sequence's KV heads.
    "many decodes": [(1 + 37 * i, 1) for i in range(12)] + [(50, 2), (70, 3)],
}


@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 5, 16, 40])
def test_paged_attention_equals_dense_reference(name, heads, kv_heads, head_dim, window):
    batch = make_batch(BATCHES[name], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                       block_order="shuffled", seed=len(name))
    out = cpu_kernels.paged_attention(*batch.args(), batch.scale, sliding_window=window)
    assert_close_to_reference(out, batch, window)


# bf16 decodes and short chunks take the few-row kernel (attend_rows_bf16: vdpbf16ps
# scores, prefetched keys) in items of up to 8 query rows per KV head; chunks of more than
# BLOCK_MIN_ROWS query rows (the LONG ones, windowed or not) take the blocked loop
# (attend_block_bf16).
@pytest.mark.parametrize("name", BATCHES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 8, 128), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_attention_bf16(name, heads, kv_heads, head_dim, window, block_size):
    batch = make_batch(BATCHES[name], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=torch.bfloat16, block_order="shuffled", seed=len(name))
    out = cpu_kernels.paged_attention(*batch.args(), batch.scale, sliding_window=window)
    assert out.dtype == torch.bfloat16
    assert_close_to_reference(out, batch, window)


def test_paged_attention_bf16_block_size_1():
    batch = make_batch([(7, 1), (5, 5), (40, 2)], num_heads=6, num_kv_heads=2, head_dim=64, block_size=1,
                       dtype=torch.bfloat16, block_order="shuffled")
    assert_close_to_reference(cpu_kernels.paged_attention(*batch.args(), batch.scale), batch)


def test_paged_attention_writes_into_out_and_block_size_1():
    batch = make_batch([(7, 1), (5, 5)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=1,
                       block_order="shuffled")
    out = torch.full_like(batch.query, float("nan"))
    assert cpu_kernels.paged_attention(*batch.args(), batch.scale, out) is out
    assert_close_to_reference(out, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_equals_reference(dtype):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(6, (4 + 2 + 2) * 64, generator=g).to(dtype)  # a fused projection's output
    k = qkv[:, 4 * 64 : 6 * 64].view(6, 2, 64)  # strided views, as the model passes them
    v = qkv[:, 6 * 64 :].view(6, 2, 64)
    slots = torch.tensor([3, 17, 0, 31, 8, 9])
    want = [torch.randn(2, 16, 2, 64, generator=g).to(dtype) for _ in range(2)]
    got = [c.clone() for c in want]
    reference.reshape_and_cache(k, v, *want, slots)
    cpu_kernels.reshape_and_cache(k, v, *got, slots)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """bf16: at most one rounding step apart (the kernels compute in float32, as torch's
    ops do, but exp/rsqrt may differ in the last float bit); float32: a few ulps."""
    if a.dtype == torch.bfloat16:
        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=8e-3)
    else:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_add", [True, False])
def test_add_rms_norm_equals_reference(dtype, with_add):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 576, generator=g).to(dtype)
    add = torch.randn(5, 576, generator=g).to(dtype) if with_add else None
    weight = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    want_normed, want_sum = elementwise.add_rms_norm(x.clone(), add, weight, 1e-5)
    residual = x.clone()
    normed, summed = elementwise.cpu_add_rms_norm(residual, add, weight, 1e-5)
    assert summed is residual  # the residual stream is updated in place
    assert torch.equal(summed, want_sum)  # one rounding of x + add, as torch's add
    _close(normed, want_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_qk_equals_reference(dtype):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 12 * 64, generator=g).to(dtype)
    qk = qkv[:, : 10 * 64].view(5, 10, 64)  # q and k heads of a fused projection: a strided view
    angles = torch.outer(torch.arange(100.0), 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    cos, sin = angles.cos(), angles.sin()
    positions = torch.tensor([0, 1, 7, 50, 99])
    want = elementwise.rotate_qk_(qk.clone(), cos, sin, positions)
    v_before = qkv[:, 10 * 64 :].clone()
    assert elementwise.cpu_rotate_qk_(qk, cos, sin, positions) is qk
    _close(qk, want)
    assert torch.equal(qkv[:, 10 * 64 :], v_before)  # the V columns beside are untouched


def test_build_names_carry_the_cpu_fingerprint():
    """A build cache carried to another CPU is rebuilt, not loaded (-march=native)."""
    module = cpu_kernels.load()
    assert cpu_kernels._cpu_fingerprint() in module.__name__


# The bf16 linear kernel (every bf16 linear, at any row count): against F.linear in float64
# on the same bf16 inputs. Its products are exact and its sums float32, so the only error is
# float32 summation and the final bf16 rounding of each output.
gemv = pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="the CPU has no AVX512-BF16")


@gemv
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 70])
# K = 1024: rows 2 KB apart, which the many-row tiles read from a copy with a longer stride.
@pytest.mark.parametrize("n, k", [(97, 576), (1, 64), (131, 1536), (53, 100), (7, 31), (33, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemv_equals_float64_reference(rows, n, k, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16() if with_bias else None
    got = cpu_kernels.bf16_linear(x, cpu_kernels.pack_bf16_weight(weight), bias)
    want = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # One bf16 rounding of the exact result (2^-8 relative), plus float32 sums of k terms.
    tol = want.abs() * 2**-8 + 1e-5 * k ** 0.5 * float(want.abs().max())
    assert bool(((got.double() - want).abs() <= tol).all()), (got.double() - want).abs().max()


@gemv
def test_bf16_gemv_odd_shapes_and_thread_split():
    """Rows beyond the 8-row block, N spanning several threads' ranges plus a remainder
    that is no whole group of four, a strided x, and 3-D x."""
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(4 * 48 + 3, 96, generator=g).bfloat16()
    x = torch.randn(17, 192, generator=g).bfloat16()[:, ::2]  # not contiguous
    want = torch.nn.functional.linear(x.double(), weight.double())
    packed = cpu_kernels.pack_bf16_weight(weight)
    got = cpu_kernels.bf16_linear(x, packed)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-3)
    got3 = cpu_kernels.bf16_linear(x[:16].reshape(2, 8, 96), packed)
    assert got3.shape == (2, 8, weight.shape[0]) and torch.equal(got3.reshape(16, -1), got[:16])
    assert cpu_kernels.bf16_linear(x[:0], packed).shape == (0, weight.shape[0])
    with pytest.raises(RuntimeError, match="packed by pack_bf16_weight"):
        cpu_kernels.bf16_linear(x, weight)  # a dense weight is refused, not misread


@gemv
@pytest.mark.parametrize("n, k", [(96, 576), (53, 100), (7, 31), (200, 1536), (40, 2048), (3072, 2048), (70, 5633)])
def test_bf16_linear_rows_are_batch_invariant(n, k):
    """A row's outputs are the same bits alone and among 1 to 150 rows, at any position in
    the call: the register tiles of 11 rows, the passes of up to 64 rows, the few-row
    two-group path, the tails, and (K = 2048) the copy of the rows the many-row tiles read all
    compute an output with the one arithmetic. (3072, 2048): 96 groups, whose 12-64-row calls
    end in one-group pieces (parallel_claimed_ahead). K = 5633: 360 KB groups, which 12-64-row
    calls compute in two parts of K with the sums carried between them (KShare), the odd last
    input in the second, and calls of more than 64 rows in passes of 33 (a pass of 64 such
    rows would not fit L2 beside the group). Teeth: oneDNN's packed GEMM of the same bf16
    weight does not (a row's bits change with the row count)."""
    g = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    packed = cpu_kernels.pack_bf16_weight(weight)
    x = torch.randn(150, k, generator=g).bfloat16()
    alone = torch.cat([cpu_kernels.bf16_linear(x[i : i + 1], packed, bias) for i in range(150)])
    for rows in (2, 3, 4, 5, 8, 11, 12, 22, 23, 63, 64, 65, 129, 150):
        assert torch.equal(cpu_kernels.bf16_linear(x[:rows], packed, bias), alone[:rows]), rows
        tail = x[150 - rows :]  # the last row now sits at the end of a tile and of a pass
        assert torch.equal(cpu_kernels.bf16_linear(tail, packed, bias)[-1], alone[-1]), rows


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
def test_onednn_packed_gemm_is_not_batch_invariant():
    """The teeth of the test above: what the default path was before the C++ kernel served
    every row count. oneDNN's packed bf16 GEMM gives a row other bits at 1 row than among 64
    (its K blocking and reduction order follow the shape)."""
    from kernels.linear import linear, pack_weight

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(576, 1536, generator=g).bfloat16()
    packed = pack_weight(weight)
    x = torch.randn(64, 1536, generator=g).bfloat16()
    many = linear(x, None, None, packed)
    alone = torch.cat([linear(x[i : i + 1], None, None, packed) for i in range(64)])
    assert not torch.equal(many, alone)


@gemv
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 40])
@pytest.mark.parametrize("n, k", [(97, 576), (1, 64), (4 * 48 + 3, 1536), (53, 100), (7, 31), (35, 1024)])
def test_int8_gemv_equals_float64_reference(rows, n, k):
    """The W8A16 GEMV: exact products of int8 weights (the full range, -128 included) and
    bf16 x, float32 sums, times the row's scale, one bf16 rounding; rows past a block of
    four, N over several threads' ranges, K with a tail."""
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    qweight[0, 0] = -128
    scales = (torch.rand(n, generator=g) * 0.02 + 1e-3).bfloat16()
    got = cpu_kernels.int8_linear(x, cpu_kernels.pack_int8_weight(qweight), scales)
    want = (x.double() @ qweight.double().t()) * scales.double()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    tol = want.abs() * 2**-8 + 1e-5 * k ** 0.5 * float(want.abs().max())
    assert bool(((got.double() - want).abs() <= tol).all()), (got.double() - want).abs().max()


@gemv
def test_w8a16_runs_the_int8_kernel_given_its_packed_weight():
    """kernels/quant_linear.py: with the packed copy every row count runs the C++ int8 kernel
    (float32 x cast to bf16 and back, the bias added after), a row's bits the same alone as
    among 9 or 40; without it torch's `_weight_int8pack_mm`; a dense int8 weight is refused
    by the kernel."""
    from kernels.quant_linear import w8a16_linear_cpu

    g = torch.Generator().manual_seed(3)
    qweight = torch.randint(-128, 128, (64, 128), dtype=torch.int8, generator=g)
    scales = (torch.rand(64, generator=g) * 0.02).bfloat16()
    bias = torch.randn(64, generator=g)
    packed = cpu_kernels.pack_int8_weight(qweight)
    x = torch.randn(40, 128, generator=g)
    got = w8a16_linear_cpu(x, qweight, scales, bias, packed)
    assert got.dtype == torch.float32
    assert torch.equal(got, cpu_kernels.int8_linear(x.bfloat16(), packed, scales).float() + bias)
    alone = torch.cat([w8a16_linear_cpu(x[i : i + 1], qweight, scales, None, packed) for i in range(40)])
    for rows in (9, 40):
        assert torch.equal(w8a16_linear_cpu(x[:rows], qweight, scales, None, packed), alone[:rows])
    assert torch.equal(w8a16_linear_cpu(x, qweight, scales),
                       torch._weight_int8pack_mm(x.bfloat16(), qweight, scales).float())
    with pytest.raises(RuntimeError, match="packed by pack_int8_weight"):
        cpu_kernels.int8_linear(x.bfloat16(), qweight, scales)


# Fewer few-row items than twice the threads (a batch-1 decode of a model with 3 KV heads is
# 3 items on 2 threads): each item's keys are split into parts of at least 128 keys and the
# parts merged (attention_parts). With one thread the items run whole: both against the
# reference.
@pytest.mark.parametrize("seqs", [[(1000, 1)], [(700, 1), (300, 2)], [(257, 1)], [(3000, 1)]],
                         ids=["1000", "700-and-300x2", "257", "3000"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (6, 2, 128), (4, 1, 256)])
@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize("threads", [1, 2])
def test_paged_attention_bf16_few_decodes_split_their_keys(seqs, heads, kv_heads, head_dim, window, threads):
    batch = make_batch(seqs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, block_size=16,
                       dtype=torch.bfloat16, block_order="shuffled", seed=len(seqs))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cpu_kernels.paged_attention(*batch.args(), batch.scale, sliding_window=window)
    finally:
        torch.set_num_threads(before)
    assert_close_to_reference(out, batch, window)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128)])
@pytest.mark.parametrize("window", [None, 300])
def test_paged_attention_bf16_blocked_loop_over_a_long_context(heads, kv_heads, head_dim, window):
    # Chunks of many tiles and key blocks through the blocked loop: after 1000 cached tokens
    # (a window of 300 starting past the cached prefix's first blocks), a whole 150-token
    # prompt (its tiles skip the key blocks past their rows), and a decode beside them on
    # the few-row loop.
    batch = make_batch([(1040, 40), (150, 150), (1010, 1)], num_heads=heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, block_size=16, dtype=torch.bfloat16, block_order="shuffled")
    assert_close_to_reference(cpu_kernels.paged_attention(*batch.args(), batch.scale, sliding_window=window), batch,
                              window)


@gemv
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("hidden, inter", [(64, 96), (576, 1536)])
def test_bf16_silu_mlp_equals_the_eager_ops(rows, hidden, inter):
    """The fused decode MLP against the eager ops it replaces (the same GEMV for both
    linears, then F.silu and * in bf16): equal but for the rare 1-ulp bf16 difference of
    a float silu computed another way, and close to the float64 MLP of the same inputs."""
    g = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=g).bfloat16()
    gate_up = (torch.randn(2 * inter, hidden, generator=g) / hidden**0.5).bfloat16()
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).bfloat16()
    gate_up_packed, down_packed = cpu_kernels.pack_bf16_weight(gate_up), cpu_kernels.pack_bf16_weight(down)
    got = cpu_kernels.bf16_silu_mlp(x, gate_up_packed, down_packed)
    gate, up = cpu_kernels.bf16_linear(x, gate_up_packed).split(inter, dim=-1)
    eager = cpu_kernels.bf16_linear(torch.nn.functional.silu(gate) * up, down_packed)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, hidden)
    torch.testing.assert_close(got, eager, atol=2e-2, rtol=2e-2)
    assert (got == eager).double().mean() > 0.9  # differences are rare 1-ulp ones, not a different op
    gd, ud = torch.nn.functional.linear(x.double(), gate_up.double()).split(inter, dim=-1)
    exact = torch.nn.functional.linear(torch.nn.functional.silu(gd) * ud, down.double())
    torch.testing.assert_close(got.double(), exact, atol=3e-2, rtol=3e-2)


def _argmax_cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    cases = {
        "vocab rows": torch.randn(3, 49152, generator=g),
        "not a multiple of 16": torch.randn(2, 37, generator=g),
        "shorter than a vector": torch.randn(4, 5, generator=g),
        "one element": torch.randn(2, 1, generator=g),
    }
    ties = torch.zeros(2, 100)
    ties[0, [17, 40, 99]] = 3.0  # the first of equal maxima
    ties[1, 96:] = 1.0  # ... in the scalar tail
    cases["ties"] = ties
    signed_zeros = torch.full((1, 40), -1.0)
    signed_zeros[0, 20], signed_zeros[0, 25] = -0.0, 0.0  # -0.0 == 0.0: the first wins
    cases["signed zeros"] = signed_zeros
    cases["all -inf"] = torch.full((2, 33), float("-inf"))
    nan = torch.randn(3, 70, generator=g)
    nan[0, 50] = float("nan")  # NaN counts as the largest
    nan[1, [3, 69]] = float("nan")
    nan[2, 66] = float("nan")  # in the scalar tail
    cases["NaN"] = nan
    inf = torch.randn(1, 64, generator=g)
    inf[0, [9, 30]] = float("inf")
    cases["+inf"] = inf
    return cases


@pytest.mark.parametrize("case", list(_argmax_cases()))
def test_argmax_rows_equals_torch_argmax(case):
    """The sampler's greedy pick (kernels/cpu_kernels.py `argmax`): torch.argmax's index,
    the first of equal maxima, NaN as the largest."""
    logits = _argmax_cases()[case]
    got = cpu_kernels.argmax(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()


def test_argmax_takes_what_the_kernel_does_not_through_torch():
    x = torch.randn(4, 10)
    assert cpu_kernels.argmax(x.t()).tolist() == x.t().argmax(dim=-1).tolist()  # not contiguous
    assert cpu_kernels.argmax(x.bfloat16()).tolist() == x.bfloat16().argmax(dim=-1).tolist()
