"""Padded decode (CUDA graphs) and the GPU memory profile.

On CPU the decode graph runner runs with `use_cuda_graphs=False`: the same static,
padded buffers and code path, the forward pass run eagerly instead of replayed. Its
greedy tokens must equal Hugging Face `generate` and its logits the unpadded eager path's,
at batch sizes that need padding (3 -> 4, 5 -> 8), with preemption, chunked prefill,
shrinking batches (stale padded rows) and copy-on-write forks mixed in. The real graphs
(and the profile on a real device) run only where CUDA is; they skip with a reason here.

The model is a tiny random Llama with head_dim 64 (the Triton kernels' size, so CUDA
graphs are possible on a GPU) and a word-level tokenizer: no download, no converted model.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    # The Triton variant runs in the interpreter, which must be on before the kernels import.
    os.environ["TRITON_INTERPRET"] = "1"

from engine import LLM, SamplingParams  # noqa: E402
from engine.cuda_graphs import DecodeGraphRunner, graph_batch_sizes  # noqa: E402
from engine.dummy_model import write_dummy_model_folder  # noqa: E402
from engine.kv_cache import GiB, KVCacheSpec  # noqa: E402
from engine.memory import MemoryProfile, kv_cache_budget_from_profile, profile_batch_lengths, profile_run  # noqa: E402
from kernels.triton_runtime import INTERPRETED  # noqa: E402

needs_cuda = pytest.mark.skipif(not ON_CUDA, reason="CUDA graphs and GPU memory profiling need a CUDA device")

VOCAB_SIZE = 512
BLOCK_SIZE = 4
PROMPT_LENS = (1, 7, 23, 40, 61)
MAX_TOKENS = (10, 16, 12, 16, 14)  # different lengths: the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1
GRAPH_SIZES = [1, 2, 4, 8]
# The padded block tables are this wide (256 blocks of 4): the Triton attention then
# splits a padded decode batch's keys 4 ways (split-K), while an eager batch's narrow table
# keeps one split.
MAX_MODEL_LEN = 1024


# ---- batch sizes and the memory budget (pure functions) ----------------------------------------


@pytest.mark.parametrize(
    "max_num_seqs, cap, expected",
    [
        (256, None, [1, 2, 4, *range(8, 257, 8)]),
        (100, None, [1, 2, 4, *range(8, 97, 8), 100]),
        (3, None, [1, 2, 3]),
        (1, None, [1]),
        (256, 20, [1, 2, 4, 8, 16, 20]),
        (512, None, [1, 2, 4, *range(8, 257, 8)]),
    ],
    ids=["default-256", "max-seqs-100", "max-seqs-3", "max-seqs-1", "cap-20", "max-seqs-512"],
)
def test_graph_batch_sizes(max_num_seqs, cap, expected):
    assert graph_batch_sizes(max_num_seqs, cap) == expected


def _profile(**overrides) -> MemoryProfile:
    fields = dict(total=100 * GiB, free_at_start=99 * GiB, weights=16 * GiB, activations=3 * GiB,
                  non_torch_increase=GiB // 2)
    return MemoryProfile(**{**fields, **overrides})


def test_kv_budget_is_utilization_minus_weights_activations_and_non_torch():
    profile = _profile()
    # 0.9 x 100 - 16 - 3 - 0.5 = 70.5 GiB
    assert kv_cache_budget_from_profile(profile, 0.9) == int(70.5 * GiB)
    assert kv_cache_budget_from_profile(profile, 0.5) == int(30.5 * GiB)


def test_kv_budget_refuses_when_the_device_is_already_busy():
    with pytest.raises(ValueError, match="were free at start-up.*gpu-memory-utilization 0.9"):
        kv_cache_budget_from_profile(_profile(free_at_start=80 * GiB), 0.9)


def test_kv_budget_refuses_when_weights_and_activations_fill_the_share():
    with pytest.raises(ValueError, match="leave no room for the KV cache"):
        kv_cache_budget_from_profile(_profile(), 0.19)  # 19 GiB < 19.5 used


@pytest.mark.parametrize("utilization", [0.0, 1.5, -0.1])
def test_kv_budget_rejects_utilization_outside_0_1(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_budget_from_profile(_profile(), utilization)


@pytest.mark.parametrize(
    "tokens, seqs, expected",
    [(8192, 256, [32] * 256), (10, 4, [3, 3, 2, 2]), (3, 8, [1, 1, 1]), (5, 1, [5])],
    ids=["8192-over-256", "uneven", "fewer-tokens-than-seqs", "one-seq"],
)
def test_profile_batch_fills_the_token_budget(tokens, seqs, expected):
    assert profile_batch_lengths(tokens, seqs) == expected


# ---- the tiny model -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """2 layers, 4 query heads on 2 KV heads of 64 dims; weights at 10x the default scale so
    a wrong row, slot or padding changes the tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-graphs")
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2,
    )
    write_dummy_model_folder(path, config)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def prompts_and_hf_tokens(model_path):
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in PROMPT_LENS]
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for ids, max_tokens in zip(prompts, MAX_TOKENS):
            out = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
            )
            expected.append(out[0, len(ids):].tolist())
    return prompts, expected


