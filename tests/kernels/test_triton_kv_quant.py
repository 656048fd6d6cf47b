"""The Triton kernels on a quantized KV cache (kernels/kv_quant.py): INT8 and FP8 E4M3 rows.

- kernels/triton_cache.py writes each (token, KV head) row as `kv_quant.quantize` does,
  bit for bit: codes and bf16 scale, zero rows, ties, -1 slots skipped.
- kernels/triton_attention.py reads the rows in place: its output matches
  `kernels.reference.paged_attention` run in float32 on the dequantized caches
  (`kv_quant.dequantize`) up to float rounding, on decodes, a prefill chunk after cached
  tokens, split-K and a sliding window; slots a sequence does not own (NaN bytes) never leak.

Without CUDA the kernels run in the Triton interpreter (TRITON_INTERPRET=1, set here
before the kernel modules are imported) with float32 and float16 queries (the
interpreter's tl.dot has no bfloat16); with CUDA the same cases run compiled in bfloat16,
float16 and float32.

FP8 writes under the interpreter: triton 3.6's interpreter converts fp32 to float8e4nv
without round-to-nearest-even (a rounding carry into the exponent and ties go wrong, see
`_interpreter_fp8_is_exact`), so the FP8 write runs twice there: with the interpreter's own
conversion (skipped, with the reason, while it is inexact) and with that one conversion
replaced by torch's (exact RNE, what the GPU's cvt.rn.satfinite does on clamped values),
which checks everything else the kernel computes bit for bit. On CUDA the GPU's own
conversion is checked against torch. Decoding FP8 (the attention's loads) is exact in the
interpreter for every code the quantizer writes.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from paged_batches import TOLERANCES, make_batch  # noqa: E402

from kernels import kv_quant, reference  # noqa: E402
from kernels.triton_attention import AttentionConfig, launch_paged_attention, paged_attention  # noqa: E402
from kernels.triton_cache import reshape_and_cache  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

if not ON_CUDA and not INTERPRETED:
    pytest.skip("the Triton kernel modules were imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

DEVICE = "cuda" if ON_CUDA else "cpu"
_CPU = pytest.mark.skipif(ON_CUDA, reason="interpreter variant: this process compiles the kernels for CUDA")
_GPU = pytest.mark.skipif(not ON_CUDA, reason="GPU variant (compiled): needs CUDA")
KINDS = ["int8", "fp8"]
# (device, dtype) of K/V written into the cache: a quantizing write takes any float dtype.
WRITE_VARIANTS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=_CPU),
    pytest.param(("cpu", torch.bfloat16), id="cpu-bf16", marks=_CPU),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=_GPU),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=_GPU),
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=_GPU),
]
# (device, query dtype) the attention cases run in.
QUERY_VARIANTS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32", marks=_CPU),
    pytest.param(("cpu", torch.float16), id="cpu-fp16", marks=_CPU),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=_GPU),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=_GPU),
    pytest.param(("cuda", torch.float32), id="cuda-fp32", marks=_GPU),
]
# Against the float32 reference on the same dequantized values: float32 differs only by
# the order of the sums; 16-bit by the V tile and probabilities rounded to the query's
# dtype before the second dot (as the unquantized kernels' tolerances).
ATTENTION_TOLERANCES = {**TOLERANCES, torch.float32: dict(atol=1e-5, rtol=1e-4)}


# ---- FP8 conversion under the interpreter ---------------------------------------------------


@triton.jit
def _to_fp8_bits_kernel(x_ptr, bits_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(bits_ptr + offs, x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True))


@functools.cache
def _interpreter_fp8_is_exact() -> bool:
    """Whether this Triton converts fp32 to float8e4nv as torch does (RNE) on values that
    round up into the next exponent (15.5 -> 16 after 15) and on ties (17 -> 16, 19 -> 20)."""
    x = torch.tensor([15.5, 31.0, 240.0, 17.0, 19.0, 8.5, 9.5, 0.75, -15.5, -17.0, 100.3, 3 * 2.0**-10, 0.0, -0.0,
                      448.0, -448.0])
    bits = torch.empty(x.numel(), dtype=torch.uint8)
    _to_fp8_bits_kernel[(1,)](x, bits, N=x.numel())
    return torch.equal(bits, x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.fixture
def torch_fp8_conversion(monkeypatch):
    """Within one test, the interpreter converts fp32 to float8e4nv with torch (RNE) instead of its own."""
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar == tl.float32:
            values = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = values.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return interpreter.TensorHandle(bits, dst_type.scalar)
        return original(self, src, dst_type, rounding_mode)

    monkeypatch.setattr(builder, "create_fp_to_fp", create_fp_to_fp)


# Which FP8 conversion a write case uses: the device's own (the GPU's; the interpreter's
# where exact) or, in the interpreter, torch's.
WRITE_KINDS = [
    pytest.param(("int8", "own"), id="int8"),
    pytest.param(("fp8", "own"), id="fp8"),
    pytest.param(("fp8", "torch"), id="fp8-torch-conversion", marks=_CPU),
]


def _skip_fp8_without_gpu_support(kind: str) -> None:
    if kind == "fp8" and ON_CUDA and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("an fp8 KV cache needs compute capability 8.9+ (Triton's float8e4nv)")


def _conversion(kind: str, conversion: str, request) -> None:
    _skip_fp8_without_gpu_support(kind)
    if conversion == "torch":
        request.getfixturevalue("torch_fp8_conversion")
    elif kind == "fp8" and INTERPRETED and not _interpreter_fp8_is_exact():
        pytest.skip(
            "this Triton's interpreter converts fp32 to float8e4nv without round-to-nearest-even (rounding "
            "carries and ties differ from torch); the fp8-torch-conversion case checks the rest of the kernel, "
            "the GPU checks its own conversion"
        )


# ---- the write ------------------------------------------------------------------------------


def _rows(num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """K or V rows [num_tokens, num_kv_heads, head_dim] with what quantizing has to get right:
    magnitudes from 1e-3 to 1e3, an all-zero row, a row with -0.0 and a lone spike, rows of
    exact ties for INT8 (x / scale = k + 1/2) and for FP8 (midpoints, some carrying into the
    next exponent), and rows whose scale is a tie between two bf16s (rounded to even)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
    x = x * torch.exp(torch.randn(num_tokens, num_kv_heads, 1, generator=g) * 2.5)
    flat = x.view(-1, head_dim)
    flat[1] = 0.0
    flat[2, ::3] = -0.0
    flat[2, 5] = 30.0
    # INT8 ties: absmax 127 / 8 gives the scale 1/8 exactly; (k + 1/2) / 8 lands on the midpoints.
    ties = torch.arange(head_dim, dtype=torch.float32) % 21 - 10 + 0.5
    flat[3] = ties / 8
    flat[3, 0] = 127 / 8
    # FP8 ties: absmax 448 / 16 gives the scale 1/16; y on midpoints of E4M3 neighbours,
    # 15.5 / 31 / 240 round up into the next exponent, 3 * 2**-10 is a subnormal midpoint.
    mids = torch.tensor([17.0, 19.0, 8.5, 9.5, 15.5, 31.0, 240.0, 3 * 2.0**-10, -17.0, -15.5, -240.0, 0.75])
    flat[4] = mids.repeat(head_dim // len(mids) + 1)[:head_dim] / 16
    flat[4, 0] = 448 / 16
    # absmax / 127 (row 5) and absmax / 448 (row 6) exactly 1 + 2**-8, a tie between two
    # bf16s: the scale rounds to the even 1.0, and x / scale reaches 127.496..., as close to
    # a code of 128 as a bf16 scale allows (in float32 input: 16-bit inputs round the spike).
    flat[5] = torch.linspace(-1, 1, head_dim)
    flat[5, 7] = 127 * (1 + 2.0**-8)
    flat[6] = torch.linspace(-3, 3, head_dim)
    flat[6, 9] = -448 * (1 + 2.0**-8)
    return x.to(dtype)


def _write_and_check(kind, num_tokens, num_kv_heads, head_dim, block_size, dtype, device, slot_dtype, seed):
    g = torch.Generator().manual_seed(seed + 100)
    num_blocks = max(2, (2 * num_tokens) // block_size + 1)
    num_slots = num_blocks * block_size
    storage = kv_quant.storage_dtype(kind, dtype)
    row = kv_quant.row_width(head_dim, quantized=True)
    # Untouched slots keep this byte: a write to a wrong slot or past a row shows.
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, row), 0x55, dtype=storage, device=device)
    value_cache = torch.full_like(key_cache, 0x55)
    slot_mapping = torch.randperm(num_slots, generator=g)[:num_tokens]
    # Padding tokens (CUDA graphs) own no slot; after the rows _rows makes special.
    slot_mapping[[num_tokens - 3, num_tokens - 1]] = -1
    key = _rows(num_tokens, num_kv_heads, head_dim, dtype, seed)
    value = _rows(num_tokens, num_kv_heads, head_dim, dtype, seed + 1).flip(-1)
    # K/V as the model produces them: head-major views of a wider row (not contiguous).
    qkv = torch.cat([key.flatten(1), value.flatten(1), key.flatten(1)], dim=1).to(device)
    width = num_kv_heads * head_dim
    key_view = qkv[:, :width].view(num_tokens, num_kv_heads, head_dim)
    value_view = qkv[:, width : 2 * width].view(num_tokens, num_kv_heads, head_dim)

    reshape_and_cache(key_view, value_view, key_cache, value_cache, slot_mapping.to(slot_dtype).to(device))

    kept = slot_mapping >= 0
    for cache, x in ((key_cache, key), (value_cache, value)):
        flat = cache.cpu().view(num_slots, num_kv_heads, row)
        expected = kv_quant.quantize(x[kept], kind)
        written = flat[slot_mapping[kept]]
        assert written.dtype == expected.dtype
        wrong = (written != expected).any(-1)
        assert not wrong.any(), (
            f"{int(wrong.sum())} of {wrong.numel()} rows differ, e.g. token/head {wrong.nonzero()[0].tolist()}: "
            f"{written[wrong][0].tolist()} != {expected[wrong][0].tolist()}"
        )
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[slot_mapping[kept]] = False
        assert (flat[untouched] == 0x55).all(), "a slot not in slot_mapping was written"


