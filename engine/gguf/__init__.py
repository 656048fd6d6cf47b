"""GGUF files served directly: `--model path/to/model.gguf`, `LLM(model="....gguf")`.

    folder    the file's metadata (config, tokenizer, chat template) as a Hugging Face
              folder in the cache, written once; `resolve_model_path` hands it to the engine
    tensors   GGUF tensor names and layouts -> Hugging Face ones (llama.cpp's q/k row
              permutation undone, Gemma's 1 + w norms)
    blocks    Q4_0 / Q4_1 / Q8_0 blocks -> Pagoda's INT4 / INT8 integers; other types -> float
    loader    the model built from the folder's config and the file's tensors (engine/loader.py
              routes folders with a `gguf_source.json` here)

This module itself imports nothing heavy: the loader asks every folder `gguf_source`.
"""

from __future__ import annotations

import json
from pathlib import Path

SOURCE_FILE = "gguf_source.json"
"""In a metadata folder: {"file": the GGUF file's absolute path, ...}."""


def is_gguf_file(path: Path) -> bool:
    return path.suffix.lower() == ".gguf" and path.is_file()


def gguf_source(folder: Path) -> Path | None:
    """The GGUF file a metadata folder stands for; None for any other folder."""
    marker = Path(folder) / SOURCE_FILE
    if not marker.is_file():
        return None
    return Path(json.loads(marker.read_text())["file"])
