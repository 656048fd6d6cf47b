"""Tensor parallelism on CPU (gloo): two ranks give exactly one rank's greedy tokens.

Every TP=2 engine spawns a real worker process; the scheduler runs on rank 0 (this
process), so its records show the chunked prefills and preemptions the workers followed.
The tiny models are random but not degenerate (initializer_range 0.1: every step's
argmax moves), with the shapes that exercise both KV layouts: one KV head replicated on
both ranks, and two KV heads split between them; both have whole INT4 groups per rank.
"""

import dataclasses
import os
import shutil
import signal
from datetime import timedelta

import pytest
import torch
from torch.distributed import distributed_c10d

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata
from engine.distributed import parallel_state
from engine.distributed.executor import TensorParallelError
from engine.distributed.sharding import ShardLayout, check_split, shard_model
from engine.distributed.step_message import MessageKind, StepInputs, decode, encode_header, encode_payload, payload_len
from engine.loader import load_hf_config, load_model
from engine.models.llama import ModelArgs

MAX_TOKENS = 12
BLOCK_SIZE = 16
PROMPTS = [
    [7],
    list(range(100, 117)),
    [5, 6, 7, 8] * 20,
    list(range(1000, 1300)),
]


def _make_model(root, default_model_path, name: str, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    path = root / name
    config = dict(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        head_dim=64, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    config.update(overrides)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(path)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_path / file, path / file)
    return path


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("tp-models")
    return {
        "kv1-untied": _make_model(root, default_model_path, "kv1-untied", num_key_value_heads=1, tie_word_embeddings=False),
        "kv2-tied": _make_model(root, default_model_path, "kv2-tied", num_key_value_heads=2, tie_word_embeddings=True),
    }


@pytest.fixture
def one_thread_per_rank(monkeypatch):
    """Two ranks on two cores: one thread each (the spawned worker reads OMP_NUM_THREADS)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _generate(path, **engine_args):
    llm = LLM(model=str(path), dtype="float32", max_model_len=512, **engine_args)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2))
        return llm, [o.outputs[0] for o in outs]
    finally:
        llm.shutdown()


def _same_greedy_tokens(out, exp, tie: float, what: str) -> int:
    """How many leading tokens `out` and the reference `exp` share, asserting that they part
    (if they do) only at a step where the reference's top two were within `tie` of each
    other: a near-tie that rounding may flip, after which the two runs continue differently."""
    for j, (got, want) in enumerate(zip(out.token_ids, exp.token_ids)):
        if got != want:
            top = sorted((lp.logprob for lp in exp.logprobs[j].values()), reverse=True)
            assert len(top) >= 2 and top[0] - top[1] < tie, (
                f"{what}: token {j} is {got}, the reference's {want}, which led by {top[0] - top[1]:.3f} nats")
            return j
    assert len(out.token_ids) == len(exp.token_ids), what
    return len(exp.token_ids)


@pytest.mark.parametrize(
    ("model", "quantization"),
    [("kv1-untied", None), ("kv2-tied", None), ("kv2-tied", "int8"), ("kv1-untied", "int4")],
    ids=["float-kv-replicated", "float-kv-split-tied", "int8", "int4"],
)
def test_tp2_equals_tp1_under_chunked_prefill_and_preemption(
    tp_models, model, quantization, record_schedules, one_thread_per_rank
):
    path = tp_models[model]
    _, expected = _generate(path, quantization=quantization, num_gpu_blocks_override=64)

    # Room for the longest request plus two blocks: the four together cannot fit, so the
    # scheduler preempts; a 32-token budget splits every longer prompt into chunks.
    num_blocks = -(-(max(map(len, PROMPTS)) + MAX_TOKENS) // BLOCK_SIZE) + 2
    llm = LLM(
        model=str(path), dtype="float32", max_model_len=512, quantization=quantization, tensor_parallel_size=2,
        block_size=BLOCK_SIZE, num_gpu_blocks_override=num_blocks, max_num_batched_tokens=32,
    )
    try:
        core = llm.engine_core
        steps = record_schedules(core)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
        assert core.scheduler.num_preemptions > 0
        assert any(partial for _, partial in steps), "no prefill was split into chunks"
        assert core.block_manager.num_free_blocks == core.num_blocks
    finally:
        llm.shutdown()
    # The whole gathered vocabulary enters each log-softmax: a misplaced slice would move
    # them. Quantized GEMMs round their input and output to bfloat16 on the CPU, and two
    # ranks round two partial sums instead of one: bfloat16's 2^-9, not float32's, which can
    # flip a near-tie of the greedy pick (then the runs part there, and only there).
    atol = 1e-3 if quantization is None else 0.1
    for i, (out, exp) in enumerate(zip(outs, expected)):
        shared = _same_greedy_tokens(out, exp, atol, f"prompt {i} ({len(PROMPTS[i])} tokens)")
        got = [step[t].logprob for step, t in zip(out.logprobs[:shared], out.token_ids)]
        want = [step[t].logprob for step, t in zip(exp.logprobs[:shared], exp.token_ids)]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=atol)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_tp2_equals_tp1_for_other_architectures(tmp_path, arch, record_schedules, one_thread_per_rank):
    """Tiny folders of tests/tiny_models.py. Qwen2: q/k/v biases cut with their rows.
    Qwen3: two KV heads split between the ranks, q/k norms replicated (one head_dim weight
    every head shares). Gemma 3: one KV head replicated, four norms per layer, the
    embedding scale over a vocab-parallel embedding, soft-capped logits gathered from two
    vocabulary halves, local and global layers."""
    from tiny_models import make_model_folder, prompts

    path = make_model_folder(tmp_path, arch)
    arch_prompts = prompts((1, 23, 61))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    runs = {}
    for tp, num_blocks in ((1, 64), (2, 20)):  # 20 blocks of 4 tokens: preemption at TP=2
        llm = LLM(model=str(path), dtype="float32", max_model_len=128, tensor_parallel_size=tp, block_size=4,
                  num_gpu_blocks_override=num_blocks, max_num_batched_tokens=16)
        try:
            steps = record_schedules(llm.engine_core)
            runs[tp] = [o.outputs[0].token_ids for o in llm.generate(arch_prompts, params)]
        finally:
            llm.shutdown()
    assert llm.engine_core.scheduler.num_preemptions > 0
    assert any(partial for _, partial in steps), "no prefill was split into chunks"
    assert runs[2] == runs[1]


def test_a_worker_that_stops_answering_fails_the_engine_instead_of_hanging_it(
    tp_models, one_thread_per_rank, monkeypatch
):
    """A hung (not dead) rank: rank 0 gives up after the collective timeout, and the error
    ends the engine (the ranks are out of step), not just the step. A worker that dies is
    the server test's case (tests/server/test_tensor_parallel_server.py)."""
    llm = LLM(model=str(tp_models["kv1-untied"]), dtype="float32", max_model_len=512, tensor_parallel_size=2,
              kv_cache_memory=0.05)
    worker = llm.engine_core.executor.workers[0]
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        # Rank 0's (this process's) timeout, short only from here: the first step under the
        # default one (on a busy machine the worker can take seconds to reach it). The model
        # group's collectives took their deadline when the group was made, so it is shortened
        # too (torch's own setter, private), or the test waits out the whole default (~2 min).
        monkeypatch.setattr(parallel_state, "MODEL_TIMEOUT", timedelta(seconds=3))
        distributed_c10d._set_pg_timeout(timedelta(seconds=3))
        os.kill(worker.pid, signal.SIGSTOP)
        with pytest.raises(TensorParallelError, match="out of step .*[Tt]imed out"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        with pytest.raises(TensorParallelError):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.shutdown()
    assert not worker.is_alive()


# ---- without processes ------------------------------------------------------------------------


def _dense(module: torch.nn.Module, in_features: int) -> torch.Tensor:
    """The [out, in] weight a (quantized) linear applies, read back through its own kernel."""
    return module(torch.eye(in_features)).t()


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_shards_are_slices_of_the_whole_models_quantized_weights(tp_models, quantization):
    """Same groups, same scales at every size: the row-parallel layers (where INT4 groups
    and INT8 row scales meet the split) and the vocab-parallel LM head, rank by rank."""
    path = tp_models["kv1-untied"]
    args = ModelArgs.from_hf_config(load_hf_config(path))
    whole = load_model(path, torch.float32, torch.device("cpu"), 64, quantization)
    shards = []
    for rank in range(2):
        model = load_model(path, torch.float32, torch.device("cpu"), 64)
        # No collective runs while sharding, so no process group is needed here.
        layout = ShardLayout.for_rank(args, rank, 2, quantization)
        shards.append(shard_model(model, layout, quantization, torch.device("cpu"), None))
    row_parallel = [("self_attn.o_proj", args.num_attention_heads * args.head_dim), ("mlp.down_proj", args.intermediate_size)]
    for i, layer in enumerate(whole.model.layers):
        for name, k in row_parallel:
            parts = [_dense(s.model.layers[i].get_submodule(name).local, k // 2) for s in shards]
            assert torch.equal(torch.cat(parts, dim=1), _dense(layer.get_submodule(name), k)), f"layer {i} {name}"
    heads = [_dense(s.lm_head.local, args.hidden_size) for s in shards]
    assert torch.equal(torch.cat(heads), _dense(whole.lm_head, args.hidden_size))


def test_smollm2_refuses_two_ranks_and_names_the_sizes_that_work(default_model_path):
    args = ModelArgs.from_hf_config(load_hf_config(default_model_path))  # 9 heads, 3 KV heads, 1536 MLP
    with pytest.raises(ValueError, match=r"do not divide the model's 9 attention heads \(sizes that can: 1, 3\)"):
        check_split(args, 2, None)
    check_split(args, 3, "int4")  # 192 and 512 input features per rank: whole groups of 64 and 128


def _args(**overrides) -> ModelArgs:
    fields = dict(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
        max_position_embeddings=64, tie_word_embeddings=True,
    )
    return ModelArgs(**(fields | overrides))


@pytest.mark.parametrize(
    ("args", "world_size", "quantization", "message"),
    [
        (_args(num_key_value_heads=3, num_attention_heads=6, head_dim=8), 2, None, "neither divide the model's 3 KV heads"),
        (_args(intermediate_size=130), 4, None, "do not divide the model's 130 MLP features"),
        (_args(), 2, "int4", "o_proj's INT4 groups of 64 along its 64 input features"),
        (_args(), 2, "w8a8", "quantization 'w8a8' cannot be split"),
    ],
    ids=["kv-heads", "mlp", "int4-groups", "w8a8"],
)
def test_unsupported_splits_are_refused(args, world_size, quantization, message):
    with pytest.raises(ValueError, match=message):
        check_split(args, world_size, quantization)


def test_fewer_kv_heads_than_ranks_replicates_each_kv_head_on_its_query_heads_ranks():
    args = _args(num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
    layouts = [ShardLayout.for_rank(args, r, 4, None) for r in range(4)]
    # (query heads, KV heads, first KV head) per rank: ranks 0-1 share KV head 0, ranks 2-3 KV head 1.
    got = [(lay.num_heads, lay.num_kv_heads, lay.kv_head_start) for lay in layouts]
    assert got == [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]


@pytest.mark.parametrize("with_copies", [False, True], ids=["no-copies", "copies"])
def test_step_message_round_trip(with_copies):
    """Every field of a step arrives as sent: the tensors with their dtypes, the greedy flag
    (`argmax_only`, set here: the default would pass unsent)."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([3, 17, 18, 40], dtype=torch.int64),
        block_tables=torch.tensor([[0, 0, 0], [1, 2, 5]], dtype=torch.int32),
        seq_lens=torch.tensor([4, 35], dtype=torch.int32),
        query_start_loc=torch.tensor([0, 1, 4], dtype=torch.int32),
        logits_indices=torch.tensor([0, 3], dtype=torch.int64),
        argmax_only=True,
    )
    copies = torch.tensor([[2, 7], [4, 9]]) if with_copies else None
    step = StepInputs(torch.tensor([11, 12, 13, 14]), torch.tensor([3, 32, 33, 34]), meta, copies)
    header = encode_header(MessageKind.STEP, step)
    payload = encode_payload(step)
    assert payload.dtype == torch.int64 and payload.numel() == payload_len(header)
    back = decode(header, payload)
    assert torch.equal(back.input_ids, step.input_ids) and torch.equal(back.positions, step.positions)
    for field in dataclasses.fields(AttentionMetadata):
        sent, got = getattr(meta, field.name), getattr(back.meta, field.name)
        if isinstance(sent, torch.Tensor):
            assert got.dtype == sent.dtype and torch.equal(got, sent), field.name
        else:
            assert got == sent, field.name
    assert (back.blocks_to_copy is None) if copies is None else torch.equal(back.blocks_to_copy, copies)
