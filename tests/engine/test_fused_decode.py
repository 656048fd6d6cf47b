"""engine/models/llama.py `FusedDecodeLayers`: a decode step's layers in one C++ call
(kernels/csrc/cpu_kernels.cpp `bf16_decode_layers`) against the model's per-op forward.

The C++ call runs the per-op forward's kernels in the same order, so the two must agree
bit for bit: the final hidden states and every KV slot the step writes. The batches
mix sequence lengths over shuffled block tables, including a short chunk of several new
tokens (a speculative verification chunk), on Llama (GQA, tied head), Qwen2 (q/k/v
biases, one sliding-window layer) and Mistral (every layer windowed, shorter than the
contexts), in bf16 and with INT4 / INT8 weight-only linears (`--quantization`). Needs
the C++ kernels' AVX512-BF16 GEMV; skipped elsewhere.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.models.args import ModelArgs
from engine.models.llama import FusedDecodeLayers, prepack_linears
from engine.models.registry import model_class
from engine.quantization.rtn import convert_model
from kernels import cpu_kernels
from kernels.ops import get_ops
from tests.tiny_models import hf_config

pytestmark = pytest.mark.skipif(not cpu_kernels.bf16_gemv_available(), reason="needs the AVX512-BF16 C++ GEMV")

BLOCK_SIZE = 16
NUM_BLOCKS = 40
MAX_POSITIONS = 256


def make_model(arch: str, dtype: torch.dtype = torch.bfloat16, quantization: str | None = None, **overrides):
    """A random `arch` model (3 layers; Gemma 3's config names 2) in `dtype`, quantized at
    load (`--quantization`) and prepacked as the Worker prepacks it."""
    config = hf_config(arch, **({} if arch == "gemma3" else {"num_hidden_layers": 3}), **overrides)
    args = ModelArgs.from_hf_config(config)
    torch.manual_seed(0)
    model = model_class(args.model_type)(args, MAX_POSITIONS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if param.dim() == 1 else 2.0 / param.shape[-1] ** 0.5
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + scale * torch.randn(param.shape, generator=g))
    model.to(dtype)
    model.build_rope()  # the cos/sin tables stay float32
    if quantization is not None:
        convert_model(model, quantization)
    prepack_linears(model)
    return model


def make_step(model, seqs: list[tuple[int, int]], seed: int = 0):
    """KV caches whose cached prefixes are random, and one step's inputs: (seq_len, q_len)
    per sequence, the q_len new tokens the last ones of seq_len, blocks shuffled."""
    args = model.args
    g = torch.Generator().manual_seed(seed)
    shape = (NUM_BLOCKS, BLOCK_SIZE, args.num_key_value_heads, args.head_dim)
    caches = [(torch.randn(shape, generator=g).to(torch.bfloat16), torch.randn(shape, generator=g).to(torch.bfloat16))
              for _ in range(args.num_hidden_layers)]
    ids = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    max_blocks = max(-(-s // BLOCK_SIZE) for s, _ in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    slots, positions, starts = [], [], [0]
    for i, (seq_len, q_len) in enumerate(seqs):
        n = -(-seq_len // BLOCK_SIZE)
        tables[i, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
        for p in range(seq_len - q_len, seq_len):
            positions.append(p)
            slots.append(int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
        starts.append(starts[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        logits_indices=torch.tensor([e - 1 for e in starts[1:]], dtype=torch.int64),
    )
    input_ids = torch.randint(0, args.vocab_size, (starts[-1],), generator=g)
    return input_ids, torch.tensor(positions, dtype=torch.int64), caches, meta


def forward(model, fused, input_ids, positions, caches, meta):
    """The model's hidden states and the caches it wrote, with the fused call or without."""
    caches = [(k.clone(), v.clone()) for k, v in caches]
    model.fused_decode = fused
    try:
        hidden = model(input_ids, positions, caches, meta, get_ops("cpu", torch.device("cpu")))
    finally:
        model.fused_decode = None
    return hidden, caches


BATCHES = {
    "one decode": [(45, 1)],  # one and two rows: the bf16 linears' 12-bit copies
    "two decodes": [(45, 1), (7, 1)],
    "three decodes": [(45, 1), (3, 1), (90, 1)],
    "eight decodes": [(17 + 11 * i, 1) for i in range(8)],
    "twenty decodes": [(3 + 2 * i, 1) for i in range(20)],  # the many-row tiles (over 4 rows, 11 at a time)
    "a prefill chunk and decodes": [(80, 48), (30, 1), (12, 1)],  # a prompt's chunk of 48 rows beside them
    "a verification chunk and decodes": [(60, 5), (9, 1), (33, 1)],
}


@pytest.mark.parametrize("arch, quantization", [
    ("llama", None), ("qwen2", None), ("mistral", None),
    ("llama", "int4"), ("qwen2", "int4"), ("llama", "int8"),  # torch's int4 / int8 kernels, qwen2's biases after them
])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_fused_decode_layers_equal_the_per_op_forward(arch, quantization, batch):
    model = make_model(arch, quantization=quantization)
    fused = FusedDecodeLayers.build(model)
    assert fused is not None, f"{arch} {quantization}: the fused decode should run for this model"
    assert fused.kinds.count(0) == (len(fused.kinds) if quantization is None else 0)
    assert (fused.c12 is not None) == (quantization is None and cpu_kernels.c12_available())
    input_ids, positions, caches, meta = make_step(model, BATCHES[batch])
    assert fused.runs(input_ids, caches, get_ops("cpu", torch.device("cpu")))
    expected, expected_caches = forward(model, None, input_ids, positions, caches, meta)
    got, got_caches = forward(model, fused, input_ids, positions, caches, meta)
    assert torch.equal(got, expected)
    for (k, v), (ek, ev), (k0, _) in zip(got_caches, expected_caches, caches):
        assert torch.equal(k, ek) and torch.equal(v, ev)
        assert not torch.equal(k, k0)  # the step did write its new tokens' keys
    # And the per-op forward is not trivially equal to anything: another token differs.
    other_ids = (input_ids + 1) % model.args.vocab_size
    other, _ = forward(model, fused, other_ids, positions, caches, meta)
    assert not torch.equal(other, expected)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_call_runs_no_torch_copy_on_openmps_team(quantization):
    """The call's torch ops are allocations and views: its copies (the embeddings' rows, the
    queries out of the QKV output, the rows that sample) are its own loops. The ATen copies
    they were (index_select, contiguous, add_) run on OpenMP's team from ~32K elements, and
    where OpenMP's idle threads spin (OMP_WAIT_POLICY unset: a program that imported torch
    before the engine) they then held the cores the work pool needed: a 32-row step of the
    1B-class model took 1.5x as long. The INT4 MLP's SiLU and product stay torch's ops (the
    per-op forward's bits)."""
    model = make_model("llama", quantization=quantization)
    fused = FusedDecodeLayers.build(model)
    input_ids, positions, caches, meta = make_step(model, BATCHES["twenty decodes"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        hidden = fused(input_ids, positions, caches, meta)
    assert hidden.shape == (20, model.args.hidden_size)
    ran = {event.key for event in prof.key_averages()}
    allowed = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::narrow",
               "aten::slice", "aten::select", "aten::as_strided", "aten::item", "aten::_local_scalar_dense"}
    if quantization == "int4":
        allowed |= {"aten::silu", "aten::mul"}
    assert ran <= allowed, sorted(ran - allowed)
    assert "aten::empty" in ran  # the profiler did see the call's ops


def test_the_call_takes_steps_of_any_size_on_the_cpu_backend_only():
    model = make_model("llama")
    fused = FusedDecodeLayers.build(model)
    ops = get_ops("cpu", torch.device("cpu"))
    x = torch.zeros(2048, dtype=torch.int64)  # the step's tokens: a full default token budget
    caches = [(torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16),) * 2]
    assert fused.runs(x[:1], caches, ops) and fused.runs(x, caches, ops)
    assert not fused.runs(x[:0], caches, ops)
    assert not fused.runs(x[:1], caches, get_ops("torch", torch.device("cpu")))
    assert not fused.runs(x[:1], [(torch.zeros(1, 1, 1, 1, dtype=torch.float32),) * 2], ops)


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["bf16-head", "int8-head-of-int4"])
def test_a_step_none_of_whose_rows_samples_gives_no_logits_and_writes_its_keys(quantization):
    """A prompt's chunk that is not its last samples no row: the call gets no rows for the
    head (an empty `logits_indices`) and returns [0, vocab] logits, having written the
    chunk's keys and values as the per-op forward does (it read rows that were not there
    and crashed the process)."""
    model = make_model("llama", quantization=quantization)
    model.fused_decode = fused = FusedDecodeLayers.build(model)
    input_ids, positions, caches, meta = make_step(model, [(40, 6)])
    meta = replace(meta, logits_indices=torch.empty(0, dtype=torch.int64))
    _, expected_caches = forward(model, None, input_ids, positions, caches, meta)
    got_caches = [(k.clone(), v.clone()) for k, v in caches]
    model.fused_decode = fused
    got = model.decode_logits(input_ids, positions, got_caches, meta, get_ops("cpu", torch.device("cpu")))
    assert got.dtype == torch.float32 and got.shape == (0, model.args.vocab_size)
    for (k, v), (ek, ev), (k0, _) in zip(got_caches, expected_caches, caches):
        assert torch.equal(k, ek) and torch.equal(v, ev) and not torch.equal(k, k0)


