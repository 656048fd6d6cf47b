"""Dispatch: Triton kernels on CUDA, C++ kernels on CPU, torch reference ops where
neither runs; `kernel_backend` overrides.

- auto: Triton on CUDA; on CPU the C++ kernels (kernels/cpu_kernels.py: paged attention
  read in place, the KV write, fused residual-add + RMSNorm and RoPE),
  or the torch reference where they cannot be built (the engine logs why). On CUDA a call whose shapes the
  kernels do not take (head_dim other than 64/128/256, GQA ratio over 8) goes to the
  reference instead of failing, so any model still runs (tests' tiny models use head_dim 16).
- cpu: the C++ kernels (CPU only; an error where they cannot be built).
- torch: the reference everywhere.
- triton: the Triton kernels; on CPU they run in the Triton interpreter, which must be
  switched on (TRITON_INTERPRET=1) before the kernel modules are imported: slow but
  exact, it is how the kernels are checked without a GPU.

Triton is imported only when a Triton backend is chosen, so `import kernels` stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from kernels import elementwise, reference


@dataclass(frozen=True, slots=True)
class KernelOps:
    backend: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None] = reference.copy_blocks
    # Entered around one forward pass, whose layers all pass the same metadata tensors:
    # the reference derives its gather indices from them once inside it.
    forward_scope: Callable[[], ContextManager] = contextlib.nullcontext
    # The element-wise steps of a layer (kernels/elementwise.py): reference or fused.
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] = elementwise.add_rms_norm
    # RoPE in place (qk, cos table, sin table, positions) where the backend has it; None:
    # the model rotates with torch ops, reusing the step's cos/sin lookups across layers.
    rotate_qk_: Callable[..., torch.Tensor] | None = None


def _cpu_ops(batch_invariant: bool) -> KernelOps:
    from kernels import cpu_kernels

    return KernelOps(
        backend="cpu",
        reshape_and_cache=cpu_kernels.reshape_and_cache,
        # The batch-invariant route in bf16 (a row's output independent of the step's other
        # rows and chunking) or the default routes.
        paged_attention=functools.partial(cpu_kernels.paged_attention, invariant=batch_invariant),
        add_rms_norm=elementwise.cpu_add_rms_norm,
        rotate_qk_=elementwise.cpu_rotate_qk_,
    )


def get_ops(kernel_backend: str, device: torch.device, batch_invariant: bool = False) -> KernelOps:
    """The ops of `kernel_backend` on `device`; `batch_invariant` chooses the C++ kernels'
    invariant bf16 attention route, or the Triton attention's one config whatever the batch
    (engine/config.py `KernelConfig.batch_invariant`)."""
    if kernel_backend not in ("auto", "cpu", "torch", "triton"):
        raise ValueError(f"kernel_backend must be auto, cpu, torch or triton, got {kernel_backend!r}")
    device = torch.device(device)
    if kernel_backend == "cpu" or (kernel_backend == "auto" and device.type == "cpu"):
        from kernels import cpu_kernels

        if device.type == "cpu" and cpu_kernels.load() is not None:
            return _cpu_ops(batch_invariant)
        if kernel_backend == "cpu":
            raise ValueError(
                "kernel_backend 'cpu' runs Pagoda's C++ CPU kernels: "
                + (cpu_kernels.unavailable_reason() if device.type == "cpu" else f"not on {device.type}")
            )
    use_triton = kernel_backend == "triton" or (kernel_backend == "auto" and device.type == "cuda")
    if not use_triton:
        return KernelOps(
            backend="torch",
            reshape_and_cache=reference.reshape_and_cache,
            paged_attention=reference.paged_attention,
            forward_scope=reference.reuse_attention_plans,
        )
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "kernel_backend 'triton' on CPU runs the Triton interpreter: set TRITON_INTERPRET=1 to run "
            "Triton kernels on CPU (or use kernel_backend 'torch')"
        )
    from kernels import triton_attention, triton_cache, triton_copy
    from kernels.triton_runtime import check_device_runs_triton

    # The kernel modules may have been imported before TRITON_INTERPRET was set.
    check_device_runs_triton(device)
    # --batch-invariant: one attention config whatever the batch (triton_attention.choose_config).
    triton_paged_attention = functools.partial(triton_attention.paged_attention, invariant=batch_invariant)
    if kernel_backend == "triton":
        return KernelOps(
            backend="triton",
            reshape_and_cache=triton_cache.reshape_and_cache,
            paged_attention=triton_paged_attention,
            copy_blocks=triton_copy.copy_blocks,
        )

    def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
        supported = key.shape[-1] in triton_attention.SUPPORTED_HEAD_DIMS
        fn = triton_cache.reshape_and_cache if supported else reference.reshape_and_cache
        fn(key, value, key_cache, value_cache, slot_mapping)

    def paged_attention(query, key_cache, *args, **kwargs) -> torch.Tensor:
        ratio = query.shape[1] // max(key_cache.shape[2], 1)
        supported = query.shape[-1] in triton_attention.SUPPORTED_HEAD_DIMS and ratio <= triton_attention.MAX_GQA_RATIO
        fn = triton_paged_attention if supported else reference.paged_attention
        return fn(query, key_cache, *args, **kwargs)

    return KernelOps(
        backend="triton",
        reshape_and_cache=reshape_and_cache,
        paged_attention=paged_attention,
        copy_blocks=triton_copy.copy_blocks,
        forward_scope=reference.reuse_attention_plans,  # for the calls that fall back to it
    )

