"""Pagoda's CPU kernels (kernels/csrc/cpu_kernels.cpp): build on first use, and the
Python entry points with the reference ops' signatures.

The extension is compiled by `torch.utils.cpp_extension` (ninja + the machine's C++
compiler) with `-march=native`, once per machine: the build directory's name carries the
source hash and a fingerprint of the CPU's instruction-set flags, so a cache carried to a
different CPU is rebuilt instead of crashing on an unknown instruction. `make setup`
builds it ahead of time (`python -m kernels.cpu_kernels`); a later start loads it in well
under a second. Where it cannot be built (no compiler, another OS), `load()` returns None
with the reason, and the engine runs the torch reference ops and logs that it does.

The bf16 linear kernel (`bf16_linear` on weights packed by `pack_bf16_weight`, AVX512-BF16
CPUs only: `bf16_gemv_available`) is routed by engine/models/llama.py's `Linear`, not by
KernelOps: every call of a bf16 linear, whatever the kernel backend, as the oneDNN path
otherwise. Its int8 form (`int8_linear` on weights packed by `pack_int8_weight`) runs every
W8A16 call of an `Int8Linear` holding the packed copy (kernels/quant_linear.py), and its
int4 kernel (`int4_linear` on weights packed by `pack_int4_weight`) every W4A16 call of an
`Int4Linear` in that layout (engine/quantization/linears.py `cpu_int4_tensors`).

Attention routing (`paged_attention`):
- bf16 on AVX512-BF16 CPUs (head dims 64/128/256): every chunk in the C++ kernel, which
  reads K/V where the block tables say they lie, so its cost follows the keys each query
  attends to, with no copy of them. Decodes and short chunks (up to `BLOCK_MIN_ROWS` query
  rows: tokens x the KV head's group of query heads) take its few-row vdpbf16ps loop in
  items of at most 8 rows (`few_rows_q_chunk`); longer chunks take its blocked
  flash-attention loop (vdpbf16ps matrix tiles, online softmax), which runs at
  ~2.5x torch's flash kernel on a 512-token chunk after 7000 cached tokens and ~2x the
  few-row loop on 128-token prompts (`python -m loadtest.bench_cpu_attention`,
  docs/BENCHMARKS.md);
- elsewhere (float32, other head dims, no AVX512-BF16): decodes, short chunks (up to
  `SHORT_CHUNK` new tokens) and every chunk of a sliding-window layer in the C++ kernel's
  one-pass loop; longer prefill chunks of full-attention layers through torch's
  flash-attention CPU kernel (blocked GEMMs) over the chunk's K/V gathered once per layer.
  A chunk after cached tokens is two unmasked calls (the cached prefix, then the chunk
  itself causally) merged by their log-sum-exp, instead of one call with an explicit
  [q_len, ctx] mask, which takes SDPA's slow path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from kernels import kv_quant, reference

logger = logging.getLogger("pagoda.kernels")

SOURCE = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
HEADERS = [Path(__file__).parent / "csrc" / "work_pool.h"]  # included by SOURCE: part of its build's name
# Up to this many new tokens a sequence's attention runs in the C++ kernel; longer full-
# attention chunks go to torch's flash kernel (see the module docstring).
SHORT_CHUNK = 16
# Query tokens per C++ work item: a long windowed chunk splits into items the threads share.
Q_CHUNK = 16
# The C++ kernel's few-row bf16 loop takes work items of up to this many query rows
# (query tokens x the KV head's group of query heads): kFewRows in cpu_kernels.cpp.
FEW_ROWS = 8
# bf16 chunks of more than this many query rows take the C++ blocked loop: from 16 rows on
# its 32-row tiles beat the few-row loop (1.6x at 18 rows, 0.9x at 9, in a development
# A/B over 8 sequences of 200 tokens; less than a tile pads the rest).
BLOCK_MIN_ROWS = 16
# The batch-invariant bf16 route (the default on the C++ kernels, `--no-batch-invariant` turns it
# off; `paged_attention(..., invariant=True)`): a
# query row's output is the same bits whatever else the step holds (csrc/cpu_kernels.cpp,
# `attention_invariant`). Its keys are cut into parts at multiples of KEY_PART positions,
# merged in order; the parts are what the threads share, so a batch-1 decode at 1-2k
# tokens of context spreads over both threads as the split route (`attention_parts`) did.
KEY_PART = 128
# Query tokens per work item on the invariant route (any value gives the same bits).
INVARIANT_Q_CHUNK = 32

# PAGODA_CPU_LOOPS=openmp runs the kernels' parallel loops on OpenMP's team instead of the
# work pool (csrc/work_pool.h): the kernels as they were before the pool, for A/B benchmarks
# (loadtest/bench_noise.py's `pagoda-openmp`). Unset (the default): the work pool.
LOOPS_ENV = "PAGODA_CPU_LOOPS"

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    """The CPU's instruction-set flags line of /proc/cpuinfo ("" where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _cpu_fingerprint() -> str:
    """A short hash of the CPU's instruction-set flags (what -march=native compiles for)."""
    return hashlib.sha256((_cpu_flags() + torch.__version__).encode()).hexdigest()[:10]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 products in hardware (x86 AVX512-BF16 or AMX-BF16,
    Arm BF16): there bf16 halves the bytes each decode step streams at no loss of speed;
    elsewhere bf16 is emulated and float32 is faster (`--dtype auto` decides by this)."""
    flags = set(_cpu_flags().split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def load() -> ModuleType | None:
    """The compiled extension, building it if needed; None where it cannot be built (the
    reason is in `unavailable_reason()`)."""
    module = _state.get("module")
    if module is not None:  # the per-call path: no lock once built
        return module  # type: ignore[return-value]
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module, reason = None, None
        if not sys.platform.startswith("linux"):
            reason = f"the CPU kernels are built for Linux only (this is {sys.platform})"
        else:
            try:
                module = build(SOURCE, HEADERS)
            except Exception as e:  # a missing compiler or ninja, a failed build: run the reference
                reason = f"could not build the CPU kernels ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e})"
        if module is not None and os.environ.get(LOOPS_ENV) == "openmp":
            module.set_openmp_loops(True)
            logger.warning("%s=openmp: the CPU kernels' loops run on OpenMP's fork-join team, not the work pool "
                           "(for A/B benchmarks: slower next to other work)", LOOPS_ENV)
        _state["module"], _state["reason"] = module, reason
        if reason:
            logger.warning("%s; running the torch reference ops on CPU (slower)", reason)
        return module


def build(source: Path, headers: list[Path]) -> ModuleType:
    """Compile (or reuse the cached build of) `source` as an extension module named by its
    and its headers' contents and this CPU (`load` builds the repository's kernels with it;
    `python -m loadtest.bench_linear --baseline-rev` another revision's, beside them)."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [source, *headers])).hexdigest()[:10]
    return cpp_extension.load(
        name=f"pagoda_cpu_kernels_{digest}_{_cpu_fingerprint()}",
        sources=[str(source)],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
        extra_ldflags=["-fopenmp"],
        verbose=os.environ.get("PAGODA_VERBOSE_BUILD") == "1",
    )


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package (a dependency) installs it
    beside this interpreter, which is not on PATH when the venv is not activated."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def unavailable_reason() -> str | None:
    load()
    return _state.get("reason")  # type: ignore[return-value]