@pytest.mark.parametrize("arch, dtype, quantization", [
    ("qwen3", torch.bfloat16, None), ("gemma3", torch.bfloat16, None), ("llama", torch.float32, None),
    ("llama", torch.bfloat16, "w8a8"),
])
def test_fused_decode_declines_what_it_does_not_run(arch, dtype, quantization):
    """q/k norms (Qwen3), Gemma's blocks, float32 linears and W8A8 keep the per-op forward."""
    assert FusedDecodeLayers.build(make_model(arch, dtype, quantization)) is None


def test_fused_decode_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_FUSED_DECODE", "0")
    assert FusedDecodeLayers.build(make_model("llama")) is None


def test_a_token_outside_the_vocabulary_is_an_error_not_a_read_past_the_table():
    """The fused call looks the tokens up itself: an id past the table raises, as the
    per-op forward's embedding does, instead of reading whatever lies after it."""
    model = make_model("llama")
    fused = FusedDecodeLayers.build(model)
    input_ids, positions, caches, meta = make_step(model, BATCHES["three decodes"])
    input_ids[1] = model.args.vocab_size
    with pytest.raises(RuntimeError, match="token id .* not in"):
        forward(model, fused, input_ids, positions, caches, meta)
    with pytest.raises(IndexError):
        forward(model, None, input_ids, positions, caches, meta)


