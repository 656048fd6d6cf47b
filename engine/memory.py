"""GPU memory profiling: how much KV cache fits after the weights and the worst step's activations.

As vLLM does it: the engine may use `gpu_memory_utilization x total` bytes of the device.
Before the model is loaded a snapshot records the free memory; what torch holds after
loading is the weights (load-time temporaries, e.g. quantization's, are gone by then).
Then one forward pass at the largest step the scheduler can make (`max_num_batched_tokens`
tokens over up to `max_num_seqs` sequences, with their logits and a softmax like the
sampler's, and every other position a prompt-logprob row: the LM head and the float32
log-softmax of one full chunk of `engine.prompt_logprobs.LOGITS_CHUNK_ROWS` rows, reduced
to the top 20) sets torch's peak allocation. The KV cache gets what is left:

    budget = utilization x total - weights - peak activations of the profile step
             - memory taken outside torch since the snapshot

Memory other processes hold is not subtracted: it must fit in the rest of the device,
which `kv_cache_budget_from_profile` checks at start-up instead (free < requested is an
error, as in vLLM). CUDA-graph pools are captured after the cache is allocated and are
not in the budget: they live in the `1 - utilization` headroom (tens to hundreds of MiB).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import GiB, KVCacheSpec, allocate_kv_cache
from engine.models.llama import LlamaForCausalLM
from engine.prompt_logprobs import PROFILE_TOP_K, PromptLogprobRows, chunked_logits
from kernels.ops import KernelOps


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """The device before the engine allocates anything (`take_snapshot`)."""

    total_bytes: int
    free_bytes: int
    torch_allocated_bytes: int
    torch_reserved_bytes: int


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    """What the profile measured; every field in bytes."""

    total: int
    free_at_start: int
    weights: int
    """torch's allocation after loading, over the snapshot's."""
    activations: int
    """Peak allocation of the profile step over what it started with, less its scratch KV cache."""
    non_torch_increase: int
    """Device memory taken outside torch's allocator since the snapshot (CUDA context growth, kernel modules)."""


def kv_cache_budget_from_profile(profile: MemoryProfile, utilization: float) -> int:
    """Bytes the KV cache may take; ValueError when nothing fits (the message says which knob)."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    requested = profile.total * utilization
    if profile.free_at_start < requested:
        raise ValueError(
            f"only {profile.free_at_start / GiB:.2f} GiB of the GPU's {profile.total / GiB:.2f} GiB were free at "
            f"start-up, less than --gpu-memory-utilization {utilization} asks for ({requested / GiB:.2f} GiB); "
            "lower it or free the GPU"
        )
    budget = int(requested - profile.weights - profile.activations - profile.non_torch_increase)
    if budget <= 0:
        raise ValueError(
            f"the weights ({profile.weights / GiB:.2f} GiB) and the largest step's activations "
            f"({profile.activations / GiB:.2f} GiB) leave no room for the KV cache in "
            f"--gpu-memory-utilization {utilization} x {profile.total / GiB:.2f} GiB; raise it or lower "
            "--max-num-batched-tokens"
        )
    return budget


def take_snapshot(device: torch.device) -> MemorySnapshot:
    """Free memory and torch's counters now (before the model is loaded)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return MemorySnapshot(total, free, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


def profile_batch_lengths(max_num_batched_tokens: int, max_num_seqs: int) -> list[int]:
    """Query lengths of the profile step: the full token budget over as many sequences as
    a step may hold (each samples, so the logits are as large as they get)."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    return [base + (i < extra) for i in range(num_seqs)]


def profile_run(
    model: LlamaForCausalLM,
    spec: KVCacheSpec,
    ops: KernelOps,
    device: torch.device,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> int:
    """One forward pass at the largest step: the sampling rows' logits and a softmax, and
    every other position as a prompt-logprob row (the worst case: every request asks for
    them), through the same chunked LM head as a real step. Returns the bytes of the
    scratch KV cache it used. Runs on any device; on CUDA it sets the peak."""
    lengths = profile_batch_lengths(max_num_batched_tokens, max_num_seqs)
    bs = spec.block_size
    blocks_per_seq = [-(-n // bs) for n in lengths]
    kv_caches = allocate_kv_cache(spec, sum(blocks_per_seq), device)
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(lengths), max_blocks, dtype=torch.int32)
    positions, slots, first_block = [], [], 0
    for i, (n, nb) in enumerate(zip(lengths, blocks_per_seq)):
        tables[i, :nb] = torch.arange(first_block, first_block + nb, dtype=torch.int32)
        positions.extend(range(n))
        slots.extend(range(first_block * bs, first_block * bs + n))
        first_block += nb
    ends = torch.tensor(lengths).cumsum(0)
    sampled = torch.zeros(max_num_batched_tokens, dtype=torch.bool)
    sampled[ends - 1] = True
    prompt_rows = (~sampled).nonzero().flatten()  # every position that does not sample
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=tables.to(device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        query_start_loc=torch.cat([torch.zeros(1, dtype=torch.int32), ends.int()]).to(device),
        logits_indices=torch.cat([ends - 1, prompt_rows]).to(device),
    )
    input_ids = torch.zeros(max_num_batched_tokens, dtype=torch.int64, device=device)
    prompt = PromptLogprobRows(torch.zeros(len(prompt_rows), dtype=torch.int64, device=device),
                               [min(PROFILE_TOP_K, model.args.vocab_size)] * len(prompt_rows))
    with torch.inference_mode():
        hidden = model(input_ids, torch.tensor(positions, dtype=torch.int64, device=device), kv_caches, meta, ops)
        logits = chunked_logits(model.compute_logits, hidden, prompt if len(prompt_rows) else None)
        torch.softmax(logits.float(), dim=-1)
    return sum(k.nbytes + v.nbytes for k, v in kv_caches)


def profile_kv_cache_budget(
    model: LlamaForCausalLM,
    spec: KVCacheSpec,
    ops: KernelOps,
    device: torch.device,
    start: MemorySnapshot,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    utilization: float,
    log: bool = True,
) -> int:
    """Run the profile step on CUDA (the model loaded since `start`) and return the KV-cache budget in bytes."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    profile_kv = profile_run(model, spec, ops, device, max_num_batched_tokens, max_num_seqs)
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    # Used outside torch = device-wide use minus what torch's allocator holds, now vs start.
    non_torch_now = (total - free) - torch.cuda.memory_reserved(device)
    non_torch_start = (start.total_bytes - start.free_bytes) - start.torch_reserved_bytes
    profile = MemoryProfile(
        total=start.total_bytes,
        free_at_start=start.free_bytes,
        weights=before - start.torch_allocated_bytes,
        activations=max(0, torch.cuda.max_memory_allocated(device) - before - profile_kv),
        non_torch_increase=max(0, non_torch_now - non_torch_start),
    )
    budget = kv_cache_budget_from_profile(profile, utilization)
    if log:
        print(
            f"[pagoda] memory profile ({max_num_batched_tokens} tokens): weights {profile.weights / GiB:.2f} GiB, "
            f"activations {profile.activations / GiB:.2f} GiB, non-torch {profile.non_torch_increase / GiB:.2f} GiB; "
            f"{utilization} x {profile.total / GiB:.2f} GiB leaves {budget / GiB:.2f} GiB for the KV cache",
            file=sys.stderr,
            flush=True,
        )
    return budget
