"""The model side of one rank: load -> quantize/shard -> prepack -> size the KV cache ->
allocate it -> capture decode graphs -> run forward passes.

One `Worker` per rank, built the same way on rank 0 (inside `EngineCore`) and on every
tensor-parallel worker rank (`engine/distributed/worker.py`), so the sequence exists once.
Rank 0 adds what only it has: the `ModelRunner` that flattens a scheduled step into
tensors, the scheduler, block manager and sampler (engine_core.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.huge_pages import pages_fact
from engine.kv_cache import KVCacheSpec, allocate_kv_cache, kv_cache_budget_bytes
from engine.loader import load_hf_config, load_model
from engine.memory import profile_kv_cache_budget, take_snapshot
from engine.host_memory import available_host_memory
from engine.models.llama import FusedDecodeLayers, Linear, LlamaForCausalLM, ModelArgs, prepack_linears
from engine.prompt_logprobs import PromptLogprobRows, chunked_logits
from engine.quantization.linears import Int4Linear, Int8Linear
from kernels.linear import gemv_unavailable_reason
from kernels.ops import KernelOps, get_ops

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.cuda_graphs import DecodeGraphRunner
    from engine.distributed.parallel_state import ParallelGroups
    from engine.distributed.sharding import ShardLayout


CPU_ATTENTION_SLOWDOWN = 4
"""How many times slower than the linears' GEMMs a prefill chunk's attention runs per
FLOP on CPU through torch's flash kernel (80-130 GFLOP/s against oneDNN's ~400 here:
`python -m loadtest.bench_cpu_attention`, docs/BENCHMARKS.md)."""
CPU_BLOCKED_ATTENTION_SLOWDOWN = 1.25
"""The same through the C++ kernel's blocked bf16 loop (kernels/cpu_kernels.py: bf16 on
AVX512-BF16 CPUs), ~300-320 GFLOP/s on long chunks in the same benchmark."""
C12_HEADROOM_BYTES = 1 << 30
"""Host memory kept free beyond the weights, their 12-bit copies and the KV cache: a step's
activations and logits, the tokenizer, the server and whatever else the machine runs. The
copies (engine/models/llama.py `FusedDecodeLayers`) are made only where they fit within it."""


@dataclass(slots=True)
class RankPlacement:
    """Where a tensor-parallel rank's Worker lives: its device and its process groups."""

    device: torch.device
    groups: "ParallelGroups"