def _engine(model_path, **kwargs) -> LLM:
    # 42 blocks of 4 hold all five prompts (35 blocks) but not all five outputs (51 blocks):
    # the newest request is preempted once the five decode together. A 32-token budget
    # splits the 40- and 61-token prompts into chunks mixed with decodes.
    args = dict(
        dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks_override=42, max_num_batched_tokens=32,
        max_model_len=MAX_MODEL_LEN,
    )
    return LLM(model=str(model_path), **{**args, **kwargs})


def _params() -> list[SamplingParams]:
    # min_tokens masks EOS as HF's min_new_tokens does: every request runs to its length.
    return [SamplingParams(temperature=0, max_tokens=n, min_tokens=n) for n in MAX_TOKENS]


def _watch(core, rtol: float = 1e-5, atol: float = 1e-5) -> list[tuple[int, int]]:
    """Record (decode batch, padded batch) of every graph-runner step, and check each step's
    logits against the unpadded eager forward pass of the same step."""
    runner, graphs = core.runner, core.runner.decode_graphs
    seen = []
    execute = graphs.execute

    def checked(sched, blocks_to_copy=None):
        logits = execute(sched, blocks_to_copy)
        n = len(sched.scheduled)
        seen.append((n, graphs.padded_batch_size(n)))
        # The eager pass writes the same K/V into the same slots again: harmless.
        input_ids, positions, meta = runner.prepare(sched)
        eager = runner.worker.forward(input_ids, positions, meta, None)
        torch.testing.assert_close(logits, eager, rtol=rtol, atol=atol * float(eager.abs().max()))
        return logits

    graphs.execute = checked
    return seen


def _padded_runner(core, use_cuda_graphs: bool) -> DecodeGraphRunner:
    runner = DecodeGraphRunner(core.worker, core.block_manager, GRAPH_SIZES, use_cuda_graphs=use_cuda_graphs)
    runner.capture(log=False)
    return runner


