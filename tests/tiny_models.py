"""Tiny random-weight Hugging Face folders of every supported architecture, and their
greedy tokens from transformers' `generate` (the reference the engine must equal).

Each folder is made by transformers itself (its config class, random init, save_pretrained)
plus a word-level tokenizer ("w0".."w511"), so nothing is downloaded. 2 layers; head_dim 64
(Llama, Qwen2, Mistral), 128 (Qwen3, independent of hidden_size) and 256 (Gemma 3); Mistral and
Gemma 3 have a sliding window shorter than the longer prompts, Qwen2 one sliding layer.
Weights are drawn at 10x transformers' default scale so attention is sharp and a wrong
mask, bias or norm changes the tokens; biases and norm weights, which transformers
initialises to constants, get noise so that they matter too.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB_SIZE = 512
WINDOW = 8  # Mistral's and Gemma 3's sliding window: shorter than the prompts below

_COMMON = dict(
    vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.2,
)

ARCHITECTURES = {
    # name: (config class name, config overrides)
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(  # head_dim = hidden_size / heads = 64 (Qwen2's config has no head_dim)
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,  # layer 1 slides, layer 0 does not
    )),
    "qwen3": ("Qwen3Config", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, tie_word_embeddings=True,  # 4 x 128 > hidden 64
    )),
    "mistral": ("MistralConfig", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False, sliding_window=WINDOW,
    )),
    "gemma3": ("Gemma3TextConfig", dict(
        num_attention_heads=2, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=64, sliding_window=WINDOW,
        # Tied at 10x scale the scaled embeddings make it repeat its input token: untied, 5x
        # (test_architectures.py checks the tied layout's logits).
        tie_word_embeddings=False, initializer_range=0.1,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        },
        final_logit_softcapping=30.0,
    )),
}


def hf_config(arch: str, **overrides):
    import transformers

    class_name, fields = ARCHITECTURES[arch]
    return getattr(transformers, class_name)(**(_COMMON | fields | overrides))


def make_model_folder(path: Path, arch: str, **overrides) -> Path:
    """A tiny random `arch` checkpoint with a word-level tokenizer, saved by transformers."""
    from transformers import AutoModelForCausalLM

    from engine.dummy_model import write_dummy_model_folder

    config = hf_config(arch, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # biases (zeros) and norm weights (ones; zeros for Gemma)
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    write_dummy_model_folder(path, config)  # config + tokenizer; the weights next
    model.save_pretrained(path)
    return Path(path)


def prompts(lengths=(1, 23, 61), seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(
    path: Path, prompt_ids: list[list[int]], max_new_tokens: int, ignore_eos: bool = True, **config_overrides
) -> list[list[int]]:
    """transformers' greedy tokens, one prompt at a time, in float32; with `ignore_eos` never
    stopping at eos (as the engine with ignore_eos). `config_overrides` change the config first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    for name, value in config_overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for ids in prompt_ids:
            gen = model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens, do_sample=False,
            )
            out.append(gen[0, len(ids):].tolist())
    return out


def check_engine_equals_hf(path: Path, prompt_ids: list[list[int]], expected: list[list[int]], record_schedules,
                           **engine_args) -> None:
    """The engine's greedy tokens (ignore_eos) equal `expected` with a KV cache and token
    budget (`engine_args`) that must force preemption and chunked prefill; every block is
    free afterwards. `record_schedules` is the conftest fixture."""
    from engine import LLM, SamplingParams

    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=16, **engine_args)
    core = llm.engine_core
    steps = record_schedules(core)
    params = SamplingParams(temperature=0, max_tokens=len(expected[0]), ignore_eos=True)
    outs = llm.generate(prompt_ids, params)
    assert core.scheduler.num_preemptions > 0
    assert any(partial for _, partial in steps), "no prefill was split into chunks"
    for i, (out, exp) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == exp, f"prompt {i} ({len(prompt_ids[i])} tokens)"
    assert core.block_manager.num_free_blocks == core.num_blocks
