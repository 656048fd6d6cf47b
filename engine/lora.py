"""LoRA adapters served beside one copy of the base weights, many adapters in one batch.

An adapter is a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) whose
LoRA pairs target the decoder's q/k/v/o and MLP projections. Nothing is merged into the
base weights: each step, the rows (tokens) of the requests that name an adapter get

    y += scale * (x @ A^T) @ B^T

added to the outputs of the targeted linears, one "shrink" (x @ A^T) and one "expand"
(@ B^T) per adapter and fused linear (torch ops), for that adapter's rows only: the base
rows and other adapters' rows of the same batch are untouched. A step with rows of several
adapters stacks their A and B (one shrink and one expand for all rows, each row's shrink
output masked to its own adapter's columns) instead of one pair of matmuls per adapter. Scale is lora_alpha / r
(lora_alpha / sqrt(r) under rsLoRA) and is folded into B at load time.

The deltas are added by forward hooks on the targeted linears, installed once when LoRA is
enabled. A step with no LoRA rows runs exactly as without LoRA (the hooks return at once).

In bf16 on the C++ CPU kernels (AVX512-BF16) every step's deltas, one adapter or several,
are one C++ call per linear (kernels/cpu_kernels.py `lora_add`): the step's adapters' A
stacked on the rank axis and their B transposed and stacked likewise, each row taking its
own adapter's rank columns (the shrink kept in float32, each output rounded once), so a
row's result does not depend on the other rows of the step. The fused decode call
(`bf16_decode_layers`) takes the same stacks (`fused_tensors`) and adds the same deltas
after each of its linears: decode steps with LoRA rows stay in the one C++ call. Elsewhere
(float32, CUDA) the deltas are torch ops, and a step with LoRA rows cannot use the fused
call: `LlamaForCausalLM.forward` takes the per-layer Python path for it (logged once).

Residency: every registered adapter keeps its tensors in host memory; up to `max_loras`
of them also have a device copy (on CPU the host copy is the device copy). The scheduler
admits no request whose adapter would make a step need more than `max_loras` adapters;
the least recently used resident adapter not in the step makes room (logged).
"""

from __future__ import annotations

import json
import math
import re
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from kernels import cpu_kernels

if TYPE_CHECKING:
    from engine.config import LoraConfig
    from engine.models.args import ModelArgs
    from engine.request import Request


def log(message: str) -> None:
    """One line in the server's log, as the start-up facts are written (engine/engine_core.py)."""
    print(f"[pagoda] lora: {message}", file=sys.stderr, flush=True)


# The fused linear each PEFT target module's LoRA pair adds into, and its row shard there.
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
FUSED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT settings that change the adapter's arithmetic beyond plain (alpha-scaled, rsLoRA) LoRA.
_UNSUPPORTED_SETTINGS = ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
                         "layer_replication")


class LoraError(ValueError):
    """An adapter that cannot be served: unreadable, not a LoRA of this base, or too large a rank."""


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter: per (layer, fused linear), A [R, in] and B [out, R] with the
    scale folded into B, where R is the sum of the ranks of the shards it targets there (B
    is block-diagonal over the shards, so one shrink and one expand serve q, k and v)."""

    name: str
    lora_id: int
    """Unique per load (never reused): the prefix-cache key and the residency key, so a
    name reloaded with other weights never meets the old adapter's cached KV blocks."""
    path: str
    rank: int
    host: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    device_weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] | None = None
    """The device copy while resident (None otherwise); the host dict itself on CPU."""


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """What a request carries to select an adapter (SamplingParams.lora_request). It holds
    the adapter itself, so an unload does not pull the weights from under running requests."""

    name: str
    lora_id: int
    adapter: LoraAdapter = field(repr=False, compare=False)