def bf16_gemv_available() -> bool:
    """Whether `bf16_linear` runs here: the extension built with AVX512-BF16 (compile-time:
    -march=native on such a CPU) and the CPU reporting it (runtime). Asked once per
    process (the attention wrapper asks on every call; /proc/cpuinfo takes ~100 us to read)."""
    if "bf16_gemv" not in _state:
        module = load()
        _state["bf16_gemv"] = module is not None and bool(module.has_bf16_gemv()) and "avx512_bf16" in _cpu_flags().split()
    return bool(_state["bf16_gemv"])


def bf16_dot_peak_gflops(seconds: float = 0.1, tries: int = 3) -> float:
    """The bf16 multiply-add ceiling of this machine's kernel threads, measured now (C++
    `bf16_dot_peak_gflops`: each thread issuing vdpbf16ps on registers only), GFLOP/s: the
    best of `tries` runs of about `seconds` each; 0.0 where the bf16 kernels do not run. A
    physical limit in the same run as a linear's GFLOP/s (loadtest/bench_decode_paths.py)."""
    if not bf16_gemv_available():
        return 0.0
    module = load()
    start = time.perf_counter()
    rate = module.bf16_dot_peak_gflops(100_000)  # a few ms: sizes the runs
    iterations = max(1, int(100_000 * seconds / (time.perf_counter() - start)))
    return max([rate] + [module.bf16_dot_peak_gflops(iterations) for _ in range(tries)])


