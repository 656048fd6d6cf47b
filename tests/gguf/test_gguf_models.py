"""GGUF files served directly, on tiny random models written as llama.cpp writes them
(gguf_writer.py), against transformers loading the same file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_writer import tiny_config, write_gguf

from engine import LLM, SamplingParams
from engine.default_model import resolve_model_path
from engine.gguf import SOURCE_FILE, gguf_source
from engine.loader import load_model
from engine.quantization.linears import Int4Linear, Int8Linear

PROMPTS = ["The capital of France is", "def add(a, b):", "1, 2, 3, 4,", "Hello"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """make(arch, qtype, ...) -> (GGUF path, the transformers model it was written from)."""
    root = tmp_path_factory.mktemp("tiny-gguf")
    made: dict[tuple, tuple[Path, torch.nn.Module]] = {}

    def make(arch: str, qtype: T, **kwargs) -> tuple[Path, torch.nn.Module]:
        key = (arch, qtype.name, repr(sorted(kwargs)))
        if key not in made:
            from transformers import AutoModelForCausalLM

            config = tiny_config(arch)
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config).eval()
            path = root / f"{arch}-{qtype.name}-{len(made)}.gguf"
            made[key] = write_gguf(path, arch, config, model.state_dict(), qtype, **kwargs), model
        return made[key]

    return make


@pytest.fixture
def tiny_files(tiny_models):
    return lambda arch, qtype, **kwargs: tiny_models(arch, qtype, **kwargs)[0]


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory):
    """The metadata folders in a cache of this module's: each tiny file's written once."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield


