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


def make_lora_adapter(base_path: Path, out: Path, seed: int, rank: int = 4, alpha: int = 8, rslora: bool = False,
                      targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj")) -> Path:
    """A random PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors, saved by
    peft) of the model at `base_path`; A and B both random, large enough to change the tokens."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, use_rslora=rslora, target_modules=list(targets),
                        init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.5)
    peft_model.save_pretrained(str(out))
    return Path(out)


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


THINKING_SCRIPT = {
    "\n": "<think>", "<think>": " ok", " ok": " so", " so": " well", " well": "</think>",
    "</think>": " The", " The": " answer", " answer": "<eos>", "\n\n": " The",
}
"""What the thinking model says (token -> next token): Qwen3's generation prompt ends with
"\n", so it thinks " ok so well" and answers " The answer"; a prompt that closed the
thinking (`enable_thinking: false` ends it with "\n\n") gets the answer alone."""


QWEN3_CHAT_TEMPLATE = Path(__file__).resolve().parent / "data" / "qwen3_chat_template.jinja"
"""Qwen3's own chat template (as llama.cpp's models/templates/Qwen-Qwen3-0.6B.jinja holds it)."""


def make_thinking_model_folder(path: Path, tokenizer_dir: Path, script: dict[str, str]) -> Path:
    """A tiny Qwen3 that thinks on cue: Qwen3's chat template, `<think>` and `</think>` added
    to the SmolLM2 tokenizer in `tokenizer_dir` (as Qwen3 has them: added, not special), and
    weights that make it a bigram model following `script` (token text -> next token text,
    "<eos>" for `<|im_end|>`), e.g. the generation prompt's last token -> `<think>`.

    Attention and MLP outputs are zero, so the last hidden state is the current token's
    embedding: script token i embeds as the unit vector e_i, and the LM head maps e_i to its
    successor with a margin no sampling temperature overturns. Any other token predicts
    nothing in particular (all logits 0), which a grammar's mask then decides."""
    import shutil

    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tokenizer_dir) / name, path / name)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE.read_text()
    tokenizer.save_pretrained(path)

    def token_id(text: str) -> int:
        if text == "<eos>":
            return tokenizer.convert_tokens_to_ids("<|im_end|>")
        [token] = tokenizer.encode(text, add_special_tokens=False)
        return token

    hidden = 64
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen3Config(
        vocab_size=len(tokenizer) + 6, hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    sources = list(script)
    assert len(sources) <= hidden
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for i, source in enumerate(sources):
            model.model.embed_tokens.weight[token_id(source), i] = 1.0
            model.lm_head.weight[token_id(script[source]), i] = 10.0
    model.save_pretrained(path)
    return path