def c12_available() -> bool:
    """Whether `c12_linear` (bf16 weights in 12 bits) runs here: `bf16_gemv_available()` and the
    extension built with AVX512-VBMI2 and the CPU reporting it (its decode's vpshrdw and
    vpexpandw)."""
    if "c12" not in _state:
        module = load()
        _state["c12"] = (bf16_gemv_available() and bool(module.c12_available())
                         and "avx512_vbmi2" in _cpu_flags().split())
    return bool(_state["c12"])


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """The bf16 linear kernel's copy of a dense bf16 CPU weight [N, K] (csrc/cpu_kernels.cpp
    `pack_bf16_weight`): vdpbf16ps's pair layout in groups of 32 outputs, as a tensor of the
    weight's shape that only `bf16_linear`, `bf16_silu_mlp` and `bf16_decode_layers` read
    (they refuse a dense weight). Only where `bf16_gemv_available()`."""
    return load().pack_bf16_weight(weight)


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for bfloat16 CPU tensors through the C++ kernel
    (csrc/cpu_kernels.cpp `bf16_linear_impl`), `packed` = `pack_bf16_weight(weight)`. One
    kernel at every row count: each output is one float32 chain of vdpbf16ps pair products
    over K in order, the bias added, rounded to bf16 once, so a row's result does not depend
    on the other rows of the call (batch invariance); 0.87-1.06x oneDNN's packed GEMM on
    prefill-sized calls and a weight stream at decode (docs/BENCHMARKS.md). Only where
    `bf16_gemv_available()`."""
    return _rowwise(lambda out, rows: load().bf16_gemv(out, rows, packed, bias), x, packed.shape[0])


def pack_int8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """The int8 kernel's copy of a W8A16 weight (int8 [N, K] on CPU): `pack_bf16_weight`'s
    pair layout (csrc/cpu_kernels.cpp `pack_int8_weight`), read only by `int8_linear` and
    `bf16_decode_layers`. Only where `bf16_gemv_available()`."""
    return load().pack_int8_weight(qweight)


def int8_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`(x @ qweight.T) * scales` for bf16 x, `packed` = `pack_int8_weight(qweight)` and bf16
    row scales [N] (csrc/cpu_kernels.cpp `int8_linear_impl`): `bf16_linear`'s kernel with each
    32 weights widened to bf16 as loaded, every row count, batch-invariant; at one row it
    streams the int8 weight ~1.7x faster than torch's `_weight_int8pack_mm`. Only where
    `bf16_gemv_available()`."""
    return _rowwise(lambda out, rows: load().int8_gemv(out, rows, packed, scales), x, packed.shape[0])


def pack_int4_weight(q: torch.Tensor, scale_offset: torch.Tensor, group_size: int) -> torch.Tensor:
    """The int4 kernel's copy of a W4A16 weight: q uint8 [N, K] in [0, 15], `scale_offset`
    bf16 [K / group_size, N, 2] (scale, offset) as torch's CPU int4 layout holds them
    (kernels/quant_linear.py `int4_scale_offset`: w = (q - 8) * scale + offset), the group
    size a multiple of 16 that divides K (csrc/cpu_kernels.cpp `pack_int4_weight`): a
    [N, K / 2] uint8 tensor read only by `int4_linear` and `bf16_decode_layers`. Only where
    `bf16_gemv_available()`."""
    return load().pack_int4_weight(q, scale_offset, group_size)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """`x @ W.T` for bf16 x, W the int4 weight `packed` = `pack_int4_weight(...)` with groups of
    `group_size` (csrc/cpu_kernels.cpp `int4_linear_impl`): per input group one float32
    chain of vdpbf16ps over bf16(q - 8), times the scale, plus the offset times the group's
    sum of x; rounded to bf16 once. Every row count, batch-invariant, on the work pool (no
    OpenMP), the nibbles streamed as they are (a quarter of bf16's bytes). Only where
    `bf16_gemv_available()`."""
    return _rowwise(lambda out, rows: load().int4_gemv(out, rows, packed, group_size), x, packed.shape[0])


