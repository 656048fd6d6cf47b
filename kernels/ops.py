"""Dispatch: Triton kernels on CUDA, torch reference ops on CPU; `kernel_backend` overrides.

The Triton kernels arrive with their own issue; until then every backend resolves to
the reference ops, and asking for `triton` says so instead of silently using torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kernels import reference


@dataclass(frozen=True, slots=True)
class KernelOps:
    backend: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None] = reference.copy_blocks


def get_ops(kernel_backend: str, device: torch.device) -> KernelOps:
    if kernel_backend not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel_backend must be auto, torch or triton, got {kernel_backend!r}")
    if kernel_backend == "triton":
        raise ValueError("kernel_backend 'triton' is not available yet (Triton attention kernels are pending)")
    return KernelOps(
        backend="torch",
        reshape_and_cache=reference.reshape_and_cache,
        paged_attention=reference.paged_attention,
    )
