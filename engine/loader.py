"""Build a model from a Hugging Face folder: config via transformers, the model class its
`model_type` names (engine/models/registry.py), weights from safetensors.

Quantized checkpoints (config.json `quantization_config`: AutoAWQ, AutoGPTQ, Pagoda INT8 /
W8A8; layouts in engine/quantization/checkpoint.py) load as they are: every module whose
`qweight` is in the checkpoint is built from its integers, scales and zeros, its
unfused shards (q/k/v, gate/up) concatenated along N into our fused layer, and becomes
the runtime module (`Int4Linear` / `Int8Linear` / `W8A8Linear`; GPTQ act-order through
an input permutation, see weights.py). Its float weight is never allocated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig

from engine.dummy_model import init_dummy_weights
from engine.models.llama import STACKED_PARAMS, Linear, LlamaForCausalLM, ModelArgs
from engine.models.registry import check_model_type, model_class
from engine.quantization.checkpoint import CheckpointQuantization, concat_shards, parse_quantization_config, unpack
from engine.quantization.weights import QuantizedLinear, runtime_module


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim")
"""config.json sizes that must be positive integers where present (0 heads divide by zero deep in a load)."""


def load_hf_config(path: Path):
    """The folder's transformers config; a one-line ValueError for an architecture
    engine/models/registry.py does not list (checked on config.json first, so one that
    transformers does not know either gets the same line, not transformers' advice), and
    for a config.json that is not JSON, has a size that is not a positive integer, or that
    transformers refuses: each names the file."""
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        raw = read_json_object(config_file)
        model_type = raw.get("model_type")
        if model_type is not None:
            check_model_type(model_type)
        for key in _POSITIVE_SIZES:
            value = raw.get(key)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
                raise ValueError(f"{config_file}: {key} must be a positive integer, got {value!r}")
    try:
        cfg = AutoConfig.from_pretrained(str(path))
    except (ValueError, TypeError, KeyError, ArithmeticError) as e:
        raise ValueError(f"{config_file}: not a valid model configuration ({type(e).__name__}: {e})") from e
    check_model_type(cfg.model_type)
    return cfg


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object; a ValueError naming the file otherwise."""
    try:
        data = json.loads(Path(file).read_text())
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def load_tokenizer(path: Path):
    """The folder's tokenizer, as `AutoTokenizer.from_pretrained` gives it.

    Where tokenizer_config.json names a tokenizers-backed class (`TokenizersBackend`,
    `Qwen2Tokenizer`, ...) and tokenizer.json is there, that class is loaded directly: it
    is the class AutoTokenizer resolves from the same field, and importing AutoTokenizer's
    module costs ~2 s per process (transformers builds the docstrings of its auto classes
    at import), which every server start and worker paid. Anything else (no such field,
    a slow or remote-code tokenizer) goes through AutoTokenizer itself."""
    import transformers

    path = Path(path)
    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        name = None
    backend = getattr(transformers, "TokenizersBackend", None)
    cls = None
    if isinstance(name, str) and name.isidentifier() and backend is not None and (path / "tokenizer.json").is_file():
        try:
            cls = getattr(transformers, name, None)
        except ImportError:  # a tokenizer whose optional dependency is missing
            cls = None
    try:
        if isinstance(cls, type) and issubclass(cls, backend):
            return cls.from_pretrained(str(path))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust tokenizers raise plain Exception for a malformed file
        source = path / "tokenizer.json" if (path / "tokenizer.json").is_file() else path
        raise ValueError(f"{source}: cannot load the tokenizer ({type(e).__name__}: {e})") from e


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    quantization: str | None = None,
    load_format: str = "auto",
    lm_head_quantization: str = "auto",
) -> LlamaForCausalLM:
    from engine.gguf import gguf_source

    if load_format != "dummy" and (gguf := gguf_source(path)) is not None:  # a GGUF file's metadata folder
        from engine.gguf.loader import load_gguf_model

        return load_gguf_model(
            load_hf_config(path), gguf, dtype, device, max_positions, quantization, load_format, copy_weight,
            lm_head_quantization,
        )
    args = ModelArgs.from_hf_config(load_hf_config(path))
    files = [] if load_format == "dummy" else sorted(path.glob("*.safetensors"))
    if load_format != "dummy" and not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    spec = checkpoint_quantization(path)
    if spec is not None and quantization is not None:
        raise ValueError(f"{path} is already quantized ({spec.layout}); load it without --quantization")
    prefixes = _quantized_modules(files) if spec is not None else set()
    qlinears = read_quantized_linears(files, prefixes, spec) if prefixes else {}

    with torch.device("meta"):
        model = model_class(args.model_type)(args, max_positions)
    for name, ql in qlinears.items():
        linear = model.get_submodule(name) if _has_module(model, name) else None
        if not isinstance(linear, Linear):
            raise ValueError(f"the checkpoint quantizes {name!r}, which is not a linear layer of this model")
        if ql.shape != tuple(linear.weight.shape):
            raise ValueError(f"{name}: quantized weight is {list(ql.shape)}, the model needs {list(linear.weight.shape)}")
        linear.weight = None  # replaced below: the float weight is never materialised
        linear.bias = None  # a quantized module's bias comes with its other tensors
    model.to_empty(device=device)
    model.to(dtype)
    if args.tie_word_embeddings and model.lm_head.weight is not None:
        model.lm_head.weight = model.model.embed_tokens.weight
    # Non-persistent buffers (RoPE tables) were built on meta: rebuild them for real.
    model.build_rope(device)

    params = dict(model.named_parameters())
    pending = {name: p.numel() for name, p in params.items()}  # elements still to load
    if load_format == "dummy":
        init_dummy_weights(model)  # no checkpoint: every weight is drawn, none is pending
        pending.clear()
    with torch.no_grad():
        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    for name in f.keys():
                        if name.endswith("rotary_emb.inv_freq"):
                            continue
                        if name.rpartition(".")[0] in prefixes:
                            continue
                        if name == "lm_head.weight" and args.tie_word_embeddings:
                            continue
                        copy_weight(model, params, pending, name, f.get_tensor(name), "checkpoint")
            except SafetensorError as e:  # truncated or overwritten: one line naming the file
                raise ValueError(f"{file}: not a valid safetensors file ({e})") from e
    missing = sorted(name for name, left in pending.items() if left)
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights for {missing[:5]}")
    for name, ql in qlinears.items():
        parent, _, leaf = name.rpartition(".")
        try:
            module = runtime_module(ql, dtype, device, w8a8=spec.layout == "w8a8" and name != "lm_head")
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
        setattr(model.get_submodule(parent), leaf, module)
    if quantization is not None:
        from engine.quantization.rtn import convert_model

        convert_model(model, quantization, lm_head_quantization)
    return model.eval().requires_grad_(False)