@pytest.mark.parametrize("quantization", [None, "int4"], ids=["bf16-head", "int8-head-of-int4"])
@pytest.mark.parametrize("batch", ["one decode", "a verification chunk and decodes"])
def test_decode_logits_equal_the_per_op_head_widened(batch, quantization):
    """With the LM head in the call (`LlamaForCausalLM.decode_logits`, what the Worker runs
    for a decode step): float32 logits equal to the per-op forward's head output widened
    to float32, as the sampler widens it; every sampling row, bit for bit. The bf16 head, and
    the INT4 model's INT8 head (`--quantization int4` on CPU: the int8 kernel's packed copy)."""
    model = make_model("llama", quantization=quantization)
    model.fused_decode = fused = FusedDecodeLayers.build(model)
    assert fused.lm_head is not None
    assert (fused.lm_head_scales is not None) == (quantization == "int4")
    ops = get_ops("cpu", torch.device("cpu"))
    input_ids, positions, caches, meta = make_step(model, BATCHES[batch])
    expected_hidden, _ = forward(model, None, input_ids, positions, caches, meta)
    expected = model.compute_logits(expected_hidden).float()
    model.fused_decode = fused
    got = model.decode_logits(input_ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta, ops)
    assert got.dtype == torch.float32 and got.shape == (meta.logits_indices.shape[0], model.args.vocab_size)
    assert torch.equal(got, expected)
    # Where the call does not run the step, the caller runs the per-op forward and head.
    assert model.decode_logits(input_ids, positions, caches, meta, get_ops("torch", torch.device("cpu"))) is None


def test_a_head_without_a_kernel_copy_stays_out_of_the_call():
    """An INT8 head without the int8 kernel's packed copy (an `Int8Linear` the engine did not
    prepack) is not a head the call can run: it returns hidden states and the model's own
    head computes the logits."""
    model = make_model("llama", quantization="int4")
    model.lm_head.kernel_weight = None
    fused = FusedDecodeLayers.build(model)
    assert fused is not None and fused.lm_head is None and fused.lm_head_scales is None
    model.fused_decode = fused
    input_ids, positions, caches, meta = make_step(model, BATCHES["one decode"])
    assert model.decode_logits(input_ids, positions, caches, meta, get_ops("cpu", torch.device("cpu"))) is None


def test_a_gptq_act_order_linear_keeps_the_per_op_forward():
    """A GPTQ act-order checkpoint's linears permute their input first
    (`PermutedInputLinear`, no `bias` of its own): the call does not run them, and building
    it declines instead of failing the server's start-up (it raised AttributeError)."""
    from engine.quantization.linears import PermutedInputLinear

    model = make_model("llama", quantization="int4")
    attn = model.model.layers[0].self_attn
    attn.o_proj = PermutedInputLinear(torch.arange(model.args.num_attention_heads * model.args.head_dim), attn.o_proj)
    assert FusedDecodeLayers.build(model) is None