# ---- padded decode on CPU (the graph runner's eager mode) -----------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_decode_equals_hf_with_preemption_chunked_prefill_and_shrinking_batches(
    model_path, prompts_and_hf_tokens, record_schedules, backend
):
    if backend == "triton" and not INTERPRETED:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before the kernels import (on CUDA: the tests below)")
    prompts, expected = prompts_and_hf_tokens
    llm = _engine(model_path, device="cpu", kernel_backend=backend)
    core = llm.engine_core
    core.runner.decode_graphs = _padded_runner(core, use_cuda_graphs=False)
    seen = _watch(core)
    steps = record_schedules(core)
    outs = llm.generate(prompts, _params())
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens)"
    assert core.scheduler.num_preemptions > 0
    assert any(partial for _, partial in steps), "no prefill was split into chunks"
    assert {(3, 4), (5, 8)} <= set(seen), f"padded sizes seen: {sorted(set(seen))}"
    # A smaller step after a larger one: the rows it pads held the earlier step's requests.
    sizes = [n for n, _ in seen]
    assert any(a > b for a, b in zip(sizes, sizes[1:]))
    # Mixed steps (prefill chunks with decodes) ran eagerly and still gave HF's tokens.
    assert sum(1 for out, _ in steps if any(n > 1 for n in out.num_scheduled_tokens)) > len(prompts)
    assert core.block_manager.num_free_blocks == core.num_blocks


def test_padded_decode_forks_copy_on_write_and_seeded_sampling_equal_eager(model_path, prompts_and_hf_tokens,
                                                                          record_schedules):
    """n = 3 forks share the prompt's partial block and copy it on their first decode (a
    padded batch 3 -> 4); seeded random samples equal the plain eager engine's."""
    prompt = prompts_and_hf_tokens[0][2]  # 23 tokens: the last one sits in a shared block of 4
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    outs = {}
    for padded in (True, False):
        llm = _engine(model_path, device="cpu", num_gpu_blocks_override=64)
        core = llm.engine_core
        if padded:
            core.runner.decode_graphs = _padded_runner(core, use_cuda_graphs=False)
            seen = _watch(core)
        steps = record_schedules(core)
        outs[padded] = [c.token_ids for c in llm.generate([prompt], params)[0].outputs]
        assert any(out.blocks_to_copy for out, _ in steps), "the forks never copied a shared block"
        assert core.block_manager.num_free_blocks == core.num_blocks
    assert (3, 4) in seen
    assert outs[True] == outs[False]
    assert len({tuple(t) for t in outs[True]}) > 1


def test_padded_decode_forward_never_syncs_with_the_host(model_path, monkeypatch):
    """What a capture forbids, checked on CPU: no op of the replayed forward pass (the model
    on the Triton kernels, interpreted here) reads a device value on the host - neither an
    aten op that would (item, nonzero, ...) nor a tensor-to-Python conversion."""
    if not INTERPRETED:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before the kernels import (on CUDA: the capture itself)")
    core = _engine(model_path, device="cpu", kernel_backend="triton").engine_core
    _check_padded_forward_never_syncs(core, monkeypatch)


def test_padded_decode_forward_never_syncs_with_quantized_linears(model_path, monkeypatch):
    """The same with the quantized linears routed as on CUDA (kernels.quant_linear.use_triton):
    INT4 in AutoGPTQ's layout on the W4A16 kernel, one layer with GPTQ's group_size -1 (a
    group of all K inputs), one INT8 layer on the W8A16 kernel; all interpreted here. (The
    reference's host -> device constant copy once made such a capture fail.)"""
    if not INTERPRETED:
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 before the kernels import (on CUDA: the capture itself)")
    import engine.quantization.linears as linears
    import kernels.quant_linear
    from engine.quantization.affine import quantize_tensor
    from engine.quantization.rtn import quantize_weight

    monkeypatch.setattr(linears, "gemv_enabled", lambda: False)  # AutoGPTQ's layout, as on CUDA: not Pagoda's
    monkeypatch.setattr(linears, "cpu_int4_mm_available", lambda: False)  # nor torch's CPU int4 kernel
    monkeypatch.setattr(kernels.quant_linear, "use_triton", lambda device: True)
    core = _engine(model_path, device="cpu", kernel_backend="triton", quantization="int4").engine_core
    layer = core.model.model.layers[0]
    gen = torch.Generator().manual_seed(0)
    down = torch.randn(layer.mlp.down_proj.qweight.shape[1], layer.mlp.down_proj.qweight.shape[0] * 8, generator=gen)
    layer.mlp.down_proj = linears.int4_linear(
        quantize_tensor(down, 4, down.shape[1], symmetric=False), None, torch.float32, core.device
    )
    o_proj = torch.randn(64, 4 * 64, generator=gen)
    layer.self_attn.o_proj = linears.int8_linear(quantize_weight(o_proj, "int8"), None, torch.float32, core.device)
    assert layer.mlp.down_proj.group_size == down.shape[1] and not layer.mlp.down_proj.cpu_packed
    calls = []
    for name in ("w4a16_linear", "w8a16_linear"):
        module = __import__(f"kernels.triton_{name.split('_')[0]}", fromlist=[name])
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    _check_padded_forward_never_syncs(core, monkeypatch)
    assert {"w4a16_linear", "w8a16_linear"} <= set(calls)  # the kernels ran under the recorder