def bf16_silu_mlp(x: torch.Tensor, gate_up_packed: torch.Tensor, down_packed: torch.Tensor) -> torch.Tensor:
    """`F.linear(F.silu(gate) * up, down_weight)` with `gate, up = F.linear(x, gate_up_weight)
    .chunk(2, -1)`, bfloat16 and without biases, in one call (csrc/cpu_kernels.cpp
    `bf16_silu_mlp`), the weights packed by `pack_bf16_weight`: both linears through
    `bf16_linear`'s kernel, the SiLU-and-multiply vectorised in C++, each intermediate rounded
    to bf16 as the eager ops round. Any row count (batch-invariant: the same arithmetic for a
    row alone or in a prefill); one call instead of five saves their Python and dispatch at
    decode. Only where `bf16_gemv_available()`."""
    return _rowwise(lambda out, rows: load().bf16_silu_mlp(out, rows, gate_up_packed, down_packed), x,
                    down_packed.shape[0])


def bf16_decode_layers(input_ids: torch.Tensor, embedding: torch.Tensor, layer_tensors: list[torch.Tensor],
                       kinds: list[int], kv_caches: list[torch.Tensor], windows: list[int], cos: torch.Tensor, sin: torch.Tensor,
                       positions: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_heads: int, num_kv_heads: int,
                       scale: float, eps: float, final_norm: torch.Tensor, out_rows: torch.Tensor,
                       lm_head: torch.Tensor | None = None, lm_head_scales: torch.Tensor | None = None,
                       invariant: bool = False, argmax_head: list[torch.Tensor] | None = None,
                       c12: list[torch.Tensor] | None = None,
                       lora: list[torch.Tensor] | None = None, lora_rows: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's Llama-style decoder layers for a few bf16 rows in one call
    (csrc/cpu_kernels.cpp `bf16_decode_layers`): the tokens `input_ids` (int64 [M]) looked
    up in `embedding` [vocab, hidden] (bf16), then every layer. The same kernels, order and
    rounding as the model's per-op forward (`add_rms_norm`, the linears' kernels, `rotary`,
    `reshape_and_cache`, `paged_attention` on its bf16 route, the MLP's SiLU), so the result
    is bit-identical to it, without ~10 Python calls per layer.

    `layer_tensors`: 14 per layer: input norm; qkv and o as (weight, bias, scales);
    post-attention norm; gate_up and down as (weight, bias, scales), an empty tensor for
    a missing bias or scales. `kinds`: each layer's 4 linears: 0 a bf16 weight packed by
    `pack_bf16_weight`, G > 0 int4 packed by `pack_int4_weight` with groups of G, -1 int8 with bf16 row scales.
    `kv_caches`: key, value per layer, bf16 or int8 (kernels/kv_quant.py: always read on the
    invariant route); `windows`: each layer's sliding window (0: none).
    Only where `bf16_gemv_available()` and `few_rows_q_chunk` is not None for the head
    dim (engine/models/llama.py `FusedDecodeLayers` checks both).

    Returns the model's final norm (weight `final_norm` [hidden], bf16) of the last layer's
    output rows `out_rows` (int64 [R]: the rows that sample), [R, hidden], as `add_rms_norm`
    with no add computes it; with `lm_head` [vocab, hidden] (bf16, packed, no bias), their
    logits instead: float32 [R, vocab], each the bf16 the head's kernel rounds it to (as
    `bf16_linear(hidden, lm_head).float()`); with `lm_head_scales` too (bf16 [vocab]) the head
    is int8 packed by `pack_int8_weight` (an `Int8Linear`'s copy: `int8_linear(hidden, lm_head,
    lm_head_scales).float()`). `argmax_head`: the bf16 head's int8 copy
    (kernels/greedy_head.py `greedy_head_copy`) for a step whose rows only take their argmax:
    with at most 4 rows the logits are `argmax_head_logits`' (exact where a token can be
    the argmax, -inf elsewhere). `c12`: 3 tensors per linear and layer, a bf16 weight's
    `pack_c12_weight` copy (3 empty tensors: none), which steps of up to 2 rows read instead
    (the same bits, from 3/4 of the bytes). `invariant`: attention on `paged_attention`'s
    batch-invariant route (as the per-op forward with the same setting; an int8 cache always).
    `lora`, `lora_rows`: a step with LoRA rows (engine/lora.py `LoraManager.fused_tensors`):
    a, bt, offsets per linear and layer, and each row's adapter group; each linear's deltas
    are added by `lora_add` as the per-op forward's hooks add them."""
    return load().bf16_decode_layers(input_ids, embedding, layer_tensors, kinds, kv_caches, windows, cos, sin,
                                     positions, slot_mapping, block_tables, seq_lens, query_start_loc, num_heads,
                                     num_kv_heads, scale, eps,
                                     *_decode_route(num_heads, num_kv_heads, invariant, kv_caches), final_norm,
                                     out_rows, lm_head if lm_head is not None else _EMPTY_BF16,
                                     lm_head_scales if lm_head_scales is not None else _EMPTY_BF16,
                                     argmax_head or [], c12 or [], lora or [],
                                     lora_rows if lora_rows is not None else _EMPTY_ROWS)


def _decode_route(num_heads: int, num_kv_heads: int, invariant: bool, kv_caches: list[torch.Tensor]) -> tuple:
    """The fused call's attention routing (q_chunk, few_rows, block_over, key_part): the
    batch-invariant route, which an int8 cache always takes, or the few-row and blocked loops."""
    invariant = invariant or kv_caches[0].dtype == torch.int8
    return (INVARIANT_Q_CHUNK if invariant else _few_rows_per_item(num_heads, num_kv_heads), FEW_ROWS,
            0 if invariant else BLOCK_MIN_ROWS, KEY_PART if invariant else 0)


_EMPTY_BF16 = torch.empty(0, dtype=torch.bfloat16)  # no LM head: bf16_decode_layers returns the hidden rows
_EMPTY_ROWS = torch.empty(0, dtype=torch.int64)  # no LoRA rows


class DecodeModel:
    """`bf16_decode_layers`' model side held across steps (csrc/cpu_kernels.cpp `DecodeModel`):
    the embedding, every layer's tensors, the KV caches, the final norm and the heads, checked
    once, here; a step then passes only its own tensors (`__call__`). Passing the model's ~900
    tensors to every call, each converted by pybind11 and checked again, cost ~0.35 ms a step
    (docs/BENCHMARKS.md, "Where a batch-1 step's time goes"). The arguments are
    `bf16_decode_layers`' of the same names; `holds` tells a caller whether its caches and
    copies are the ones held."""

    def __init__(self, embedding: torch.Tensor, layer_tensors: list[torch.Tensor], kinds: list[int],
                 kv_caches: list[torch.Tensor], windows: list[int], num_heads: int, num_kv_heads: int, scale: float,
                 eps: float, final_norm: torch.Tensor, lm_head: torch.Tensor | None = None,
                 lm_head_scales: torch.Tensor | None = None, invariant: bool = False,
                 argmax_head: list[torch.Tensor] | None = None, c12: list[torch.Tensor] | None = None) -> None:
        self.kv_caches, self.argmax_head, self.c12 = list(kv_caches), argmax_head, c12
        self._route = _decode_route(num_heads, num_kv_heads, invariant, kv_caches)
        self._model = load().DecodeModel(
            embedding, layer_tensors, kinds, self.kv_caches, windows, num_heads, num_kv_heads, scale, eps, final_norm,
            lm_head if lm_head is not None else _EMPTY_BF16,
            lm_head_scales if lm_head_scales is not None else _EMPTY_BF16, argmax_head or [], c12 or [])

    def holds(self, kv_caches: list[torch.Tensor], argmax_head: list[torch.Tensor] | None,
              c12: list[torch.Tensor] | None) -> bool:
        """Whether these are the caches (the same tensors, in order) and copies it was made with."""
        return (argmax_head is self.argmax_head and c12 is self.c12 and len(kv_caches) == len(self.kv_caches)
                and all(a is b for a, b in zip(kv_caches, self.kv_caches)))

    def __call__(self, input_ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, out_rows: torch.Tensor, logits: bool = False, argmax: bool = False,
                 lora: list[torch.Tensor] | None = None, lora_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One step: `bf16_decode_layers`' result for these step arguments. `logits`: the head's
        logits (the model was given a head); `argmax`: through the greedy head's copy (given
        one) where the step's rows only take their argmax."""
        return self._model.run(input_ids, cos, sin, positions, slot_mapping, block_tables, seq_lens, query_start_loc,
                               *self._route, out_rows, logits, argmax, lora or [],
                               lora_rows if lora_rows is not None else _EMPTY_ROWS)


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b_pairs: torch.Tensor, row_group: torch.Tensor,
             offsets: torch.Tensor) -> None:
    """`out[m] += (x[m] @ a[o0:o1].T) @ B[:, o0:o1].T` for each row m of adapter group
    g = row_group[m] >= 0, [o0, o1) = offsets[g:g + 2], even (csrc/cpu_kernels.cpp
    `lora_add_rows`): bf16 out [M, N], x [M, K], a [R, K] and B in `vdpbf16ps`'s pair layout,
    b_pairs [R/2, 2N] with b_pairs[j, 2n + i] = B[n, 2j + i]; the shrink's outputs rounded to
    bf16 in pairs, each output's sum in float32, rounded once; a row's result depends on its
    own inputs only. Only where `bf16_gemv_available()`."""
    load().lora_add(out, x, a, b_pairs, row_group, offsets)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` of bf16 rows `gate_up` [M, 2I] as `bf16_silu_mlp` computes its
    activation (vectorised, each product rounded as the eager ops round). Only where
    `bf16_gemv_available()`."""
    return load().silu_mul(gate_up)


def unpack_bf16_weight(packed: torch.Tensor) -> torch.Tensor:
    """The dense [N, K] bf16 weight a `pack_bf16_weight` copy holds (its pair layout:
    packed[((g * Kp + kp) * 32 + l) * 2 + j] = W[32 g + l][2 kp + j], Kp = ceil(K / 2))."""
    n, k = packed.shape
    kp, groups = (k + 1) // 2, (n + 31) // 32
    pairs = packed.as_strided((groups, kp, 32, 2), (kp * 64, 64, 2, 1))
    return pairs.permute(0, 2, 1, 3).reshape(groups * 32, kp * 2)[:n, :k].contiguous()


def pack_c12_weight(weight: torch.Tensor) -> list[torch.Tensor]:
    """A dense bf16 weight [N, K] held in 12 bits a weight, losslessly (csrc/cpu_kernels.cpp
    `c12_linear_impl`): each weight's sign and mantissa in a byte and a 4-bit code for its
    exponent below its row's largest; the few weights more than 14 binades below it (zeros,
    subnormals) kept whole in a list. Returns [packed uint8, exceptions int16, offsets int64]
    as `c12_linear` and `bf16_decode_layers`' `c12` take them."""
    return load().pack_c12_weight(weight)


