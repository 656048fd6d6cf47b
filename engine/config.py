"""One root config (`EngineConfig`) built from sections; every field documented once.

The CLI flags (`pagoda serve --block-size ...`) and the Python API
(`LLM(block_size=...)`) are the same names, mapped onto these sections by
`EngineConfig.from_engine_args`. Everything is validated at construction.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.quantization import LM_HEAD_QUANTIZATIONS
from engine.settings import json_object_setting
from engine.quantization import METHODS as QUANTIZATION_METHODS

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
DTYPES = ("auto", *_DTYPES)
"""`--dtype` values: auto, the canonical names and their aliases."""
KERNEL_BACKENDS = ("auto", "cpu", "torch", "triton")
"""`--kernel-backend` values."""
LOAD_FORMATS = ("auto", "dummy", "dequantize")
"""`--load-format` values."""


@dataclass(slots=True)
class ModelConfig:
    model: str | None = None
    """Hugging Face model folder (config.json, *.safetensors, tokenizer) or a .gguf file; none: the bundled SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Weights and activations dtype: auto (bfloat16 on CUDA and on CPUs that compute it natively, AVX512-BF16 or AMX; float32 on other CPUs), float32 (float, fp32), float16 (half, fp16), bfloat16 (bf16)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output) served; none: the model's max_position_embeddings (8192 for the bundled model)."""
    quantization: str | None = None
    """Load-time RTN quantization of the decoder linears: int8 / int4 weight-only (per-channel / group 128), or w8a8 (int8 weights and per-token int8 activations); none: float, or what the folder's quantization_config says."""
    lm_head_quantization: str = "auto"
    """The LM head under --quantization: int8 (weight-only, per channel), none (the compute dtype), or auto: int8 under int8 and w8a8; under int4 the compute dtype on CUDA (as AutoAWQ/AutoGPTQ keep it) and int8 on CPU (torch's int8 kernel reads it faster than the float GEMM)."""
    seed: int = 0
    """Seed of the global sampling generator (requests without their own seed)."""
    device: str = "auto"
    """auto (cuda if available, else cpu), cpu or cuda."""
    load_format: str = "auto"
    """auto: the folder's *.safetensors, or a GGUF file's tensors (Q4_0 / Q4_1 / Q8_0 kept quantized); dummy: random weights from config.json alone (benchmarks of a model's shape, as vLLM's --load-format dummy); dequantize: a GGUF file's tensors all dequantized to float at load."""
    enforce_eager: bool = False
    """Run every step eagerly: no CUDA graphs for decode steps (on CPU every step is eager anyway)."""
    max_cuda_graph_batch_size: int | None = None
    """Largest decode batch replayed from a CUDA graph (none: min(max_num_seqs, 256)); larger decode batches run eagerly."""

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.max_cuda_graph_batch_size is not None and self.max_cuda_graph_batch_size < 1:
            raise ValueError(f"max_cuda_graph_batch_size must be >= 1, got {self.max_cuda_graph_batch_size}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {QUANTIZATION_METHODS}, got {self.quantization!r}")
        if self.lm_head_quantization not in LM_HEAD_QUANTIZATIONS:
            raise ValueError(
                f"lm_head_quantization must be one of {LM_HEAD_QUANTIZATIONS}, got {self.lm_head_quantization!r}"
            )
        if self.lm_head_quantization == "int8" and self.quantization is None:
            raise ValueError("lm_head_quantization int8 applies with --quantization (int8, int4 or w8a8)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            from kernels.cpu_kernels import cpu_has_native_bf16

            native = self.torch_device.type == "cuda" or cpu_has_native_bf16()
            return torch.bfloat16 if native else torch.float32
        return _DTYPES[self.dtype]


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV-cache block (a power of two, 1..128)."""
    kv_cache_memory: float | None = None
    """KV-cache budget in GiB; none: 2 GiB on CPU, on CUDA what --gpu-memory-utilization leaves after a profiling forward pass."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, activations, KV cache); the KV cache gets what a profiling forward pass at max_num_batched_tokens leaves. CUDA only; --kv-cache-memory overrides."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of earlier requests' identical prompt prefixes (--no-prefix-caching turns it off)."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (tests use it to force preemption); overrides kv_cache_memory."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: auto (the compute dtype), int8 (per token and KV head: one-byte codes and a bf16 scale, 1.94x the tokens of bf16 at head dim 64; CPU and CUDA) or fp8 (E4M3 codes, same layout; CUDA and the torch backend only). docs/QUANTIZATION.md, "KV cache"."""
    kv_events_config: str | dict | None = None
    """KV-cache events for cache-aware routers (llm-d, Dynamo) as JSON, vLLM's keys: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}; each step's BlockStored / BlockRemoved / AllBlocksCleared go out in vLLM's wire format (docs/OPERATIONS.md); the topic defaults to kv@<host>:<port>@<model> under `pagoda serve`. none: off."""

    def __post_init__(self) -> None:
        self.kv_events  # validates
        from kernels.kv_quant import KV_CACHE_DTYPES

        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size > 128 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")


    @property
    def kv_events(self):
        """The parsed `KVEventsConfig`; None when absent. Raises ValueError on a bad value."""
        from engine.kv_events import KVEventsConfig

        return KVEventsConfig.parse(self.kv_events_config)


SCHEDULING_POLICIES = ("fair", "fcfs")
"""`--scheduling-policy` values (engine/fair_queue.py)."""
CPU_LONG_PREFILL_CHUNK = 512
"""Default longest prefill chunk per request and step on CPU (SchedulerConfig)."""


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    """Most requests running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step (decodes + prefill chunks)."""
    long_prefill_token_threshold: int | None = None
    """Longest prefill chunk of one request in one step; none: on CPU 512 tokens, scaled down as the request's context grows (by w / (w + context), w the context length whose attention takes as long as the decoder linears: for the bundled model ~2460 tokens in bf16 on AVX512-BF16 CPUs, ~770 elsewhere), so a step with a chunk costs about the same at any context and a long prompt stalls the streams decoding beside it by a bounded time; on CUDA the whole budget."""
    scheduling_policy: str = "fair"
    """Order of the waiting queue: fair (by request priority, lower first, then the tenant - API key - with the least recent use of the engine, then arrival; preemption takes the last in that order, and a tenant below its share of --max-num-seqs may preempt one above it) or fcfs (arrival order only; a request priority other than 0 is refused)."""

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be >= 1")

    def for_device(self, device: torch.device) -> "SchedulerConfig":
        """This config with the device's default prefill chunk filled in (see
        long_prefill_token_threshold)."""
        if self.long_prefill_token_threshold is not None or device.type != "cpu":
            return self
        return replace(self, long_prefill_token_threshold=CPU_LONG_PREFILL_CHUNK)


@dataclass(slots=True)
class KernelConfig:
    kernel_backend: str = "auto"
    """auto (Triton on CUDA; on CPU the C++ kernels, or the torch reference where they cannot be built), cpu (the C++ kernels), torch (the reference), or triton (on CPU: the Triton interpreter)."""
    batch_invariant: bool | None = None
    """Same request, same tokens: every linear and the attention compute a row the same way whatever else shares the step (batch size, chunk length, prefix-cache hits), so greedy and seeded outputs do not depend on the server's load. Not set: on where it is free, the C++ CPU kernels (bf16 on AVX512-BF16: their one linear kernel and the invariant attention route, within 5% of the fastest path at 1 and 32 streams, docs/BENCHMARKS.md), off on the Triton backend (no split-K costs GPU decode speed). `--no-batch-invariant` on CPU: attention on its thread-split and blocked routes, which depend on the batch (faster prefill of long prompts)."""

    cpu_threads: int | None = None
    """Threads of the CPU kernels (per tensor-parallel rank: the ranks on one machine split them); none: the CPUs this process can get, the fewest of its affinity mask and its cgroup CPU quota (engine/cpu_threads.py; an explicit OMP_NUM_THREADS is kept). CPU only; logged at start-up."""

    def batch_invariant_for(self, device: torch.device) -> bool:
        """`batch_invariant` with "not set" resolved for `device`: on for the C++ CPU kernels
        (`kernel_backend` auto or cpu on a CPU), off for the Triton and torch backends."""
        if self.batch_invariant is not None:
            return self.batch_invariant
        return device.type == "cpu" and self.kernel_backend in ("auto", "cpu")

    def __post_init__(self) -> None:
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks (one process each; one GPU each on CUDA) that split every layer's weights, attention heads and KV cache; 1 = none."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")


@dataclass(frozen=True, slots=True)
class NgramSpeculation:
    """Prompt-lookup speculation, parsed from `--speculative-config` (vLLM's keys)."""

    num_speculative_tokens: int
    """k: draft tokens proposed per step for a decoding request (verified in the same pass)."""
    prompt_lookup_max: int
    """Longest suffix n-gram matched against the request's own tokens."""
    prompt_lookup_min: int
    """Shortest suffix n-gram that counts as a match."""
    disable_by_batch_size: int | None
    """No proposals in a step whose running batch has at least this many requests (none: always on)."""


_SPECULATIVE_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size"}
DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE = 8
"""Speculation's default batch-size cut-off: beyond a few streams a CPU step is no longer
memory-bound, so verifying k extra tokens per stream costs throughput (docs/BENCHMARKS.md)."""


@dataclass(slots=True)
class SpeculativeConfig:
    speculative_config: str | dict | None = None
    """Speculative decoding as JSON, vLLM's spelling: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}: each decoding request proposes up to k tokens that followed the latest earlier occurrence of its longest suffix n-gram (prompt + output) and verifies them in the same forward pass; the output is what it would be without (greedy: token for token; sampled: the same distribution). Off above disable_by_batch_size running requests (default 8); under a grammar, drafts are trimmed to what it allows. none: off."""

    def __post_init__(self) -> None:
        self.ngram  # validates

    @property
    def ngram(self) -> NgramSpeculation | None:
        """The parsed settings; None when speculation is off. Raises ValueError on a bad value."""
        raw = json_object_setting(self.speculative_config, "speculative_config", _SPECULATIVE_KEYS)
        if raw is None:
            return None
        method = raw.get("method", "ngram")
        if method != "ngram":
            raise ValueError(f"speculative_config: method {method!r} is not supported (only 'ngram', prompt lookup)")

        def integer(key: str, default: int | None, low: int) -> int | None:
            value = raw.get(key, default)
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative_config: {key} must be an integer >= {low}, got {value!r}")
            return value

        if "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config: num_speculative_tokens is required")
        k = integer("num_speculative_tokens", None, 1)
        lookup_max = integer("prompt_lookup_max", 4, 1)
        lookup_min = integer("prompt_lookup_min", min(2, lookup_max), 1)
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lookup_min}) > prompt_lookup_max ({lookup_max})")
        disable = integer("disable_by_batch_size", DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE, 1)
        return NgramSpeculation(k, lookup_max, lookup_min, disable)