@pytest.mark.parametrize("variant", WRITE_VARIANTS)
@pytest.mark.parametrize("case", WRITE_KINDS)
def test_write_is_kv_quant_quantize_bit_for_bit(case, variant, request) -> None:
    kind, conversion = case
    _conversion(kind, conversion, request)
    device, dtype = variant
    # 3 KV heads: the kernel's head block of 4 has a masked row.
    _write_and_check(kind, 24, 3, 64, 16, dtype, device, torch.int64, seed=1)


@pytest.mark.parametrize("case", WRITE_KINDS)
@pytest.mark.parametrize(
    "shape", [(128, 1, 1), (256, 8, 32)], ids=lambda s: f"d{s[0]}-kv{s[1]}-bs{s[2]}"
)
def test_write_other_head_dims_and_int32_slots(shape, case, request) -> None:
    kind, conversion = case
    _conversion(kind, conversion, request)
    head_dim, num_kv_heads, block_size = shape
    dtype = torch.bfloat16
    _write_and_check(kind, 10, num_kv_heads, head_dim, block_size, dtype, DEVICE, torch.int32, seed=2)


# ---- attention ------------------------------------------------------------------------------


def _quantized_batch(seqs, kind, dtype, *, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, seed=0,
                     **kwargs):
    """A paged batch (tests/kernels/paged_batches.py) whose caches are quantized by torch, rows of
    magnitudes spread over ~2 decades (each row's scale differs), and the query in `dtype`."""
    _skip_fp8_without_gpu_support(kind)
    batch = make_batch(seqs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, seed=seed, **kwargs)
    g = torch.Generator().manual_seed(seed + 7)
    rows = batch.key_cache.shape[:-1]
    batch.key_cache = kv_quant.quantize(batch.key_cache * torch.exp(torch.randn(*rows, 1, generator=g)), kind)
    batch.value_cache = kv_quant.quantize(batch.value_cache * torch.exp(torch.randn(*rows, 1, generator=g)), kind)
    batch.query = batch.query.to(dtype)
    return batch