def prompt_ids(tokenizer_folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time."""
    out = []
    for ids in prompts:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def pagoda_greedy(model: Path, prompts: list[list[int]], max_tokens: int, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(model), max_model_len=256, dtype="float32", **kwargs)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


def folder_by_hand(gguf: Path, config, tokenizer_folder: Path, root: Path) -> Path:
    """A metadata folder for a tiny GGUF made by hand (the config it was written from, SmolLM2's
    tokenizer without a chat template): for a Gemma 3 file, whose SmolLM2 tokenizer
    transformers cannot convert as a gemma3 one, and for tests that need no metadata (the
    conversion takes seconds)."""
    folder = root / f"by-hand-{gguf.stem}"
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    (folder / SOURCE_FILE).write_text(json.dumps({"file": str(gguf)}))
    return folder


CHAT_TEMPLATE = "{{ messages[0]['content'] }}"
_ALL = os.environ.get("PAGODA_GGUF_ALL") == "1"
_OPT_IN = pytest.mark.skipif(not _ALL, reason="opt-in: PAGODA_GGUF_ALL=1 (make test-gguf-gemma)")


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2", "qwen3", "gemma3"])
def test_float_gguf_gives_the_original_models_greedy_tokens(tiny_models, default_model_files, tmp_path, arch):
    """Names, llama.cpp's q/k permutation, Gemma's 1 + w norms, Llama 3's RoPE divisors and the
    config from the file's metadata are undone exactly: greedy tokens equal those of the
    transformers model the file was written from, with chunked prefill and a KV budget small
    enough to preempt. The config comes from the metadata for llama (and, with
    PAGODA_GGUF_ALL=1, for llama3, qwen2 and qwen3: ~20 s each, transformers converting the
    tokenizer); otherwise from a folder by hand beside the file, as always for Gemma, whose
    SmolLM2 tokenizer transformers cannot convert. The weights are read from the GGUF either way."""
    # llama: the file test_the_metadata_folder_is_written_once_and_names_the_file reads too,
    # so the module's cache converts its metadata (~15 s) once for both.
    gguf, model = tiny_models(arch, T.F32, **({"chat_template": CHAT_TEMPLATE} if arch == "llama" else {}))
    ids = prompt_ids(default_model_files)
    from_metadata = arch == "llama" or (_ALL and arch != "gemma3")
    source = gguf if from_metadata else folder_by_hand(gguf, model.config, default_model_files, tmp_path)
    if arch == "llama3" and from_metadata:
        from transformers import AutoConfig

        rope = AutoConfig.from_pretrained(str(resolve_model_path(str(gguf)))).rope_parameters
        assert {k: rope[k] for k in model.config.rope_parameters} == model.config.rope_parameters
    got = pagoda_greedy(source, ids, 12, max_num_batched_tokens=16, num_gpu_blocks_override=12, block_size=4)
    assert got == hf_greedy(model, ids, 12)


# Each case costs ~25 s (transformers converts the tokenizer on every GGUF load), so they
# run with PAGODA_GGUF_ALL=1 (`make test-gguf-gemma` sets it), to keep the suite in CI's
# budget. Without it the block decoders are still checked value by value (test_blocks.py)
# and the bundled Q4_1 file dequantized gives the float folder's greedy tokens
# (test_bundled_gguf.py).


@pytest.mark.parametrize("qtype", [pytest.param(t, marks=_OPT_IN) for t in (T.Q4_0, T.Q4_1, T.Q8_0)], ids=lambda t: t.name)
def test_quantized_gguf_dequantized_gives_transformers_greedy_tokens(tiny_files, default_model_files, qtype):
    """`--load-format dequantize`: the weights transformers' own GGUF loader makes."""
    from transformers import AutoModelForCausalLM

    gguf = tiny_files("llama", qtype)
    reference = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    ids = prompt_ids(default_model_files)
    assert pagoda_greedy(gguf, ids, 12, load_format="dequantize") == hf_greedy(reference, ids, 12)


@pytest.mark.parametrize("qtype, module", [(T.Q4_0, Int4Linear), (T.Q4_1, Int4Linear), (T.Q8_0, Int8Linear)], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_gguf_keeps_integers_and_stays_close(tiny_models, default_model_files, tmp_path, qtype, module):
    """Kept quantized: every decoder linear is an integer module whose outputs stay close to
    the dequantized load of the same file."""
    gguf, model = tiny_models("llama", qtype)
    folder = folder_by_hand(gguf, model.config, default_model_files, tmp_path)
    kept = load_model(folder, torch.float32, CPU, 64)
    ref = load_model(folder, torch.float32, CPU, 64, load_format="dequantize")
    layer = kept.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, module) and isinstance(layer.mlp.down_proj, module)
    assert kept.lm_head.weight is kept.model.embed_tokens.weight  # tied: the Q8_0 values, in float
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        float_linear = ref.model.layers[1].get_submodule(name)
        x = torch.randn(5, float_linear.weight.shape[1])
        a, b = kept.model.layers[1].get_submodule(name)(x), float_linear(x)
        # bf16 activations (CPU int kernels); Q8_0 is also requantized per row.
        assert (a - b).abs().max() <= 0.02 * b.abs().max(), name


def test_the_metadata_folder_is_written_once_and_names_the_file(tiny_files):
    gguf = tiny_files("llama", T.F32, chat_template=CHAT_TEMPLATE)
    folder = resolve_model_path(str(gguf))
    assert gguf_source(folder) == gguf.resolve()
    assert folder.name == gguf.stem
    assert (folder / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    stamp = (folder / "config.json").stat().st_mtime_ns
    assert resolve_model_path(str(gguf)) == folder
    assert (folder / "config.json").stat().st_mtime_ns == stamp


def test_unsupported_architecture_is_one_clear_line(tmp_path):
    from gguf import GGUFWriter

    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"^GGUF architecture 'phi3' is not supported \(supported: gemma3, llama, qwen2, qwen3\)$"):
        resolve_model_path(str(path))


def test_unsupported_tensor_type_is_one_clear_line(tiny_models, default_model_files, tmp_path):
    import numpy as np

    gguf, model = tiny_models("llama", T.F32, extra_tensors={"blk.0.attn_norm.weight": np.zeros(64, np.float64)})
    folder = folder_by_hand(gguf, model.config, default_model_files, tmp_path)
    with pytest.raises(ValueError, match=r"^blk\.0\.attn_norm\.weight: GGUF tensor type F64 is not supported"):
        load_model(folder, torch.float32, CPU, 64)


def test_missing_gguf_file_is_one_clear_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path(str(tmp_path / "nope.gguf"))


def test_a_model_without_chat_template_gets_a_clear_chat_error(tiny_models, default_model_files, tmp_path):
    """A base model's file: /v1/chat/completions answers 400 with one line saying what to do,
    unless --chat-template gives a template."""
    from transformers import AutoTokenizer

    from server.errors import InvalidRequestError
    from server.protocol import ChatMessage
    from server.serving_chat import render_chat

    gguf, model = tiny_models("llama", T.Q4_1)
    tokenizer = AutoTokenizer.from_pretrained(str(folder_by_hand(gguf, model.config, default_model_files, tmp_path)))
    assert not tokenizer.chat_template
    messages = [ChatMessage(role="user", content="Hi")]
    with pytest.raises(InvalidRequestError, match=r"^this model has no chat template: start the server with "
                                                  r"--chat-template FILE, or use /v1/completions$") as e:
        render_chat(tokenizer, messages, True, False)
    assert e.value.param == "messages"
    ids = render_chat(tokenizer, messages, True, False, chat_template="User: {{ messages[0]['content'] }}")
    assert tokenizer.decode(ids) == "User: Hi"
