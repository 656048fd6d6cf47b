"""LoRA adapters over HTTP (vLLM's surface): a request selects an adapter by `model`,
`/v1/models` lists the base and each adapter (with `parent`), and, with
`--allow-runtime-lora-loading`, `POST /v1/load_lora_adapter` {lora_name, lora_path} and
`POST /v1/unload_lora_adapter` {lora_name} change the set at run time.

Runtime paths are read from the server's own disk, so they must resolve (symlinks
followed) under one of the `--lora-dir` roots; any other path is refused with a 400 that
says so before anything under it is read. The adapters themselves live in the engine's
registry (engine/lora.py); this module only names, checks and counts.

Metrics: `vllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters}`,
vLLM's gauge that the gateways (llm-d, Gateway API Inference Extension) read: its value
is the time of the latest update and its labels carry the comma-separated adapter names
of the running and the waiting requests; and `pagoda:lora_requests_total{lora_name}`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from engine.lora import LoraError, LoraRequest, log
from engine.stats import StepStats
from server.errors import InvalidRequestError, ModelNotFoundError, NotFoundError
from server.protocol import ModelCard, _Request
from server.serving import parse_request, read_body

if TYPE_CHECKING:
    from server.serving import OpenAIServing



class LoadLoraAdapterRequest(_Request):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Request):
    lora_name: str
    lora_int_id: int | None = None
    """vLLM's field; accepted and unused (adapters are named by lora_name)."""


class LoraMetrics:
    """The LoRA series, in the server's registry; only a server with LoRA on has them."""

    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int) -> None:
        self.max_loras = str(max_loras)
        self.info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests (value: time of the update).",
                          ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=registry)
        self.requests = Counter("pagoda:lora_requests", "Requests admitted, by LoRA adapter name.",
                                ["model_name", "lora_name"], registry=registry)
        self.model_name = model_name
        self.info.labels(self.max_loras, "", "").set_to_current_time()

    def on_step(self, stats: StepStats) -> None:
        """From the engine thread, after each step: the adapters running and waiting now."""
        if stats.lora_adapters is None:
            return
        running, waiting = stats.lora_adapters
        self.info.labels(self.max_loras, ",".join(waiting), ",".join(running)).set_to_current_time()


class LoraServing:
    def __init__(self, serving: "OpenAIServing") -> None:
        self.serving = serving
        self.loras = serving.engine.loras  # None: LoRA off
        config = serving.engine.config.lora
        self.allow_runtime = config.allow_runtime_lora_loading
        self.roots = [Path(os.path.realpath(root)) for root in config.lora_dir]
        self.metrics: LoraMetrics | None = None
        if self.loras is not None:
            self.metrics = LoraMetrics(serving.metrics.registry, serving.model_name, config.max_loras)
            serving.metrics.lora = self.metrics

    def lora_request(self, model: str | None, count: bool = False) -> LoraRequest | None:
        """The adapter `model` names (None: the base model); 404 for a model neither the base
        nor a loaded adapter. `count`: a request is admitted with it (the per-adapter counter)."""
        serving = self.serving
        if model is None or model == serving.model_name:
            return None
        lora = self.loras.request_for(model) if self.loras is not None else None
        if lora is None:
            served = [serving.model_name, *(self.loras.names() if self.loras is not None else [])]
            raise ModelNotFoundError(
                f"the model {model!r} does not exist; this server serves {', '.join(map(repr, served))}", param="model"
            )
        if count and self.metrics is not None:
            self.metrics.requests.labels(serving.model_name, lora.name).inc()
        return lora

    def model_cards(self) -> list[ModelCard]:
        serving = self.serving
        if self.loras is None:
            return []
        return [ModelCard(id=name, created=serving.created, root=name, parent=serving.model_name,
                          max_model_len=serving.max_model_len) for name in self.loras.names()]

    def _check_runtime(self) -> None:
        if self.loras is None or not self.allow_runtime:
            raise NotFoundError("runtime LoRA loading is off; start the server with --allow-runtime-lora-loading "
                                "(and --lora-dir roots) to use it", code="lora_runtime_loading_disabled")

    def _check_path(self, lora_path: str) -> str:
        """The path resolved under a --lora-dir root, or a 400 that names the roots (nothing is read)."""
        if not self.roots:
            raise InvalidRequestError("no --lora-dir root is set, so runtime loading accepts no path", param="lora_path")
        resolved = Path(os.path.realpath(lora_path))
        if not any(resolved == root or resolved.is_relative_to(root) for root in self.roots):
            raise InvalidRequestError(
                f"lora_path {lora_path!r} is outside the allowed --lora-dir roots "
                f"({', '.join(str(r) for r in self.roots)})", param="lora_path")
        return str(resolved)

    async def load(self, request: Request) -> Response:
        self._check_runtime()
        body = await read_body(request, self.serving.config.max_body_bytes)
        req = parse_request(body, LoadLoraAdapterRequest)
        if not req.lora_name or req.lora_name == self.serving.model_name:
            raise InvalidRequestError(f"lora_name must be a non-empty name other than the base model's, got "
                                      f"{req.lora_name!r}", param="lora_name")
        path = self._check_path(req.lora_path)
        try:
            adapter = await asyncio.to_thread(self.loras.add, req.lora_name, path)
        except LoraError as e:
            raise InvalidRequestError(str(e), param="lora_path") from e
        log(f"adapter {adapter.name!r} (rank {adapter.rank}) loaded from {path}")
        return PlainTextResponse(f"Success: LoRA adapter '{adapter.name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        self._check_runtime()
        body = await read_body(request, self.serving.config.max_body_bytes)
        req = parse_request(body, UnloadLoraAdapterRequest)
        if not self.loras.remove(req.lora_name):
            raise NotFoundError(f"no LoRA adapter named {req.lora_name!r} is loaded", param="lora_name",
                                code="lora_not_found")
        log(f"adapter {req.lora_name!r} unloaded")
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