def _on(batch, device):
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = batch.args()
    return (query.to(device), key_cache.to(device), value_cache.to(device), block_tables.to(device),
            seq_lens.to(device), query_start_loc.to(device))


def _expected(batch, window=None) -> torch.Tensor:
    """The reference in float32 on the dequantized caches (dense [blocks, block_size, kv_heads, head_dim])."""
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = batch.args()
    return reference.paged_attention(
        query.float(), kv_quant.dequantize(key_cache), kv_quant.dequantize(value_cache), block_tables, seq_lens,
        query_start_loc, batch.scale, sliding_window=window,
    )


def _run(batch, device, config=None, window=None, caches=None) -> torch.Tensor:
    args = _on(batch, device)
    if caches is not None:
        args = (args[0], caches[0].to(device), caches[1].to(device), *args[3:])
    out = torch.full_like(args[0], float("nan"))
    if config is None:
        result = paged_attention(*args, batch.scale, out=out, sliding_window=window)
    else:
        result = launch_paged_attention(*args, batch.scale, out, config, sliding_window=window)
    assert result is out and out.dtype == batch.query.dtype
    return out.cpu()


def _check(out: torch.Tensor, batch, window=None) -> None:
    torch.testing.assert_close(out.float(), _expected(batch, window), **ATTENTION_TOLERANCES[out.dtype])