@dataclass(slots=True)
class LoraConfig:
    enable_lora: bool = False
    """Serve LoRA adapters on top of the base weights (engine/lora.py): on by itself when --lora-modules or --allow-runtime-lora-loading is given. Adapters are applied per row group in each step, never merged, so one batch mixes adapters and the base."""
    lora_modules: dict[str, str] | list[str] = field(default_factory=dict)
    """PEFT adapters served from start-up, as name=path (each folder holds adapter_config.json and adapter_model.safetensors; q/k/v/o and MLP projections); a request selects one by `model`."""
    max_loras: int = 4
    """Adapters resident (on the device) and in one step at once; requests for others wait, and the least recently used resident adapter makes room (logged)."""
    max_lora_rank: int = 64
    """Highest adapter rank accepted (at start-up and by /v1/load_lora_adapter)."""
    allow_runtime_lora_loading: bool = False
    """Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime adapter API); the paths must lie under a --lora-dir root."""
    lora_dir: list[str] = field(default_factory=list)
    """Folders that runtime-loaded adapters must lie under (repeatable); without one, runtime loading refuses every path."""

    def __post_init__(self) -> None:
        if isinstance(self.lora_modules, (list, tuple)):
            modules: dict[str, str] = {}
            for item in self.lora_modules:
                name, sep, path = str(item).partition("=")
                if not sep or not name or not path:
                    raise ValueError(f"lora_modules: expected name=path, got {item!r}")
                if name in modules:
                    raise ValueError(f"lora_modules: adapter name {name!r} given twice")
                modules[name] = path
            self.lora_modules = modules
        if isinstance(self.lora_dir, str):
            self.lora_dir = [self.lora_dir]
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.lora_modules or self.allow_runtime_lora_loading:
            self.enable_lora = True


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    @classmethod
    def from_engine_args(cls, **engine_args: Any) -> "EngineConfig":
        """Map flat engine arguments (the CLI flag names) onto the sections."""
        sections: dict[str, dict[str, Any]] = {f.name: {} for f in dataclasses.fields(cls)}
        owner = {
            fld.name: sec.name
            for sec in dataclasses.fields(cls)
            for fld in dataclasses.fields(sec.default_factory)  # type: ignore[arg-type]
        }
        for name, value in engine_args.items():
            if name not in owner:
                raise ValueError(f"unknown engine argument {name!r}; known: {sorted(owner)}")
            if value is not None:
                sections[owner[name]][name] = value
        return cls(
            model=ModelConfig(**sections["model"]),
            cache=CacheConfig(**sections["cache"]),
            scheduler=SchedulerConfig(**sections["scheduler"]),
            kernel=KernelConfig(**sections["kernel"]),
            parallel=ParallelConfig(**sections["parallel"]),
            speculative=SpeculativeConfig(**sections["speculative"]),
            lora=LoraConfig(**sections["lora"]),
        )
