"""A tensor-parallel worker (rank > 0): its shard of the model and KV cache, stepping when rank 0 says.

The scheduler, block manager and sampler live on rank 0 only. A worker builds the same
shard layout from the same configuration, then loops: wait for a step header on the
control group, take the payload, run the same forward pass (its collectives meet rank
0's), repeat until the shutdown message. Any error ends the process, which the other
ranks notice at their next collective (the connections close).

Spawned by rank 0 (`worker_main`, multiprocessing spawn) on one machine, or run by
`pagoda serve` / `pagoda generate` itself on every rank but 0 under `torchrun`.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.distributed.parallel_state import (
    ParallelGroups,
    Rendezvous,
    cpu_threads_per_rank,
    init_groups,
    rank_device,
)
from engine.distributed.sharding import ShardLayout, shard_model
from engine.distributed.step_message import HEADER_LEN, MessageKind, decode, payload_len
from engine.kv_cache import KVCacheSpec, allocate_kv_cache, kv_cache_budget_bytes
from engine.models.llama import LlamaForCausalLM, ModelArgs, prepack_linears
from kernels.ops import KernelOps, get_ops


def load_model_shard(
    config: EngineConfig, model_path: Path, max_model_len: int, device: torch.device, groups: ParallelGroups
) -> tuple[LlamaForCausalLM, ShardLayout]:
    """This rank's shard, quantized as the whole model would be (loaded whole on the CPU first)."""
    from engine.loader import load_hf_config, load_model

    mc = config.model
    args = ModelArgs.from_hf_config(load_hf_config(model_path))
    layout = ShardLayout.for_rank(args, groups.rank, groups.world_size, mc.quantization)
    model = load_model(model_path, mc.torch_dtype, torch.device("cpu"), max_model_len, load_format=mc.load_format)
    return shard_model(model, layout, mc.quantization, device, groups.model), layout


def agree_num_blocks(groups: ParallelGroups, num_blocks: int) -> int:
    """Every rank allocates the same number of KV blocks: the fewest any rank has room for."""
    n = torch.tensor([num_blocks], dtype=torch.int64)
    dist.all_reduce(n, op=dist.ReduceOp.MIN, group=groups.control)
    return int(n.item())


def worker_main(config: EngineConfig, rendezvous: Rendezvous) -> None:
    """The process entry of a spawned worker rank; exits non-zero on any error."""
    try:
        run_worker(config, rendezvous)
    except BaseException:  # noqa: BLE001 - reported, then the process ends
        trace = traceback.format_exc()
        print(f"[pagoda] tensor-parallel rank {rendezvous.rank} failed:\n{trace}", file=sys.stderr, flush=True)
        sys.exit(1)


def run_worker(config: EngineConfig, rendezvous: Rendezvous) -> None:
    from engine.default_model import resolve_model_path
    from engine.loader import load_hf_config

    mc, cc = config.model, config.cache
    if rendezvous.world_size != config.parallel.tensor_parallel_size:
        raise ValueError(
            f"{rendezvous.world_size} ranks were started for tensor_parallel_size {config.parallel.tensor_parallel_size}"
        )
    device = rank_device(mc.torch_device, rendezvous.local_rank)
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads_per_rank(rendezvous.world_size))
    print(
        f"[pagoda] tensor-parallel rank {rendezvous.rank}/{rendezvous.world_size}: pid {os.getpid()}, {device}",
        file=sys.stderr,
        flush=True,
    )
    groups = init_groups(rendezvous, device)
    model_path = resolve_model_path(mc.model)
    args = ModelArgs.from_hf_config(load_hf_config(model_path))
    max_model_len = mc.max_model_len or args.max_position_embeddings
    model, layout = load_model_shard(config, model_path, max_model_len, device, groups)
    prepack_linears(model)  # as ModelRunner does on rank 0
    spec = layout.kv_cache_spec(KVCacheSpec.from_model(args, mc.torch_dtype, cc.block_size))
    own = cc.num_gpu_blocks_override or spec.num_blocks_for_budget(kv_cache_budget_bytes(cc.kv_cache_memory, device))
    kv_caches = allocate_kv_cache(spec, agree_num_blocks(groups, own), device)
    serve_steps(model, kv_caches, get_ops(config.kernel.kernel_backend, device), device, groups)
    groups.destroy()


def serve_steps(
    model: LlamaForCausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ops: KernelOps,
    device: torch.device,
    groups: ParallelGroups,
) -> None:
    """Run every step rank 0 broadcasts, until it sends the shutdown message."""
    from engine.model_runner import run_forward

    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    with torch.inference_mode():
        while True:
            dist.broadcast(header, 0, group=groups.control)
            if header[0] == MessageKind.SHUTDOWN:
                return
            payload = torch.empty(payload_len(header), dtype=torch.int64, device=device)
            dist.broadcast(payload, 0, group=groups.model)
            step = decode(header, payload)
            run_forward(model, kv_caches, ops, step.input_ids, step.positions, step.meta, step.blocks_to_copy)