@pytest.mark.parametrize("variant", QUERY_VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("block_size", [1, 16], ids=lambda b: f"bs{b}")
def test_decode_batch(block_size: int, kind: str, variant) -> None:
    device, dtype = variant
    # The shorter decodes pad their block table rows with block 0.
    batch = _quantized_batch([(75, 1), (17, 1), (3, 1)], kind, dtype, block_size=block_size, seed=1)
    _check(_run(batch, device), batch)


@pytest.mark.parametrize("variant", QUERY_VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_chunk_after_cached_tokens_with_decodes(kind: str, variant) -> None:
    device, dtype = variant
    # The chunk starts mid-block (cached tokens of its own block), beside a decode and a whole prefill.
    batch = _quantized_batch([(90, 37), (33, 1), (16, 16)], kind, dtype, seed=2, block_order="shuffled",
                             num_blocks=20)
    _check(_run(batch, device), batch)


@pytest.mark.parametrize("variant", QUERY_VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_split_k(kind: str, variant) -> None:
    device, dtype = variant
    # 4 splits over up to 7 tiles of 16 keys: short sequences leave some splits empty.
    batch = _quantized_batch([(100, 1), (45, 1), (5, 1)], kind, dtype, seed=3)
    _check(_run(batch, device, AttentionConfig(block_m=16, tile_n=16, num_splits=4, num_warps=4)), batch)


@pytest.mark.parametrize("variant", QUERY_VARIANTS)
@pytest.mark.parametrize("kind", KINDS)
def test_sliding_window(kind: str, variant) -> None:
    device, dtype = variant
    batch = _quantized_batch([(95, 1), (60, 20), (7, 1)], kind, dtype, seed=4)
    _check(_run(batch, device, window=20), batch, window=20)
    # Through split-K too: the splits cover the tiles from the window's start only.
    config = AttentionConfig(block_m=16, tile_n=16, num_splits=2, num_warps=4)
    _check(_run(batch, device, config, window=20), batch, window=20)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim", [128, 256], ids=lambda d: f"d{d}")
def test_head_dims_128_and_256(head_dim: int, kind: str) -> None:
    # The scale sits head_dim bytes into each row: every head dim's offset.
    dtype = torch.float32 if not ON_CUDA else torch.bfloat16
    batch = _quantized_batch([(20, 1), (9, 9)], kind, dtype, head_dim=head_dim, seed=5)
    _check(_run(batch, DEVICE), batch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("heads", [(8, 1), (2, 2)], ids=lambda h: f"h{h[0]}kv{h[1]}")
def test_gqa_ratios_8_and_1_with_32_token_blocks(heads, kind: str) -> None:
    dtype = torch.float32 if not ON_CUDA else torch.bfloat16
    batch = _quantized_batch([(70, 1), (40, 9), (33, 33)], kind, dtype, num_heads=heads[0], num_kv_heads=heads[1],
                             block_size=32, seed=9)
    _check(_run(batch, DEVICE), batch)


@pytest.mark.parametrize("kind", KINDS)
def test_slots_not_owned_do_not_leak(kind: str) -> None:
    # Bytes 0xff in every slot no sequence owns: int8 codes -1 / FP8 NaN codes, and the scale
    # a bf16 NaN. Block tails past seq_len and padded table entries must never be read.
    dtype = torch.float32 if not ON_CUDA else torch.bfloat16
    batch = _quantized_batch([(17, 1), (40, 9), (5, 5)], kind, dtype, seed=6)
    not_owned = ~batch.owned_slots
    caches = []
    for cache in (batch.key_cache, batch.value_cache):
        poisoned = cache.clone()
        poisoned.view(-1, *cache.shape[2:])[not_owned] = -1 if kind == "int8" else 0xFF
        caches.append(poisoned)
    _check(_run(batch, DEVICE, caches=caches), batch)


@pytest.mark.parametrize("kind", KINDS)
def test_the_scales_are_read(kind: str) -> None:
    # The comparison can fail: one owned row's K scale and another's V scale changed in the
    # kernel's caches only (the codes unchanged) moves the output off the reference.
    dtype = torch.float32 if not ON_CUDA else torch.bfloat16
    batch = _quantized_batch([(30, 1), (20, 1)], kind, dtype, seed=7)
    for which in (0, 1):
        caches = [batch.key_cache.clone(), batch.value_cache.clone()]
        row = caches[which][0, 3, 1]  # block 0 (the first sequence's), position 3, KV head 1
        row[-2:] = torch.tensor([2.0], dtype=torch.bfloat16).view(row.dtype)
        with pytest.raises(AssertionError):
            _check(_run(batch, DEVICE, caches=caches), batch)


def test_written_cache_reads_back() -> None:
    # The write kernel's rows through the attention kernel against the reference on the same
    # rows dequantized (under the interpreter FP8 rows hold its own conversion's codes: still
    # valid rows, read back as written).
    dtype = torch.float32 if not ON_CUDA else torch.bfloat16
    g = torch.Generator().manual_seed(8)
    for kind in KINDS:
        _skip_fp8_without_gpu_support(kind)
        key_cache = torch.zeros(4, 16, 2, 66, dtype=kv_quant.storage_dtype(kind, dtype), device=DEVICE)
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(40, 2, 64, generator=g).to(dtype)
        value = torch.randn(40, 2, 64, generator=g).to(dtype)
        slots = torch.arange(40) + 16  # blocks 1..3
        reshape_and_cache(key.to(DEVICE), value.to(DEVICE), key_cache, value_cache, slots.to(DEVICE))
        batch = make_batch([(40, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=9)
        batch.key_cache, batch.value_cache = key_cache.cpu(), value_cache.cpu()
        batch.block_tables = torch.tensor([[1, 2, 3]], dtype=torch.int32)
        batch.query = batch.query.to(dtype)
        _check(_run(batch, DEVICE), batch)


# ---- argument checks ------------------------------------------------------------------------


def _attention_args(kind: str = "int8", dtype=torch.float32, **changes) -> dict:
    batch = _quantized_batch([(20, 1), (9, 3)], kind, dtype)
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
    args = dict(zip(names, _on(batch, DEVICE)), scale=0.125)
    for name, fn in changes.items():
        args[name] = fn(args)
    return args


ATTENTION_BAD_ARGS = {
    "row_without_scale": (
        dict(key_cache=lambda a: a["key_cache"][..., :64].contiguous(),
             value_cache=lambda a: a["value_cache"][..., :64].contiguous()),
        r"head_dim \+ 2",
    ),
    "row_too_wide": (
        dict(key_cache=lambda a: torch.zeros(*a["key_cache"].shape[:3], 68, dtype=torch.int8, device=DEVICE),
             value_cache=lambda a: torch.zeros(*a["key_cache"].shape[:3], 68, dtype=torch.int8, device=DEVICE)),
        r"head_dim \+ 2",
    ),
    "int8_keys_fp8_values": (dict(value_cache=lambda a: a["value_cache"].view(torch.uint8)), "int8 or both uint8"),
    "quantized_keys_float_values": (
        dict(value_cache=lambda a: torch.zeros(a["key_cache"].shape, device=DEVICE)), "int8 or both uint8"
    ),
    "float64_query": (dict(query=lambda a: a["query"].double()), "dtype"),
    "out_dtype": (dict(out=lambda a: torch.empty_like(a["query"]).half()), "out dtype"),
    "head_dim_32": (
        dict(query=lambda a: torch.randn(4, 6, 32, device=DEVICE),
             key_cache=lambda a: torch.zeros(*a["key_cache"].shape[:3], 34, dtype=torch.int8, device=DEVICE),
             value_cache=lambda a: torch.zeros(*a["key_cache"].shape[:3], 34, dtype=torch.int8, device=DEVICE)),
        "head_dim",
    ),
}


@pytest.mark.parametrize("case", list(ATTENTION_BAD_ARGS.values()), ids=list(ATTENTION_BAD_ARGS))
def test_attention_rejects_wrong_quantized_layouts(case) -> None:
    changes, message = case
    with pytest.raises(ValueError, match=message):
        paged_attention(**_attention_args(**changes))


@_CPU
def test_bfloat16_query_on_cpu_is_refused_not_wrong() -> None:
    args = _attention_args("fp8", torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        paged_attention(**args)


def _write_args(**changes) -> dict:
    args = dict(
        key=torch.randn(3, 2, 64),
        value=torch.randn(3, 2, 64),
        key_cache=torch.zeros(4, 16, 2, 66, dtype=torch.int8),
        value_cache=torch.zeros(4, 16, 2, 66, dtype=torch.int8),
        slot_mapping=torch.tensor([0, 1, 2]),
    )
    args.update(changes)
    return args


WRITE_BAD_ARGS = {
    "row_without_scale": (
        _write_args(key_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8),
                    value_cache=torch.zeros(4, 16, 2, 64, dtype=torch.int8)),
        r"head_dim \+ 2",
    ),
    "int8_keys_fp8_values": (
        _write_args(value_cache=torch.zeros(4, 16, 2, 66, dtype=torch.uint8)), "int8 or both uint8"
    ),
    "float64_values": (
        _write_args(key=torch.randn(3, 2, 64, dtype=torch.float64),
                    value=torch.randn(3, 2, 64, dtype=torch.float64)),
        "dtype",
    ),
    "key_value_dtypes_differ": (_write_args(value=torch.randn(3, 2, 64).half()), "dtype"),
    "kv_heads_mismatch": (_write_args(key=torch.randn(3, 1, 64), value=torch.randn(3, 1, 64)),
                          "match"),
    "head_dim_32": (
        _write_args(key=torch.randn(3, 2, 32), value=torch.randn(3, 2, 32),
                    key_cache=torch.zeros(4, 16, 2, 34, dtype=torch.int8),
                    value_cache=torch.zeros(4, 16, 2, 34, dtype=torch.int8)),
        "head_dim",
    ),
}


@pytest.mark.parametrize("case", list(WRITE_BAD_ARGS.values()), ids=list(WRITE_BAD_ARGS))
def test_write_rejects_wrong_quantized_layouts(case) -> None:
    args, message = case
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)
