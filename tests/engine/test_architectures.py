"""Qwen2, Qwen3, Mistral and Gemma 3 (engine/models/; and Llama) against transformers, end to end.

Tiny random-weight folders made by transformers (tests/tiny_models.py): the engine's
greedy tokens on the torch backend equal Hugging Face `generate` token for token in
float32, with a KV cache small enough to force preemption and a token budget that splits
prompts into chunks; the sliding windows are shown to matter (the same model without
them generates other tokens). Tensor parallelism (two ranks give one rank's tokens) is in
test_tensor_parallel.py, the Triton variant in tests/kernels/test_engine_triton.py.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHITECTURES, WINDOW, check_engine_equals_hf, hf_config, hf_greedy, make_model_folder, prompts

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.loader import load_hf_config, load_model
from engine.models.args import ModelArgs
from kernels.ops import get_ops

MAX_NEW_TOKENS = 10
BLOCK_SIZE = 4  # as check_engine_equals_hf's engines
PROMPTS = prompts((1, 23, 61))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    return {arch: make_model_folder(root / arch, arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def hf_tokens(folders):
    return {arch: hf_greedy(path, PROMPTS, MAX_NEW_TOKENS) for arch, path in folders.items()}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_equals_hf_with_chunked_prefill_and_preemption(folders, hf_tokens, arch, record_schedules):
    # 20 blocks of 4 tokens hold the longest request (71 tokens) but not all three: preemption.
    # A 16-token budget splits the 23- and 61-token prompts into chunks mixed with decodes.
    check_engine_equals_hf(
        folders[arch], PROMPTS, hf_tokens[arch], record_schedules, kernel_backend="torch", num_gpu_blocks_override=20,
        max_model_len=128,
    )


def _logits(model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """Our logits at every position of one sequence fed in `chunks` over a paged cache of
    blocks 5, 12, 19, 26, 33, 0, 7, ... (strided and wrapping, so a table mix-up shows)."""
    spec = KVCacheSpec.from_model(model.args, torch.float32, BLOCK_SIZE)
    kv_caches = allocate_kv_cache(spec, 40, torch.device("cpu"))
    table = [(5 + 7 * i) % 40 for i in range(-(-len(ids) // BLOCK_SIZE))]
    ops, out, done = get_ops("torch", torch.device("cpu")), [], 0
    for n in chunks:
        pos = torch.arange(done, done + n)
        done += n
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in pos.tolist()]),
            block_tables=torch.tensor([table], dtype=torch.int32),
            seq_lens=torch.tensor([done], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            logits_indices=torch.arange(n),
        )
        out.append(model.compute_logits(model(ids[pos], pos, kv_caches, meta, ops)))
    return torch.cat(out)


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("qwen2", {}), ("qwen3", {}), ("mistral", {}), ("gemma3", {}), ("gemma3", {"tie_word_embeddings": True}),
     ("qwen3", {"attention_bias": True})],
    ids=["qwen2", "qwen3", "mistral", "gemma3", "gemma3-tied", "qwen3-bias"],
)
def test_logits_match_hf_over_chunks_and_decodes(tmp_path, arch, overrides):
    from transformers import AutoModelForCausalLM

    path = make_model_folder(tmp_path, arch, **overrides)
    ids = torch.tensor(prompts((40,), seed=3)[0])
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)(ids[None]).logits[0]
    model = load_model(path, torch.float32, torch.device("cpu"), 128)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is model.args.tie_word_embeddings
    torch.testing.assert_close(_logits(model, ids, [13, 24, 1, 1, 1]), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "gemma3"])
def test_the_sliding_window_changes_the_tokens(folders, hf_tokens, arch):
    """The window is shorter than the longer prompts: without it, other tokens (so the test
    above checks the window, not only the rest of the model)."""
    unwindowed = hf_greedy(folders[arch], PROMPTS, MAX_NEW_TOKENS, sliding_window=10_000)
    for i in (1, 2):  # the prompts longer than the window
        assert unwindowed[i] != hf_tokens[arch][i], f"prompt {i}"


def test_config_reading():
    """Per-layer windows, RoPE bases and scales as each architecture's config says."""
    qwen2 = ModelArgs.from_hf_config(hf_config("qwen2"))
    assert qwen2.sliding_windows == (None, WINDOW) and not qwen2.qkv_bias  # the model class adds the bias
    assert ModelArgs.from_hf_config(hf_config("qwen2", use_sliding_window=False)).sliding_windows == ()
    qwen3 = ModelArgs.from_hf_config(hf_config("qwen3"))
    assert (qwen3.head_dim, qwen3.hidden_size, qwen3.attention_scale) == (128, 64, 128**-0.5)
    assert ModelArgs.from_hf_config(hf_config("mistral")).sliding_windows == (WINDOW, WINDOW)
    assert ModelArgs.from_hf_config(hf_config("mistral", sliding_window=None)).sliding_windows == ()
    gemma = ModelArgs.from_hf_config(hf_config("gemma3"))
    assert gemma.sliding_windows == (WINDOW, None)
    assert (gemma.rope_theta, gemma.local_rope_theta) == (1_000_000.0, 10_000.0)
    assert gemma.attention_scale == 64**-0.5 and gemma.hidden_act == "gelu_pytorch_tanh"
    assert gemma.final_logit_softcapping == 30.0
    # gemma-3-4b's layout: global layers' RoPE scaled, local ones not.
    linear = {"rope_type": "linear", "factor": 8.0}
    scaled = ModelArgs.from_hf_config(hf_config("gemma3", rope_parameters=None, rope_scaling=linear))
    assert scaled.rope_scaling == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}
    assert scaled.local_rope_theta == 10_000.0
    # transformers' default Gemma 3 layout: five local layers, then a global one.
    default = ModelArgs.from_hf_config(hf_config("gemma3", num_hidden_layers=6, layer_types=None))
    assert default.sliding_windows == (WINDOW,) * 5 + (None,)


