"""A GGUF file's metadata as a Hugging Face folder: config.json, the tokenizer (with the chat
template the file carries), generation_config.json, and `gguf_source.json` naming the file.

Everything but the weights is read from the file's metadata by transformers' GGUF support
(`AutoConfig` / `AutoTokenizer` with `gguf_file=`), once, into the cache
(`~/.cache/pagoda/gguf/<key>/<name>`, the key from the file's path, size and mtime), so every
other part of Pagoda (tokenizer, EOS ids, KV sizing, /tokenizer_info) reads it as it reads any
folder, and a second start skips the ~10 s tokenizer conversion. The weights stay in the GGUF
file: the loader reads them from there (engine/gguf/loader.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np

from engine.gguf import SOURCE_FILE
from engine.gguf.reader import GGUFFile
from engine.gguf.tensors import architecture
from engine.gguf.tokenizer import field, fix_tokenizer
from engine.model_cache import cache_root, write_folder

_FORMAT = 1  # bump when what the folder holds changes: old folders are rebuilt


def model_folder(gguf: Path, name: str | None = None) -> Path:
    """The metadata folder of `gguf` (built on first use); its name, `name` or the file's stem,
    is the model name the server reports."""
    gguf = gguf.expanduser().resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}\0{_FORMAT}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / key / (name or gguf.stem)
    if not (target / SOURCE_FILE).is_file():
        write_folder(target, lambda out: _write(gguf, out), f"reading {gguf.name}'s metadata")
    return target


def _write(gguf: Path, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        reader = GGUFFile(str(gguf))
    except (ValueError, OSError) as e:  # not a GGUF file, or a truncated one
        raise ValueError(f"cannot read GGUF file {gguf}: {e}") from None
    arch_name = str(field(reader, "general.architecture"))
    architecture(arch_name)  # refuse an architecture we cannot map before the slow part
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # What transformers' GGUF config mapping leaves out: Qwen3's head_dim is independent of
    # hidden_size / heads, and the class name the start-up log reports.
    key_length = field(reader, f"{arch_name}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type)]
    scaling = _llama3_rope_scaling(reader, config)
    if scaling is not None:
        config.rope_parameters = {**(config.rope_parameters or {}), **scaling}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # The special tokens as the file names them (transformers' conversion can mislabel
    # them, e.g. SmolLM2's eos as <|im_start|>).
    ids = {role: field(reader, f"tokenizer.ggml.{role}_token_id") for role in ("bos", "eos", "padding", "eot", "eom")}
    for role, attr in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        if ids[role] is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(ids[role])))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = ids["bos"], ids["eos"], ids["padding"]
    # End of generation, as llama.cpp takes it: eos, and the end-of-turn tokens the file names.
    stops = list(dict.fromkeys(int(ids[r]) for r in ("eos", "eot", "eom") if ids[r] is not None))
    fix_tokenizer(tokenizer, reader, None if ids["bos"] is None else int(ids["bos"]))
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # Reload tokenizer.json as it is: a model-specific class (GemmaTokenizer) would rebuild
    # the tokenizer from the vocabulary instead, and differently.
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = "TokenizersBackend"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    GenerationConfig(
        bos_token_id=ids["bos"], eos_token_id=stops[0] if len(stops) == 1 else stops or None,
        pad_token_id=ids["padding"],
    ).save_pretrained(out)
    (out / SOURCE_FILE).write_text(json.dumps({"file": str(gguf), "architecture": arch_name}, indent=2) + "\n")


_LLAMA3_FACTORS = (8.0, 32.0, 16.0, 4.0, 2.0)  # Llama 3.1 / 3.2 use 8 and 32


def _llama3_rope_scaling(reader: GGUFFile, config) -> dict | None:
    """Llama 3.1+ files carry llama.cpp's per-frequency RoPE divisors (`rope_freqs.weight`)
    instead of the llama3 `rope_scaling` of their config: the llama3 parameters (low 1, high 4,
    8192 original positions, the factor searched) whose divisors equal the file's. None
    without such a tensor; a ValueError when no parameters match."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return None
    divisors = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    theta = float((config.rope_parameters or {}).get("rope_theta", 10000.0))
    dim = 2 * divisors.size
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    low, high, original = 1.0, 4.0, 8192
    smooth = np.clip((original / wavelen - low) / (high - low), 0.0, 1.0)  # as convert_hf_to_gguf.py
    for factor in _LLAMA3_FACTORS:
        if np.allclose(1.0 / ((1 - smooth) / factor + smooth), divisors, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ValueError("rope_freqs.weight: RoPE divisors that are not Llama 3's scaling are not supported")