@pytest.mark.parametrize("batch", ["one decode", "three decodes", "a verification chunk and decodes", "eight decodes"])
def test_a_greedy_step_takes_the_heads_argmax_from_its_int8_copy(batch):
    """A step whose rows only take their argmax (`meta.argmax_only`): with at most 4 rows
    the call's logits are the head's own bits wherever finite, -inf where a token cannot be
    the argmax, and every row's argmax is the whole head's; over 4 rows (and without the
    flag) the whole head, bit for bit."""
    model = make_model("llama", vocab_size=4096)
    model.fused_decode = fused = FusedDecodeLayers.build(model)
    assert fused.argmax_head is not None
    ops = get_ops("cpu", torch.device("cpu"))
    input_ids, positions, caches, meta = make_step(model, BATCHES[batch])
    expected = model.decode_logits(input_ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta, ops)
    got = model.decode_logits(input_ids, positions, [(k.clone(), v.clone()) for k, v in caches],
                              replace(meta, argmax_only=True), ops)
    assert torch.equal(cpu_kernels.argmax(got), cpu_kernels.argmax(expected))
    finite = torch.isfinite(got)
    assert torch.equal(got[finite], expected[finite])
    if got.shape[0] <= 4:
        assert not bool(finite.all())  # the route ran: part of the head was never computed
    else:
        assert torch.equal(got, expected)


def test_the_greedy_head_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PAGODA_CPU_GREEDY_HEAD", "0")
    model = make_model("llama")
    fused = FusedDecodeLayers.build(model)
    assert fused.lm_head is not None and fused.argmax_head is None
    # An INT8 head (the INT4 model's) is read whole: it is already the smaller copy.
    monkeypatch.delenv("PAGODA_CPU_GREEDY_HEAD")
    assert FusedDecodeLayers.build(make_model("llama", quantization="int4")).argmax_head is None


def test_a_greedy_step_with_no_sampled_row_returns_no_logits():
    """A step none of whose rows is sampled (a prefill chunk short of its prompt's end) with
    the greedy head set: no logits, and no read of the missing rows (it once crashed)."""
    model = make_model("llama", vocab_size=4096)
    model.fused_decode = FusedDecodeLayers.build(model)
    ops = get_ops("cpu", torch.device("cpu"))
    input_ids, positions, caches, meta = make_step(model, BATCHES["one decode"])
    none = replace(meta, logits_indices=meta.logits_indices[:0], argmax_only=True)
    assert model.decode_logits(input_ids, positions, caches, none, ops).shape == (0, 4096)


@pytest.mark.skipif(not cpu_kernels.c12_available(), reason="the 12-bit copies need AVX512-VBMI2")
def test_the_12bit_copies_are_for_bias_free_bf16_linears_and_can_be_turned_off(monkeypatch):
    """Qwen2's qkv has a bias: no copy (the other three linears have one); an INT4 model has
    no bf16 linear; PAGODA_CPU_12BIT_WEIGHTS=0: none, and a one-row step's bits unchanged."""
    model = make_model("qwen2")
    fused = FusedDecodeLayers.build(model)
    has_copy = [t.numel() > 0 for t in fused.c12[0::3]]
    assert has_copy == [False, True, True, True] * model.args.num_hidden_layers
    assert fused.c12_bytes < 0.8 * fused.c12_bf16_bytes
    assert FusedDecodeLayers.build(make_model("llama", quantization="int4")).c12 is None
    monkeypatch.setenv("PAGODA_CPU_12BIT_WEIGHTS", "0")
    model = make_model("llama")
    off = FusedDecodeLayers.build(model)
    assert off.c12 is None
    monkeypatch.delenv("PAGODA_CPU_12BIT_WEIGHTS")
    on = FusedDecodeLayers.build(model)
    input_ids, positions, caches, meta = make_step(model, BATCHES["one decode"])
    expected = forward(model, off, input_ids, positions, caches, meta)[0]
    assert torch.equal(forward(model, on, input_ids, positions, caches, meta)[0], expected)
    # The one-row step does read the copies: one changed exponent changes its output.
    on.c12[0][5] ^= 1
    assert not torch.equal(forward(model, on, input_ids, positions, caches, meta)[0], expected)