def _one_line_error(path) -> str:
    with pytest.raises(ValueError) as info:
        load_hf_config(path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unsupported_architectures_are_one_line_errors(tmp_path):
    from transformers import GPT2Config, Gemma3Config, LlamaConfig

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    message = _one_line_error(tmp_path / "gpt2")
    assert "model_type 'gpt2' is not supported" in message and "gemma3_text" in message and "qwen3" in message
    (tmp_path / "unknown").mkdir()  # a model_type transformers does not know either
    (tmp_path / "unknown" / "config.json").write_text('{"model_type": "mamba9"}')
    assert _one_line_error(tmp_path / "unknown").startswith("model_type 'mamba9' is not supported (supported: ")
    Gemma3Config().save_pretrained(tmp_path / "gemma3")
    assert "text-only models (model_type 'gemma3_text'" in _one_line_error(tmp_path / "gemma3")
    LlamaConfig(hidden_act="relu").save_pretrained(tmp_path / "relu")
    with pytest.raises(ValueError, match="MLP activation 'relu' is not supported"):
        ModelArgs.from_hf_config(load_hf_config(tmp_path / "relu"))
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0 is not supported"):
        ModelArgs.from_hf_config(hf_config("gemma3", attn_logit_softcapping=50.0))


def test_impossible_splits_stay_clear():
    """Gemma 3's 2 heads and 1 KV head: 4 ranks are refused, naming the sizes that work."""
    from engine.distributed.sharding import check_split

    args = ModelArgs.from_hf_config(hf_config("gemma3"))
    with pytest.raises(ValueError, match=r"do not divide the model's 2 attention heads \(sizes that can: 1, 2\)"):
        check_split(args, 4, None)


def test_tokenizer_loads_as_auto_tokenizer_gives_it(default_model_files, tmp_path):
    # engine/loader.py's load_tokenizer loads the class tokenizer_config.json names without
    # importing AutoTokenizer (seconds of every server start); a folder without that field
    # goes through AutoTokenizer. Either way: AutoTokenizer's class, tokens and chat text.
    import json
    import shutil

    from transformers import AutoTokenizer

    from engine.loader import load_tokenizer

    bare = tmp_path / "no-class"
    shutil.copytree(default_model_files, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((bare / "tokenizer_config.json").read_text())
    assert config.pop("tokenizer_class")
    (bare / "tokenizer_config.json").write_text(json.dumps(config))
    chat = [{"role": "user", "content": "Hello there, <b>world</b>!"}]
    for folder in (default_model_files, bare):
        want, got = AutoTokenizer.from_pretrained(str(folder)), load_tokenizer(folder)
        assert type(got) is type(want)
        assert got.encode("Hello there, <b>world</b>! ünïcode 12345") == want.encode("Hello there, <b>world</b>! ünïcode 12345")
        assert got.apply_chat_template(chat, tokenize=False) == want.apply_chat_template(chat, tokenize=False)
        assert (got.eos_token_id, got.bos_token_id) == (want.eos_token_id, want.bos_token_id)