def checkpoint_quantization(path: Path) -> CheckpointQuantization | None:
    """The folder's `quantization_config` (None: a float checkpoint)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    cfg = json.loads(config_file.read_text()).get("quantization_config")
    return None if not cfg else parse_quantization_config(cfg)


def _quantized_modules(files: list[Path]) -> set[str]:
    """Checkpoint module names that hold a `qweight`."""
    names: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(key[: -len(".qweight")] for key in f.keys() if key.endswith(".qweight"))
    return names


def read_quantized_linears(files: list[Path], prefixes: set[str], spec: CheckpointQuantization) -> dict[str, QuantizedLinear]:
    """{our module name: QuantizedLinear} of the checkpoint modules `prefixes`, the shards of
    a fused layer (`...q_proj`, `...k_proj`, `...v_proj` -> `...qkv_proj`) stacked along N."""
    shards: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                prefix, _, attr = key.rpartition(".")
                if prefix in prefixes:
                    name, index = _fused_name(prefix)
                    shards.setdefault(name, {}).setdefault(index, {})[attr] = f.get_tensor(key)
    out = {}
    for name, parts in shards.items():
        leaf = name.rpartition(".")[2]
        expected = 1 + max((i for fused, i in STACKED_PARAMS.values() if fused == leaf), default=0)
        if sorted(parts) != list(range(expected)):
            raise ValueError(f"{name}: the checkpoint quantizes only some of its {expected} parts")
        try:
            out[name] = concat_shards([unpack(parts[i], spec) for i in range(expected)])
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    return out


def _fused_name(prefix: str) -> tuple[str, int]:
    """Checkpoint module `...q_proj` -> (`...qkv_proj`, 0); any other -> (itself, 0)."""
    parent, _, leaf = prefix.rpartition(".")
    if leaf in STACKED_PARAMS:
        fused, index = STACKED_PARAMS[leaf]
        return f"{parent}.{fused}", index
    return prefix, 0


def _has_module(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def copy_weight(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], pending: dict[str, int], name: str,
                tensor: torch.Tensor, source: str) -> None:
    """Copy the `source` ("checkpoint", "GGUF") tensor `name` into its parameter (or its
    shard of a fused one), checking the shape, and count it off `pending` (elements still
    to load per parameter)."""
    target_name, target = _target(model, params, name)
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{name}: {source} shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
    target.copy_(tensor)
    pending[target_name] -= tensor.numel()


def _target(model: LlamaForCausalLM, params: dict[str, torch.nn.Parameter], name: str) -> tuple[str, torch.Tensor]:
    """The parameter (or the shard of a fused parameter) a checkpoint tensor loads into."""
    if name in params:
        return name, params[name].data
    module_name, _, attr = name.rpartition(".")
    parent, _, leaf = module_name.rpartition(".")
    if leaf in STACKED_PARAMS:
        fused, index = STACKED_PARAMS[leaf]
        fused_name = f"{parent}.{fused}.{attr}"
        if fused_name in params:
            layer = model.get_submodule(f"{parent}.{fused}")
            return fused_name, layer.shard(params[fused_name].data, index)
    raise ValueError(f"unexpected tensor {name!r} in the checkpoint")