class Worker:
    def __init__(self, config: EngineConfig, model_path: Path, placement: RankPlacement | None = None,
                 log: bool = True) -> None:
        mc = config.model
        self.config = config
        self.model_path = model_path
        self.placement = placement
        self.device = placement.device if placement is not None else mc.torch_device
        self.dtype = mc.torch_dtype
        self.args = ModelArgs.from_hf_config(load_hf_config(model_path))
        self.max_model_len = _max_model_len(mc.max_model_len, self.args)
        # On one GPU without a fixed budget the KV cache is sized by profiling (engine/memory.py):
        # note the device's memory before anything is loaded.
        snapshot = take_snapshot(self.device) if self._profiles_memory else None
        self.model, self.layout = self._load()
        invariant = self.batch_invariant = config.kernel.batch_invariant_for(self.device)
        # On CPU each float weight held once, in the layout its kernel reads: the C++ bf16
        # kernel's (bf16 on AVX512-BF16: one arithmetic at every row count) or oneDNN's.
        self.num_packed_linears, self.num_shared_linears = prepack_linears(self.model)
        self.ops: KernelOps = get_ops(config.kernel.kernel_backend, self.device, invariant)
        if invariant:  # the Triton weight-only GEMMs' one config at every row count
            for module in self.model.modules():
                if isinstance(module, (Int8Linear, Int4Linear)):
                    module.invariant = True
        spec = KVCacheSpec.from_model(self.args, self.dtype, config.cache.block_size, config.cache.kv_cache_dtype)
        _check_kv_cache_dtype(spec, config.cache.kv_cache_dtype, self.ops.backend)
        self.kv_spec = self.layout.kv_cache_spec(spec) if self.layout is not None else spec  # this rank's KV heads
        self.num_blocks = self._num_kv_blocks(snapshot, log)
        if self.device.type == "cpu" and self.layout is None and isinstance(self.model, LlamaForCausalLM):  # one process's whole model, bf16 GEMV linears
            # Its 12-bit weight copies only where they fit beside the KV cache about to be
            # allocated and a headroom for activations and the server (engine/host_memory.py).
            free, self.host_memory = available_host_memory()
            kv_bytes = (self.num_blocks + 1) * self.kv_spec.bytes_per_block
            budget = None if free is None else free - kv_bytes - C12_HEADROOM_BYTES
            self.model.fused_decode = FusedDecodeLayers.build(self.model, invariant, budget)
        # One block more than the block manager hands out: the pad block, where the padding
        # rows of a decode batch replayed from a CUDA graph write (engine/cuda_graphs.py).
        self.kv_caches = allocate_kv_cache(self.kv_spec, self.num_blocks + 1, self.device)

    @property
    def _profiles_memory(self) -> bool:
        cc = self.config.cache
        return (
            self.device.type == "cuda" and cc.kv_cache_memory is None and cc.num_gpu_blocks_override is None
            and self.placement is None
        )

    def _load(self) -> tuple[LlamaForCausalLM, "ShardLayout | None"]:
        """The model (quantized at load when asked), or this rank's shard of it."""
        mc = self.config.model
        if self.placement is None:
            model = load_model(
                self.model_path, self.dtype, self.device, self.max_model_len, mc.quantization, mc.load_format,
                mc.lm_head_quantization,
            )
            return model, None
        from engine.distributed.sharding import ShardLayout, shard_model

        groups = self.placement.groups
        layout = ShardLayout.for_rank(self.args, groups.rank, groups.world_size, mc.quantization)
        # Loaded whole on the host, then sharded: every rank quantizes as the whole model would.
        whole = load_model(self.model_path, self.dtype, torch.device("cpu"), self.max_model_len, load_format=mc.load_format)
        return shard_model(whole, layout, mc.quantization, self.device, groups.model, mc.lm_head_quantization), layout

    def _num_kv_blocks(self, snapshot, log: bool) -> int:
        """Blocks from the override, the profiled GPU budget, or --kv-cache-memory; under
        tensor parallelism every rank takes the fewest any rank has room for."""
        cc, sc = self.config.cache, self.config.scheduler
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif snapshot is not None:
            budget = profile_kv_cache_budget(
                self.model, self.kv_spec, self.ops, self.device, snapshot, sc.max_num_batched_tokens, sc.max_num_seqs,
                cc.gpu_memory_utilization, log,
            )
            num_blocks = self.kv_spec.num_blocks_for_budget(budget)
        else:
            num_blocks = self.kv_spec.num_blocks_for_budget(kv_cache_budget_bytes(cc.kv_cache_memory, self.device))
        if self.placement is not None:
            from engine.distributed.parallel_state import agree_num_blocks

            num_blocks = agree_num_blocks(self.placement.groups, num_blocks)
        if num_blocks < 1:
            raise ValueError(
                f"the KV-cache budget holds no block of {self.kv_spec.bytes_per_block} bytes; raise --kv-cache-memory"
            )
        return num_blocks

    def capture_decode_graphs(self, block_manager: "BlockManager", log: bool = True) -> "DecodeGraphRunner | None":
        """CUDA graphs of pure decode steps (rank 0, CUDA, not --enforce-eager), or None."""
        mc = self.config.model
        if self.device.type != "cuda" or mc.enforce_eager:
            return None
        from engine.cuda_graphs import build_decode_graph_runner

        return build_decode_graph_runner(
            self, block_manager, self.config.scheduler.max_num_seqs, mc.max_cuda_graph_batch_size,
            self.config.parallel.tensor_parallel_size, log,
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        blocks_to_copy: torch.Tensor | None,  # [num_copies, 2] (src, dst), copied first (copy-on-write)
        prompt_logprobs: "PromptLogprobRows | None" = None,
    ) -> torch.Tensor:
        """One prepared step's forward: logits of `meta.logits_indices` (every rank runs it;
        under tensor parallelism its collectives meet the other ranks'). The last rows of
        `logits_indices` may be `prompt_logprobs`' (rank 0): those are reduced chunk by
        chunk into `prompt_logprobs.result` and not returned (engine/prompt_logprobs.py)."""
        if blocks_to_copy is not None:
            self.ops.copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], blocks_to_copy)
        if prompt_logprobs is None:  # a decode step on CPU: the whole forward and the LM head in one C++ call
            logits = self.model.decode_logits(input_ids, positions, self.kv_caches, meta, self.ops)
            if logits is not None:
                return logits
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.ops)
        return chunked_logits(self.model.compute_logits, hidden, prompt_logprobs)

    def facts(self) -> dict[str, str]:
        """What was actually loaded and how it runs: the start-up log and the info metric."""
        a, spec, cc = self.args, self.kv_spec, self.config.cache
        facts = {
            "model": self.model_path.name,
            "batch_invariant": self._batch_invariant_fact(),
            "architecture": _architecture(self.model_path),
            "layers": str(a.num_hidden_layers),
            "dtype": self._dtype_fact(),
            "device": str(self.device),
            "quantization": self.quantization(),
            "lm_head": self._lm_head_fact(),
            "kernel_backend": self.ops.backend,
            "kv_cache": (
                f"{spec.bytes_per_token} bytes/token ({spec.arithmetic()}), {self.num_blocks} blocks x "
                f"{cc.block_size} tokens = {self.num_blocks * cc.block_size} tokens "
                f"({self.num_blocks * spec.bytes_per_block / 2**30:.2f} GiB)" + self._kv_quant_fact()
                + (f", {pages_fact()}" if self.device.type == "cpu" else "")
            ),
            "max_model_len": str(self.max_model_len),
        }
        num_float = self._num_float_linears()
        if self.device.type == "cpu" and num_float:
            kernel = self._num_kernel_linears()
            tied = ("; each weight held once, but the LM head tied to the embeddings (packed, and the dense "
                    "table for the lookup)") if self.num_shared_linears else "; each weight held once"
            if getattr(getattr(self.model, "fused_decode", None), "c12", None) is not None:
                tied += " (and a 12-bit copy for small steps: decode_layers)"
            onednn = self.num_packed_linears - kernel
            if kernel:
                facts["linears"] = (f"{kernel} of {num_float} float linears on the C++ bf16 kernel (one arithmetic "
                                    f"at every row count: batch-invariant)"
                                    + (f", {onednn} oneDNN-packed" if onednn else "") + tied)
            else:
                facts["linears"] = f"oneDNN-packed {self.num_packed_linears} of {num_float} float linears{tied}"
        if self.device.type == "cpu":
            fused = getattr(self.model, "fused_decode", None)
            facts["decode_layers"] = (
                f"one C++ call for all {a.num_hidden_layers} layers of every bf16 step "
                "(PAGODA_CPU_FUSED_DECODE=0: the per-op forward)"
                + (f"; steps of 1-2 rows read the bf16 linears' lossless 12-bit copy ({fused.c12_bytes / 2**20:.0f} MiB "
                   "more; PAGODA_CPU_12BIT_WEIGHTS=0: off)" if fused.c12 is not None else "")
                + (f"; {fused.c12_skipped} (host: {self.host_memory})" if fused.c12_skipped else "")
                if fused is not None
                else "the per-op forward (the fused C++ call takes Llama/Mistral/Qwen2 blocks in bf16 with GEMV, "
                     "int4 or int8 linears on an AVX512-BF16 CPU, in one process)"
            )
        return facts

    def _kv_quant_fact(self) -> str:
        """What reads a quantized cache: the kernels in place, or the reference (slower: logged)."""
        kind = self.config.cache.kv_cache_dtype
        if kind == "auto":
            return ""
        if self.ops.backend == "cpu":
            from kernels import cpu_kernels

            if kind == "int8" and cpu_kernels.int8_cache_runs(self.dtype, self.args.head_dim):
                return "; int8 rows read in place by the C++ attention (its invariant route)"
            return (f"; {kind} rows through the torch reference attention, dequantized per step (slower: the C++ "
                    f"kernel reads int8 with bf16 queries at head dim 64/128/256 on AVX512-BF16 only)")
        return f"; {kind} rows read in place by the {self.ops.backend} attention"

    def _batch_invariant_fact(self) -> str:
        """Whether a request's tokens are independent of the rest of the step (the start-up log says which mode is on)."""
        if not self.batch_invariant:
            why = ("--no-batch-invariant" if self.config.kernel.batch_invariant is False
                   else f"the default on the {self.ops.backend} kernels; --batch-invariant: on")
            return f"off ({why}): outputs may change with the batch, the chunking and prefix-cache hits"
        if self.device.type == "cpu" and self.ops.backend == "cpu" and self.dtype == torch.bfloat16 and self._all_float_linears_invariant():
            return "on: greedy and seeded outputs do not depend on the batch, the chunking or the prefix cache"
        if self.ops.backend == "triton":
            return (f"attention and quantized linears only ({self.dtype}): the Triton attention and INT8/INT4 "
                    "GEMMs take one config whatever the batch (no split-K, one tile shape); float linears "
                    "(torch's matmuls, cuBLAS on CUDA) are not batch-invariant, so outputs may still change "
                    "with the batch unless every linear is quantized")
        return (f"not guaranteed on this path ({self.ops.backend} kernels, {self.dtype}): the invariant "
                "kernels are the C++ CPU ones in bf16 on AVX512-BF16")

    def prefill_context_weight(self) -> int:
        """The context length whose attention takes a new token as long as its pass through
        the decoder linears; the scheduler scales its prefill chunk cap by it (on CPU).
        FLOPs: 2 x (linear weights per layer) against 4 x heads x head_dim per context
        token (QK^T and PV); time: per FLOP a prefill chunk's attention runs
        CPU_BLOCKED_ATTENTION_SLOWDOWN times slower than the linears in the C++ blocked
        loop, CPU_ATTENTION_SLOWDOWN times through torch's flash kernel. For SmolLM2-135M
        ~2460 and ~770 tokens."""
        from kernels import cpu_kernels

        a = self.args
        q, kv = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
        linear_weights = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + 3 * a.hidden_size * a.intermediate_size
        blocked = self.ops.backend == "cpu" and cpu_kernels.blocked_attention_runs(self.dtype, a.head_dim)
        slowdown = CPU_BLOCKED_ATTENTION_SLOWDOWN if blocked else CPU_ATTENTION_SLOWDOWN
        return max(1, int(2 * linear_weights / (4 * q * slowdown)))

    def _num_kernel_linears(self) -> int:
        """Float linears on the C++ bf16 kernel (every row count, one arithmetic: batch-invariant)."""
        return sum(1 for m in self.model.modules() if isinstance(m, Linear) and m.kernel_weight is not None)

    def _num_float_linears(self) -> int:
        return sum(1 for m in self.model.modules()
                   if isinstance(m, Linear) and (m.weight is not None or m.packed is not None or m.kernel_weight is not None))

    def _all_float_linears_invariant(self) -> bool:
        """Whether every float linear runs the C++ bf16 kernel (oneDNN's GEMM is not batch-invariant)."""
        return self._num_kernel_linears() == self._num_float_linears()

    def _lm_head_fact(self) -> str:
        """How the LM head is held: INT8 (under --quantization, --lm-head-quantization) or
        the compute dtype."""
        from engine.quantization.linears import Int8Linear

        head = self.model.lm_head
        head = getattr(head, "local", head)  # this rank's shard under tensor parallelism
        if isinstance(head, Int8Linear):
            return "int8 weight-only, per output channel (W8A16)"
        if isinstance(head, Linear):
            fused = getattr(self.model, "fused_decode", None)
            copy = fused.argmax_head if fused is not None else None
            if copy is None:
                return str(self.dtype).removeprefix("torch.")
            size = sum(t.numel() * t.element_size() for t in copy) / 2**20
            return (f"{str(self.dtype).removeprefix('torch.')}; greedy steps of 1-4 rows read an int8 copy first "
                    f"({size:.0f} MiB) and the exact head only where the argmax can be: the same tokens "
                    f"(PAGODA_CPU_GREEDY_HEAD=0: off)")
        return type(head).__name__

    def _dtype_fact(self) -> str:
        name = str(self.dtype).removeprefix("torch.")
        if self.config.model.dtype != "auto" or self.device.type != "cpu":
            return name
        why = "computes bf16 natively" if self.dtype == torch.bfloat16 else "has no native bf16"
        return f"{name} (--dtype auto: this CPU {why})"

    def fallbacks(self) -> list[str]:
        """Slower paths taken, each to be logged."""
        out = []
        if self.device.type == "cpu":
            num_float = self._num_float_linears()
            if self.num_packed_linears < num_float:
                out.append(
                    f"{num_float - self.num_packed_linears} float linear(s) could not be oneDNN-packed and run "
                    "on torch's default GEMM"
                )
            if self.dtype == torch.bfloat16 and self.num_packed_linears and not self._num_kernel_linears():
                out.append(
                    f"the C++ bf16 linear kernel is off ({gemv_unavailable_reason()}): bf16 linears run on oneDNN's "
                    "packed GEMM (about half the weight-stream rate at decode, and not batch-invariant)"
                )
        if self.device.type == "cpu" and self.ops.backend == "torch" and self.config.kernel.kernel_backend == "auto":
            from kernels.cpu_kernels import unavailable_reason

            out.append(f"{unavailable_reason()}: attention and the element-wise ops run on the torch reference")
        out += quantized_linear_fallbacks(self.model, self.device)
        if self.device.type == "cuda" and self.ops.backend == "triton":
            reason = attention_fallback(self.args)
            if reason is not None:
                out.append(reason)
        if self.device.type == "cuda" and self.ops.backend != "triton":
            out.append(f"attention runs on the {self.ops.backend} reference ops on CUDA, not the Triton kernels")
        return out

    def quantization(self) -> str:
        """The weights' quantization: a load-time method, a quantized checkpoint's, or none."""
        from engine.loader import checkpoint_quantization

        method = self.config.model.quantization
        if method == "int8":
            return "int8 weight-only RTN, per output channel (W8A16)"
        if method == "int4":
            return "int4 weight-only RTN, asymmetric, groups of up to 128 inputs (W4A16)"
        if method == "w8a8":
            return "w8a8: int8 weights per channel, int8 activations per token"
        if method is not None:
            return method
        spec = None if self.config.model.load_format == "dummy" else checkpoint_quantization(self.model_path)
        if spec is None:
            return "none"
        group = "per output channel" if spec.group_size is None else f"groups of {spec.group_size}"
        return f"{spec.layout} checkpoint, {spec.bits}-bit, {group}{', symmetric' if spec.sym else ''}"