def _check_padded_forward_never_syncs(core, monkeypatch) -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    syncing_ops = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default",
                   "aten.equal.default", "aten.is_nonzero.default"}
    found: list[str] = []

    class RecordOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            found.append(str(func))
            return func(*args, **(kwargs or {}))

    def recording(name, method):
        def wrapper(self, *args, **kwargs):
            found.append(f"Tensor.{name}")
            return method(self, *args, **kwargs)
        return wrapper

    runner = _padded_runner(core, use_cuda_graphs=False)
    conversions = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy")
    for name in conversions:
        monkeypatch.setattr(torch.Tensor, name, recording(name, getattr(torch.Tensor, name)))
    with RecordOps(), torch.inference_mode():
        runner.run(4)
    monkeypatch.undo()
    assert "aten.embedding.default" in found  # the forward pass ran under the recorder
    assert not set(found) & (syncing_ops | {f"Tensor.{n}" for n in conversions})


def test_profile_run_covers_the_token_budget_on_cpu(model_path):
    """The profile step (run on CUDA before sizing the cache) on the CPU: its scratch cache
    holds exactly the blocks of the full-budget batch."""
    llm = _engine(model_path, device="cpu")
    core = llm.engine_core
    spec = KVCacheSpec.from_model(core.model.args, torch.float32, BLOCK_SIZE)
    scratch = profile_run(core.model, spec, core.ops, core.device, max_num_batched_tokens=50, max_num_seqs=8)
    blocks = sum(-(-n // BLOCK_SIZE) for n in profile_batch_lengths(50, 8))
    assert scratch == blocks * spec.bytes_per_block


def test_profile_run_includes_prompt_logprob_rows_in_chunks(model_path, monkeypatch):
    """The profile step's LM head sees every position of the budget (the sampling rows and,
    the worst case, every other position as a prompt-logprob row), at most one chunk of
    rows at a time, as a real step computes them: their memory is in the profile's peak."""
    import engine.prompt_logprobs

    monkeypatch.setattr(engine.prompt_logprobs, "LOGITS_CHUNK_ROWS", 16)
    core = _engine(model_path, device="cpu").engine_core
    spec = KVCacheSpec.from_model(core.model.args, torch.float32, BLOCK_SIZE)
    rows: list[int] = []
    compute_logits = core.model.compute_logits
    monkeypatch.setattr(core.model, "compute_logits", lambda hidden: rows.append(hidden.shape[0]) or compute_logits(hidden))
    profile_run(core.model, spec, core.ops, core.device, max_num_batched_tokens=50, max_num_seqs=8)
    assert rows == [16, 16, 16, 2]


def test_capture_failure_falls_back_to_eager_with_one_log_line(model_path, monkeypatch, capfd):
    """A capture that raises (here a stand-in for CUDA's "operation not permitted when stream
    is capturing") leaves the engine on the eager path, said once at start-up."""
    import engine.cuda_graphs as cuda_graphs

    core = _engine(model_path, device="cpu").engine_core
    capfd.readouterr()

    def failing_capture(self, log=True):
        self.graphs[1] = object()  # a half-finished capture
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    monkeypatch.setattr(cuda_graphs, "graphs_unsupported_reason", lambda *args: None)
    monkeypatch.setattr(cuda_graphs.DecodeGraphRunner, "capture", failing_capture)
    assert cuda_graphs.build_decode_graph_runner(core.worker, core.block_manager, 4, None) is None
    lines = [line for line in capfd.readouterr().err.splitlines() if line]
    assert lines == [
        "[pagoda] fallback: CUDA graph capture failed (RuntimeError: CUDA error: operation not permitted when "
        "stream is capturing); decode steps run eagerly"
    ]


def test_engine_keeps_a_pad_block_past_the_block_manager(model_path):
    core = _engine(model_path, device="cpu").engine_core
    assert core.runner.kv_caches[0][0].shape[0] == core.block_manager.num_blocks + 1
    assert core.runner.decode_graphs is None  # on CPU every step is eager


def test_dummy_load_format_needs_no_checkpoint(tmp_path):
    """`--load-format dummy`: config.json and a tokenizer are enough (the GPU benchmark's model)."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )
    path = write_dummy_model_folder(tmp_path / "dummy", config)
    assert not list(path.glob("*.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(path), device="cpu", dtype="float32")
    llm = LLM(model=str(path), device="cpu", dtype="float32", load_format="dummy")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4
    # (On CPU the decoder linears keep only their oneDNN-packed weights; the embedding
    # table stays a parameter.)
    weights = dict(llm.engine_core.model.named_parameters())
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    assert 0.015 < float(weights["model.embed_tokens.weight"].std()) < 0.025


# ---- real CUDA graphs (GPU only) ------------------------------------------------------------------


@needs_cuda
def test_cuda_graphs_equal_hf_in_float32(model_path, prompts_and_hf_tokens):
    prompts, expected = prompts_and_hf_tokens
    llm = _engine(model_path, device="cuda", max_cuda_graph_batch_size=8, max_num_seqs=8)
    core = llm.engine_core
    graphs = core.runner.decode_graphs
    assert graphs is not None and graphs.use_cuda_graphs and sorted(graphs.graphs) == GRAPH_SIZES
    seen = _watch(core)
    outs = llm.generate(prompts, _params())
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({len(prompts[i])} tokens)"
    assert {(3, 4), (5, 8)} <= set(seen), f"padded sizes seen: {sorted(set(seen))}"
    assert core.block_manager.num_free_blocks == core.num_blocks


@needs_cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graph_logits_match_eager_in_16_bit(model_path, prompts_and_hf_tokens, dtype):
    prompts, _ = prompts_and_hf_tokens
    llm = _engine(model_path, device="cuda", dtype=dtype, max_cuda_graph_batch_size=8, max_num_seqs=8)
    seen = _watch(llm.engine_core, rtol=2e-2, atol=2e-2)
    outs = llm.generate(prompts, _params())
    assert [len(o.outputs[0].token_ids) for o in outs] == list(MAX_TOKENS)
    assert {(3, 4), (5, 8)} <= set(seen)


@needs_cuda
def test_enforce_eager_captures_nothing(model_path):
    core = _engine(model_path, device="cuda", enforce_eager=True).engine_core
    assert core.runner.decode_graphs is None


@needs_cuda
def test_kv_cache_sized_by_profile_within_the_utilization(model_path):
    utilization = 0.2
    free, total = torch.cuda.mem_get_info()
    if free < utilization * total:
        pytest.skip(f"only {free / GiB:.1f} GiB free on the device")
    core = LLM(model=str(model_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=utilization,
               enforce_eager=True).engine_core
    kv_bytes = (core.num_blocks + 1) * core.kv_spec.bytes_per_block
    assert kv_bytes <= utilization * total
    # The tiny model leaves almost all of its share to the cache.
    assert kv_bytes > 0.25 * utilization * total  # loose: parallel test shards share the device