def c12_copy_bytes(out_features: int, in_features: int) -> int:
    """The bytes `pack_c12_weight` takes for an [N, K] weight, its exceptions aside (2 bytes
    each; 0.008-0.24% of a real model's weights): per group of 32 outputs a 128-byte header
    of row exponents and 96 bytes per input pair, and the groups' 8-byte list offsets."""
    groups = (out_features + 31) // 32
    return groups * (128 + 96 * ((in_features + 1) // 2)) + 8 * (groups + 1)


def c12_linear(x: torch.Tensor, c12: list[torch.Tensor], out_features: int) -> torch.Tensor:
    """`x @ W.T` for bf16 x [M, K] and W's `pack_c12_weight` copy: the bits of `bf16_linear(x,
    pack_bf16_weight(W))` (the same float32 chains over the decoded weights), reading 3/4
    of the bytes; a weight stream for 1-2 rows, slower than the bf16 kernel from ~4 rows on
    (the decode's vector work is no longer hidden). Only where `c12_available()`."""
    return load().c12_linear(x, c12, out_features)


def argmax_head_logits(x: torch.Tensor, head: torch.Tensor, argmax_head: list[torch.Tensor]) -> torch.Tensor:
    """The float32 logits [R, V] a greedy row needs of x [R, K] (bf16) through the head
    `head` (packed by `pack_bf16_weight`) and its int8 copy `argmax_head`
    (kernels/greedy_head.py `greedy_head_copy`): the exact logits (`bf16_linear(x,
    head).float()`'s bits) of every 32-token group that holds a token that can be the row's
    argmax, -inf elsewhere, so `argmax` of them is the whole head's (csrc/cpu_kernels.cpp
    `argmax_head_logits_impl`, which the fused decode call runs for greedy steps). Only
    where `bf16_gemv_available()`."""
    return load().argmax_head_logits(x, head, argmax_head)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` of float32 rows [R, V]: the first index of each row's largest
    value (a NaN counts as the largest). On CPU through the extension's `argmax_rows` where
    it is built (torch's CPU argmax is a scalar loop: ~45 us for a 49k vocabulary, a greedy
    decode step's sampling; ~5 us there), otherwise torch's."""
    if (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.shape[1] > 0 and logits.is_contiguous()):
        module = load()
        if module is not None:
            return module.argmax_rows(logits)
    return logits.argmax(dim=-1)


def _rowwise(kernel, x: torch.Tensor, n: int) -> torch.Tensor:
    """`kernel(out, rows)` on x's rows as one contiguous [M, K] matrix into a new [M, n]
    output, returned in x's leading shape."""
    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, dtype=x.dtype)
    kernel(out, rows)
    return out.view(*x.shape[:-1], n)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """K/V into their cache slots; an int8 cache's rows quantized as `kv_quant.quantize` does
    (bit for bit), an FP8 cache's through the reference (no CPU kernel writes E4M3)."""
    if key_cache.dtype == torch.uint8:
        reference.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return
    load().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    out: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """The reference op's semantics (kernels/reference.py), routed as the module docstring says.
    bf16 with `invariant` (batch invariance: the engine's default here): every chunk on the
    batch-invariant route, so a row's output does not depend on the step's other rows, its
    chunk's length or which of its keys were cached. An int8 cache (kernels/kv_quant.py) is
    read in place on that route whatever `invariant` says (`int8_cache_runs`); elsewhere
    (float32 queries, no AVX512-BF16) through the reference, which dequantizes what it gathers."""
    query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    window = int(sliding_window or 0)
    few_rows = few_rows_q_chunk(query, key_cache.shape[2])
    if kv_quant.is_quantized(key_cache):
        if not (few_rows and key_cache.dtype == torch.int8):
            return reference.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                                             scale, out, sliding_window=sliding_window)
        invariant = True
    if few_rows and invariant:
        load().paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                               window, INVARIANT_Q_CHUNK, 0, FEW_ROWS, 0, KEY_PART)
        return out
    q_chunk = few_rows or Q_CHUNK
    # bf16 with the few-row loop (an AVX512-BF16 build): the C++ kernel takes every chunk,
    # long ones in its blocked loop. Otherwise windowed layers attend to at most `window`
    # keys per query and also stay in C++; long full-attention chunks go to flash.
    skip_over = 0 if (window or few_rows) else SHORT_CHUNK
    block_over = BLOCK_MIN_ROWS if few_rows else 0
    load().paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, window,
                           q_chunk, skip_over, FEW_ROWS, block_over, 0)
    if skip_over and query.shape[0] > skip_over:
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        for i, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
            if b - a > skip_over:
                _attend_long_chunk(out, query, key_cache, value_cache, block_tables[i], lens[i], a, b, scale)
    return out


def int8_cache_runs(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the C++ kernel reads an int8 KV cache in place for queries of this dtype and
    head dim (its bf16 invariant route); elsewhere `paged_attention` runs the reference."""
    return blocked_attention_runs(dtype, head_dim)


def blocked_attention_runs(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether long prefill chunks of this dtype and head dim take the C++ blocked loop
    (where `few_rows_q_chunk` is not None) rather than torch's flash kernel."""
    return dtype == torch.bfloat16 and head_dim in (64, 128, 256) and bf16_gemv_available()


def few_rows_q_chunk(query: torch.Tensor, num_kv_heads: int) -> int | None:
    """Query tokens per work item that keep the C++ kernel on its few-row bf16 loop (at
    most FEW_ROWS query rows per KV head), or None where that loop (and the blocked one)
    does not run: not bf16, a head dim other than 64/128/256, or a build without
    AVX512-BF16."""
    if not blocked_attention_runs(query.dtype, query.shape[-1]):
        return None
    return _few_rows_per_item(query.shape[1], num_kv_heads)


def _few_rows_per_item(num_heads: int, num_kv_heads: int) -> int:
    """Query tokens per few-row work item: at most FEW_ROWS rows of the KV head's group."""
    return max(1, FEW_ROWS // (num_heads // num_kv_heads))


def _attend_long_chunk(out, query, key_cache, value_cache, table, ctx: int, start: int, end: int,
                       scale: float) -> None:
    """One sequence's prefill chunk of `end - start` new tokens after `ctx - (end - start)`
    cached ones, through torch's flash-attention CPU kernel (no mask).

    The cached prefix is visible to every query row, so each KV head's group of query heads
    is folded into its rows ([kv heads, group x chunk, d] against [kv heads, prefix, d]):
    the prefix's K/V are read as gathered, with no copy per query head, and each flash
    GEMM has group x more rows. Only the chunk's own causal part (chunk x chunk) repeats
    its K/V per query head."""
    q_len = end - start
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    blocks = table[: (ctx + block_size - 1) // block_size].long()
    k = key_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1)  # [kv, ctx, d]
    v = value_cache[blocks].view(-1, num_kv_heads, head_dim)[:ctx].transpose(0, 1)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cached = ctx - q_len
    q = query[start:end]  # [q_len, heads, d]; head h = kv head h // group, member h % group
    k_new, v_new = k[:, cached:], v[:, cached:]
    if group > 1:
        k_new, v_new = k_new.repeat_interleave(group, 0), v_new.repeat_interleave(group, 0)
    o, lse = flash(q.transpose(0, 1).unsqueeze(0), k_new.unsqueeze(0), v_new.unsqueeze(0), 0.0, True, scale=scale)[:2]
    if cached:
        folded = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads, group * q_len, head_dim)
        o1, lse1 = flash(folded, k[:, :cached].unsqueeze(0), v[:, :cached].unsqueeze(0), 0.0, False, scale=scale)[:2]
        o1, lse1 = o1.reshape(1, num_heads, q_len, head_dim), lse1.reshape(1, num_heads, q_len)
        # Softmax over [cached prefix | chunk] = the two partial softmaxes merged by their
        # log-sum-exp: the prefix fully visible (no mask), the chunk causal within itself.
        m = torch.maximum(lse1, lse)
        w1, w2 = (lse1 - m).exp().unsqueeze(-1), (lse - m).exp().unsqueeze(-1)
        o = (o1.float() * w1 + o.float() * w2) / (w1 + w2)
    out[start:end] = o[0].transpose(0, 1).to(out.dtype)


def main() -> None:
    """`python -m kernels.cpu_kernels`: build (or find) the extension; `make setup` runs it."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if load() is None:
        print(f"CPU kernels not available: {unavailable_reason()}")
    else:
        print(f"CPU kernels ready ({SOURCE.name})")


if __name__ == "__main__":
    main()