def attention_fallback(args: ModelArgs) -> str | None:
    """Why the Triton attention kernels cannot take this model's shape (kernels/ops.py then
    routes every call to the torch reference), or None."""
    from kernels.triton_attention import MAX_GQA_RATIO, SUPPORTED_HEAD_DIMS

    ratio = args.num_attention_heads // args.num_key_value_heads
    if args.head_dim in SUPPORTED_HEAD_DIMS and ratio <= MAX_GQA_RATIO:
        return None
    dims = "/".join(str(d) for d in SUPPORTED_HEAD_DIMS)
    return (
        f"attention runs on the torch reference, not the Triton kernels, for head_dim {args.head_dim} / GQA ratio "
        f"{ratio} (the kernels take head_dim {dims} and GQA ratios up to {MAX_GQA_RATIO}); CUDA graphs are off with it"
    )


def quantized_linear_fallbacks(model: torch.nn.Module, device: torch.device) -> list[str]:
    """The quantized linears that run a dequantizing or float64 reference instead of a fast
    kernel (kernels/quant_linear.py). On CUDA none: every kind runs its Triton kernel, and
    an INT4 group size the kernel cannot take is refused at load."""
    if device.type != "cpu":
        return []
    from engine.quantization.linears import Int4Linear, Int8Linear, W8A8Linear
    from kernels.quant_linear import cpu_int8_mm_available, cpu_int_mm_available

    modules = list(model.modules())
    int8 = sum(isinstance(m, Int8Linear) for m in modules)
    int4 = sum(isinstance(m, Int4Linear) and not m.cpu_packed for m in modules)
    w8a8 = sum(isinstance(m, W8A8Linear) for m in modules)
    out = []
    if int8 and not cpu_int8_mm_available():
        out.append(f"{int8} INT8 linear(s) dequantize their weight every call: torch's int8 CPU kernel failed its probe")
    if int4:
        out.append(
            f"{int4} INT4 linear(s) dequantize their weight every call: neither CPU int4 kernel takes their group "
            "size here (Pagoda's: AVX512-BF16, a multiple of 16 dividing the inputs; torch's: 32, 64, 128 or 256, "
            "and its probe passing)"
        )
    if w8a8 and not cpu_int_mm_available():
        out.append(f"{w8a8} W8A8 linear(s) run the float64 reference: torch._int_mm failed its probe")
    return out


def _architecture(model_path: Path) -> str:
    config = load_hf_config(model_path)
    names = getattr(config, "architectures", None) or [getattr(config, "model_type", "unknown")]
    return ",".join(names)


def _check_kv_cache_dtype(spec: KVCacheSpec, kv_cache_dtype: str, backend: str) -> None:
    """Refuse a quantized KV cache this process cannot hold: FP8 without a kernel that
    writes E4M3 (the C++ CPU kernels have none). (An odd head dim, which leaves the row's
    2-byte scale unaligned, is refused by `spec.row_width` as the cache is sized.)"""
    if kv_cache_dtype == "fp8" and backend == "cpu":
        raise ValueError("--kv-cache-dtype fp8 runs on CUDA (Triton) or the torch backend; the C++ CPU kernels "
                         "read int8 KV caches: use --kv-cache-dtype int8 on CPU")


def _max_model_len(requested: int | None, args: ModelArgs) -> int:
    max_model_len = requested or args.max_position_embeddings
    if max_model_len > args.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings {args.max_position_embeddings}"
        )
    return max_model_len