@pytest.mark.skipif(not cpu_kernels.c12_available(), reason="the 12-bit copies need AVX512-VBMI2")
def test_the_12bit_copies_are_made_only_where_they_fit(monkeypatch):
    """`c12_budget_bytes` (what the host can still give beside the KV cache: engine/worker.py)
    one byte short of the copies' size: none, and why; exactly their size: made;
    PAGODA_CPU_12BIT_WEIGHTS=1 makes them whatever the budget. `c12_copy_bytes` is each copy's
    size but for its exceptions (2 bytes each)."""
    model = make_model("llama")
    unlimited = FusedDecodeLayers.build(model)
    exception_bytes = sum(t.numel() * t.element_size() for t in unlimited.c12[1::3])
    need = unlimited.c12_bytes - exception_bytes
    assert need == sum(cpu_kernels.c12_copy_bytes(*t.shape) for t in unlimited.tensors if t.dim() == 2)
    tight = FusedDecodeLayers.build(model, c12_budget_bytes=need - 1)
    assert tight.c12 is None
    assert tight.c12_skipped.startswith(f"no 12-bit copy: it needs {need / 2**20:.0f} MiB"), tight.c12_skipped
    fits = FusedDecodeLayers.build(model, c12_budget_bytes=need)
    assert fits.c12 is not None and fits.c12_skipped is None and fits.c12_bytes == unlimited.c12_bytes
    monkeypatch.setenv("PAGODA_CPU_12BIT_WEIGHTS", "1")
    assert FusedDecodeLayers.build(model, c12_budget_bytes=0).c12 is not None
    monkeypatch.setenv("PAGODA_CPU_12BIT_WEIGHTS", "0")
    off = FusedDecodeLayers.build(model)
    assert off.c12 is None and off.c12_skipped is None


def test_the_model_side_is_made_and_checked_once_and_follows_new_caches():
    """`FusedDecodeLayers` hands the model's tensors to C++ once (`cpu_kernels.DecodeModel`,
    checked when made); later steps over the same caches reuse it, and a step over other
    caches makes a new one: its keys land in those caches, as the per-op forward's do."""
    model = make_model("llama")
    fused = FusedDecodeLayers.build(model)
    ops = get_ops("cpu", torch.device("cpu"))
    input_ids, positions, caches, meta = make_step(model, BATCHES["two decodes"])
    model.fused_decode = fused
    try:
        first = model(input_ids, positions, caches, meta, ops)
        held = fused._held
        assert held is not None and all(a is b for a, b in zip(held.kv_caches, [c for pair in caches for c in pair]))
        again = model(input_ids, positions, caches, meta, ops)
        assert fused._held is held and torch.equal(again, first)
        other_caches = [(k.clone(), v.clone()) for k, v in caches]
        for k, v in other_caches:
            k.zero_(), v.zero_()
        model(input_ids, positions, other_caches, meta, ops)
        assert fused._held is not held
        held = fused._held
        fused.c12 = None  # the 12-bit copies set aside (bench_decode_paths' 16-bit path): made anew
        model(input_ids, positions, [(k.clone(), v.clone()) for k, v in caches], meta, ops)
        assert fused._held is not held
    finally:
        model.fused_decode = None
    _, expected_caches = forward(model, None, input_ids, positions, [(k.clone(), v.clone()) for k, v in other_caches],
                                 meta)
    for (k, v), (ek, ev) in zip(other_caches, expected_caches):
        assert torch.equal(k, ek) and torch.equal(v, ev) and k.abs().sum() > 0


def test_the_held_model_is_checked_when_made():
    """A tensor the kernels cannot take is refused when the held model is made, naming it,
    not at some later step: an unpacked weight, a norm of the wrong size."""
    model = make_model("llama")
    fused = FusedDecodeLayers.build(model)
    _, _, caches, _ = make_step(model, BATCHES["one decode"])
    flat = [c for pair in caches for c in pair]

    def held(tensors):
        return cpu_kernels.DecodeModel(fused.embedding, tensors, fused.kinds, flat, fused.windows, fused.num_heads,
                                       fused.num_kv_heads, fused.scale, fused.eps, fused.final_norm, fused.lm_head)

    held(fused.tensors)  # as built: accepted
    unpacked = list(fused.tensors)
    unpacked[1] = cpu_kernels.unpack_bf16_weight(unpacked[1])  # layer 0's qkv weight as a plain tensor
    with pytest.raises(RuntimeError, match="qkv: a bf16 weight packed by pack_bf16_weight expected"):
        held(unpacked)
    short_norm = list(fused.tensors)
    short_norm[0] = short_norm[0][:-1]
    with pytest.raises(RuntimeError, match="norm weights"):
        held(short_norm)
