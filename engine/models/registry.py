"""The supported architectures: Hugging Face `model_type` -> the model class that runs it.

Every class takes `(ModelArgs, max_positions)` and names its parameters as the
checkpoint does, so the loader (engine/loader.py) builds and fills any of them the same way.
"""

from __future__ import annotations

from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.llama import LlamaForCausalLM
from engine.models.mistral import MistralForCausalLM
from engine.models.qwen2 import Qwen2ForCausalLM
from engine.models.qwen3 import Qwen3ForCausalLM

MODELS: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma3_text": Gemma3ForCausalLM,
}

# model_types people will try whose text model is supported under another name.
_HINTS = {
    "gemma3": "Gemma 3 with its vision tower; the text-only models (model_type 'gemma3_text', e.g. "
    "gemma-3-1b, gemma-3-270m) are supported",
}


def check_model_type(model_type: str) -> None:
    """A one-line ValueError for an architecture Pagoda does not run."""
    if model_type not in MODELS:
        hint = f": {_HINTS[model_type]}" if model_type in _HINTS else ""
        raise ValueError(
            f"model_type {model_type!r} is not supported{hint} (supported: {', '.join(sorted(MODELS))})"
        )


def model_class(model_type: str) -> type[LlamaForCausalLM]:
    check_model_type(model_type)
    return MODELS[model_type]