def load_adapter(path: str | Path, name: str, lora_id: int, args: "ModelArgs", max_rank: int,
                 dtype: torch.dtype) -> LoraAdapter:
    """Read a PEFT LoRA folder into a `LoraAdapter` for a base with `args` (host tensors in `dtype`)."""
    from safetensors.torch import load_file

    folder = Path(path)
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise LoraError(f"{folder} does not hold adapter_config.json and adapter_model.safetensors (a PEFT LoRA adapter)")
    try:
        cfg = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LoraError(f"{config_path}: cannot read it: {e}") from e
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{config_path}: not a LoRA adapter (peft_type {cfg.get('peft_type')!r})")
    for key in _UNSUPPORTED_SETTINGS:
        if cfg.get(key):
            raise LoraError(f"{config_path}: {key} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{config_path}: bias={cfg['bias']!r} is not supported (only 'none')")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"{config_path}: r must be a positive integer and lora_alpha a number")
    if r > max_rank:
        raise LoraError(f"adapter {name!r} has rank {r}, above --max-lora-rank {max_rank}")
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own error types for a corrupt file
        raise LoraError(f"{weights_path}: cannot read it: {e}") from e

    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= args.num_hidden_layers:
            raise LoraError(f"{weights_path}: tensor {key!r} is not a LoRA of this model's q/k/v/o or MLP projections")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = tensor
    if not pairs:
        raise LoraError(f"{weights_path}: no LoRA weights")
    q, kv, inter, hidden = (args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim,
                            args.intermediate_size, args.hidden_size)
    shard_sizes = {"self_attn.qkv_proj": ([q, kv, kv], hidden), "self_attn.o_proj": ([hidden], q),
                   "mlp.gate_up_proj": ([inter, inter], hidden), "mlp.down_proj": ([hidden], inter)}
    per_linear: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{weights_path}: layer {layer} {module} has lora_A or lora_B but not both")
        fused, shard = TARGETS[module]
        sizes, in_features = shard_sizes[fused]
        a, b = pair["A"], pair["B"]
        if a.shape != (r, in_features) or b.shape != (sizes[shard], r):
            raise LoraError(f"{weights_path}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                            f"{tuple(b.shape)} do not fit rank {r} on this model ({in_features} -> {sizes[shard]})")
        per_linear.setdefault((layer, fused), []).append((shard, a, b))
    host = {}
    for (layer, fused), shards in per_linear.items():
        sizes, _ = shard_sizes[fused]
        shards.sort(key=lambda s: s[0])
        a_cat = torch.cat([a.float() for _, a, _ in shards])  # [R, in]
        b_diag = torch.zeros(sum(sizes), a_cat.shape[0])  # [out, R]: each shard's B in its rows and rank columns
        col = 0
        for shard, _, b in shards:
            row = sum(sizes[:shard])
            b_diag[row:row + b.shape[0], col:col + r] = b.float() * scale
            col += r
        host[(layer, fused)] = (a_cat.to(dtype).contiguous(), b_diag.to(dtype).contiguous())
    return LoraAdapter(name, lora_id, str(folder), r, host)


class LoraManager:
    """The registry of adapters (by name, shared with the server's threads under a lock),
    their residency, and the per-step row groups the model's hooks apply."""

    def __init__(self, config: "LoraConfig", model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self.config = config
        self.max_loras = config.max_loras
        self.args: "ModelArgs" = model.args
        self.dtype, self.device = dtype, device
        self._lock = threading.Lock()
        self._by_name: dict[str, LoraAdapter] = {}
        self._next_id = 1
        self._resident: OrderedDict[int, LoraAdapter] = OrderedDict()  # least recently used first
        # This step's (adapter's device weights, its rows): rows None = every row of the step.
        self.groups: list[tuple[dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]] = []
        self._logged_fused_fallback = False
        # Steps with rows of several adapters: each linear's adapters stacked into one shrink
        # and one expand (`_stack`), reused while the step's adapters stay the same.
        self._row_group: torch.Tensor | None = None
        """This step's adapter (index into the stack) of each row, -1 for base rows; None
        when the step has at most one adapter (its rows take the plain path)."""
        self._adapters: list[LoraAdapter] = []  # this step's, in stack order (lora id)
        self._stack_ids: tuple[int, ...] = ()
        self._stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]] | None] = {}
        self._masks: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}
        self.num_requests: dict[str, int] = {}
        """Requests admitted per adapter name (the server's per-adapter counters read it)."""
        self.kernel = device.type == "cpu" and dtype == torch.bfloat16 and cpu_kernels.bf16_gemv_available()
        """Whether the deltas run the C++ `lora_add` (and the fused decode call takes them)."""
        self.kernel_rows: torch.Tensor | None = None
        """This step's adapter group (index into `_kernel_adapters`) of each row, -1 for base rows."""
        self._kernel_ids: tuple[int, ...] = ()
        self._kernel_adapters: list[LoraAdapter] = []
        self._kernel_stacks: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = {}
        self._fused: list[torch.Tensor] | None = None
        for i, layer in enumerate(model.model.layers):
            for fused in FUSED_LINEARS:
                module = layer.get_submodule(fused)
                module.register_forward_hook(self._hook(i, fused))
            layer.mlp.lora = self  # its one-call bf16 MLP has no hook points (engine/models/llama.py)
        model.lora = self
        for name, path in config.lora_modules.items():
            adapter = self.add(name, path)
            log(f"adapter {name!r} (rank {adapter.rank}) from {path}")

    # ---- registry (any thread) -----------------------------------------------------------
    def add(self, name: str, path: str | Path) -> LoraAdapter:
        """Load and register an adapter; LoraError if it cannot be served or the name is taken."""
        with self._lock:
            if name in self._by_name:
                raise LoraError(f"an adapter named {name!r} is already loaded")
            lora_id = self._next_id
            self._next_id += 1
        adapter = load_adapter(path, name, lora_id, self.args, self.config.max_lora_rank, self.dtype)
        with self._lock:
            if name in self._by_name:  # loaded concurrently under the same name
                raise LoraError(f"an adapter named {name!r} is already loaded")
            self._by_name[name] = adapter
        return adapter

    def remove(self, name: str) -> bool:
        """Unregister an adapter: new requests can no longer name it; running ones finish with it."""
        with self._lock:
            return self._by_name.pop(name, None) is not None

    def request_for(self, name: str) -> LoraRequest | None:
        with self._lock:
            adapter = self._by_name.get(name)
        return None if adapter is None else LoraRequest(adapter.name, adapter.lora_id, adapter)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._by_name)

    # ---- the engine thread ---------------------------------------------------------------
    def begin_step(self, scheduled: list["Request"], num_rows: list[int]) -> None:
        """Group this step's rows by adapter (each request's rows are contiguous, in
        `scheduled` order) and make those adapters resident."""
        rows: dict[int, list[int]] = {}
        adapters: dict[int, LoraAdapter] = {}
        start = 0
        for request, n in zip(scheduled, num_rows):
            lora = request.sampling_params.lora_request
            if lora is not None:
                rows.setdefault(lora.lora_id, []).extend(range(start, start + n))
                adapters[lora.lora_id] = lora.adapter
            start += n
        self._row_group = None
        self.kernel_rows = None
        if not rows:
            self.groups = []
            return
        self._make_resident(adapters)
        if self.kernel:
            ids = tuple(sorted(rows))
            if ids != self._kernel_ids:  # the steady state of a batch keeps its adapters: the stacks are reused
                self._kernel_ids, self._kernel_stacks, self._fused = ids, {}, None
                self._kernel_adapters = [adapters[i] for i in ids]
            kernel_rows = torch.full((start,), -1, dtype=torch.int64)
            for g, lora_id in enumerate(ids):
                kernel_rows[rows[lora_id]] = g
            self.kernel_rows = kernel_rows
        self.groups = [
            (adapters[i].device_weights, None if len(r) == start else torch.tensor(r, dtype=torch.int64, device=self.device))
            for i, r in rows.items()
        ]
        if len(rows) > 1:
            # Several adapters: stacked in lora-id order, so that the next steps with the same
            # adapters (the steady state of a mixed batch) reuse the stacks.
            ids = tuple(sorted(rows))
            if ids != self._stack_ids:
                self._stack_ids, self._stacks, self._masks = ids, {}, {}
            row_group = torch.full((start,), -1, dtype=torch.int64)
            for g, lora_id in enumerate(ids):
                row_group[rows[lora_id]] = g
            self._row_group = row_group.to(self.device)
            self._masks = {}
            self._adapters = [adapters[i] for i in ids]

    def end_step(self) -> None:
        self.groups = []
        self._row_group = None
        self.kernel_rows = None

    @property
    def active(self) -> bool:
        """Whether the current step has LoRA rows (the fused decode paths cannot run it)."""
        return bool(self.groups)

    def note_fused_fallback(self) -> None:
        if not self._logged_fused_fallback:
            self._logged_fused_fallback = True
            log("steps with LoRA rows run the per-layer Python forward, not the fused C++ decode call")

    def _make_resident(self, adapters: dict[int, LoraAdapter]) -> None:
        # Unloaded adapters that no request of this step still runs leave the device first.
        with self._lock:
            registered = {a.lora_id for a in self._by_name.values()}
        for lora_id in [i for i in self._resident if i not in registered and i not in adapters]:
            self._resident.pop(lora_id).device_weights = None
        for lora_id, adapter in adapters.items():
            if lora_id in self._resident:
                self._resident.move_to_end(lora_id)
                continue
            while len(self._resident) >= self.max_loras:
                victim_id = next(i for i in self._resident if i not in adapters)  # the scheduler caps a step at max_loras
                victim = self._resident.pop(victim_id)
                victim.device_weights = None
                log(f"adapter {victim.name!r} swapped out for {adapter.name!r} (--max-loras {self.max_loras})")
            if self.device.type == "cpu":
                adapter.device_weights = adapter.host
            else:
                adapter.device_weights = {k: (a.to(self.device), b.to(self.device)) for k, (a, b) in adapter.host.items()}
            self._resident[lora_id] = adapter

    def _hook(self, layer: int, fused: str):
        key = (layer, fused)

        def add_deltas(module: nn.Module, inputs: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor | None:
            if not self.groups:
                return None
            x = inputs[0]
            if self.kernel_rows is not None and x.dtype == torch.bfloat16:  # the C++ deltas, every row at once
                stack = self._kernel_stack(key)
                if stack is not None:
                    out = out if out.is_contiguous() else out.contiguous()
                    cpu_kernels.lora_add(out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1]).contiguous(),
                                         *stack[:2], self.kernel_rows, stack[2])
                return out
            if self._row_group is not None:  # several adapters: one shrink and one expand for all rows
                stack = self._stack(key)
                if stack is not None:
                    a, b, layout = stack
                    out += ((x @ a.T) * self._mask(layout, x.dtype)) @ b.T
                return out
            for weights, rows in self.groups:
                pair = weights.get(key)
                if pair is None:
                    continue  # this adapter does not target this linear in this layer
                a, b = pair
                if rows is None:
                    out += (x @ a.T) @ b.T
                else:
                    out.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
            return out

        return add_deltas

    def _kernel_stack(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For `lora_add`: this step's adapters' A of one linear stacked ([sum r, in]), their B
        stacked in `vdpbf16ps`'s pair layout ([sum r / 2, 2 out]: pair j holds B[n][2j],
        B[n][2j + 1] side by side for each output n), each adapter's rank padded to even with a
        zero column, and each adapter's rank columns as offsets ([G + 1], an adapter that does
        not target the linear an empty range); None when none targets it."""
        if key not in self._kernel_stacks:
            pairs = [adapter.device_weights.get(key) for adapter in self._kernel_adapters]
            offsets, a_parts, b_parts = [0], [], []
            for pair in pairs:
                if pair is not None:
                    a, b = pair
                    if a.shape[0] % 2:  # a zero rank column: the pairs stay within one adapter
                        a = torch.cat([a, a.new_zeros(1, a.shape[1])])
                        b = torch.cat([b, b.new_zeros(b.shape[0], 1)], dim=1)
                    a_parts.append(a)
                    b_parts.append(b.t().reshape(a.shape[0] // 2, 2, b.shape[0]).transpose(1, 2).reshape(a.shape[0] // 2, -1))
                offsets.append(offsets[-1] + (a_parts[-1].shape[0] if pair is not None else 0))
            self._kernel_stacks[key] = None if not a_parts else (
                torch.cat(a_parts).contiguous(), torch.cat(b_parts).contiguous(), torch.tensor(offsets, dtype=torch.int64))
        return self._kernel_stacks[key]

    def fused_tensors(self, num_layers: int) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The fused decode call's LoRA arguments for this step (`kernels.cpu_kernels.bf16_decode_layers`):
        a, bt, offsets per fused linear (qkv, o, gate_up, down) and layer, an empty `a` where
        no adapter of the step targets the linear, and each row's adapter group."""
        if self._fused is None:
            empty = (torch.empty(0, 1, dtype=self.dtype), torch.empty(0, 1, dtype=self.dtype),
                     torch.zeros(len(self._kernel_ids) + 1, dtype=torch.int64))
            tensors: list[torch.Tensor] = []
            for layer in range(num_layers):
                for fused in FUSED_LINEARS:
                    stack = self._kernel_stack((layer, fused))
                    tensors.extend(stack if stack is not None else empty)
            self._fused = tensors
        return self._fused, self.kernel_rows

    def _stack(self, key: tuple[int, str]) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, int], ...]] | None:
        """This step's adapters' A of one linear stacked on the rank axis ([sum r, in]) and
        their B side by side ([out, sum r]), with the layout ((adapter index, its rank), ...);
        None when none of them targets the linear. A row's shrink output is masked to its own
        adapter's columns (`_mask`), so the expand adds only its own adapter's delta - the
        same sum as the per-adapter path, in one pair of matmuls instead of one per adapter."""
        if key not in self._stacks:
            parts = [(g, adapter.device_weights[key]) for g, adapter in enumerate(self._adapters)
                     if key in adapter.device_weights]
            self._stacks[key] = None if not parts else (
                torch.cat([a for _, (a, _) in parts]), torch.cat([b for _, (_, b) in parts], dim=1),
                tuple((g, a.shape[0]) for g, (a, _) in parts))
        return self._stacks[key]

    def _mask(self, layout: tuple[tuple[int, int], ...], dtype: torch.dtype) -> torch.Tensor:
        """[rows, sum r]: 1 where the column belongs to the row's adapter (this step's)."""
        mask = self._masks.get(layout)
        if mask is None:
            owner = torch.tensor([g for g, rank in layout for _ in range(rank)], device=self.device)
            mask = self._masks[layout] = (self._row_group[:, None] == owner[None, :]).to(dtype)
        return mask

    def step_adapters(self, running: list["Request"], waiting) -> tuple[list[str], list[str]]:
        """Names of the adapters of running and of waiting requests (the lora_requests_info metric)."""
        def names(requests) -> list[str]:
            seen = dict.fromkeys(r.sampling_params.lora_request.name for r in requests
                                 if r.sampling_params.lora_request is not None)
            return list(seen)

        return names(running), names(waiting)
