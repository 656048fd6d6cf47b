"""The FastAPI app: the routes over one `AsyncEngine`, auth, exception handlers.

`build_app(engine, config, metrics)` wires it; `pagoda serve` (server/cli.py) runs it
under uvicorn. The request path: read the body (size-capped) -> parse JSON (NaN,
infinity and lone surrogates refused) -> pydantic model -> tokenize / render the chat
template in a worker thread -> `engine.validate` -> `engine.generate` -> JSON or SSE
(server/serving*.py). Every failure leaves through `server/errors.py` as the OpenAI
error envelope.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import signal
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine
from server.config import ServerConfig
from server.errors import (
    AuthenticationError,
    InvalidRequestError,
    error_envelope,
    error_response,
    install_exception_handlers,
    retry_after,
)
from server.metrics import Metrics
from server.openapi import install_openapi
from server.protocol import ModelCard, ModelList, parse_json_object
from server.response_store import ResponseStore
from server.serving import OpenAIServing, json_response, read_body
from server.serving_chat import ChatServing
from server.serving_completion import CompletionServing
from server.serving_lora import LoraServing
from server.serving_messages import MessagesServing
from server.request_id import RequestIdMiddleware
from server.serving_render import RenderServing
from server.serving_responses import OWNER_STATE, ResponsesServing
from server.serving_tokenize import TokenizeServing
from server.tenants import LIMITER_STATE, TENANT_STATE, KeyRegistry

logger = logging.getLogger("pagoda.server")

__all__ = ["ServerConfig", "build_app", "pagoda_version"]

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version"})
"""Routes that answer without an API key (probes and scrapers carry none)."""


def pagoda_version() -> str:
    try:
        return importlib.metadata.version("pagoda-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- auth ----------------------------------------------------------------------------------------
class APIKeyMiddleware:
    """`Authorization: Bearer KEY`, or `X-Api-Key: KEY` (Anthropic-style clients and
    gateways send it), on every route but the open ones (pure ASGI: no per-chunk overhead
    on streams, unlike BaseHTTPMiddleware). A Bearer key is the one checked when both come.

    The key is looked up in the `KeyRegistry` (`--api-key` and `--api-keys-file`, compared
    in constant time); the request's scope then carries its owner id (the Responses store)
    and its tenant, and every response to a key with rate limits carries OpenAI's
    `x-ratelimit-*` headers, read when the response starts."""

    def __init__(self, app: ASGIApp, keys: KeyRegistry) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = x_api_key = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
            elif name == b"x-api-key":
                x_api_key = value.strip()
        scheme, _, token = given.partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        key = token.strip() if scheme.lower() == b"bearer" and token.strip() else x_api_key
        tenant = self.keys.authenticate(key) if key else None
        if tenant is None:
            message = ("missing API key: send 'Authorization: Bearer KEY' or 'X-Api-Key: KEY'"
                       if not (given or x_api_key) else "incorrect API key provided")
            error = AuthenticationError(message, headers={"WWW-Authenticate": "Bearer"})
            await error_response(error, scope["path"])(scope, receive, send)
            return
        limiter = self.keys.limiter(tenant)
        state = scope.setdefault("state", {})
        state[OWNER_STATE] = tenant.owner
        state[TENANT_STATE] = tenant
        state[LIMITER_STATE] = limiter
        if limiter is None:
            await self.app(scope, receive, send)
            return

        async def send_with_limits(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *limiter.headers()]}
            await send(message)

        await self.app(scope, receive, send_with_limits)


def install_reload_on_sighup(keys: KeyRegistry) -> None:
    """SIGHUP re-reads the keys file (parsed off the event loop, put in force on it): see
    KeyRegistry.reload_off_loop."""
    if keys.path is None:
        return
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, keys.schedule_reload)
    except (NotImplementedError, RuntimeError, ValueError) as e:  # not the main thread, or no SIGHUP (Windows)
        logger.warning("SIGHUP will not reload the API keys file here: %s", e)


# ---- the endpoints that do not generate ----------------------------------------------------------
def _with_body(request: Request, body: bytes) -> Request:
    """`request` with its already-read body to be read again (the /invocations dispatch
    reads it to pick the route); later messages (the disconnect) come from the client."""
    replayed = False

    async def receive() -> dict[str, Any]:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await request.receive()

    return Request(request.scope, receive)


def model_card(serving: OpenAIServing) -> ModelCard:
    return ModelCard(
        id=serving.model_name, created=serving.created, root=serving.model_root, max_model_len=serving.max_model_len
    )


def health(serving: OpenAIServing) -> Response:
    engine = serving.engine
    if serving.draining:
        envelope = error_envelope("the server is shutting down", "server_error", None, "server_draining")
        return JSONResponse(envelope, status_code=503, headers=retry_after())
    if not engine.is_alive:
        serving.log_engine_death()
        reason = "the engine loop is not running"
        if engine.error is not None:
            reason += f" ({type(engine.error).__name__}: {engine.error})"
    elif (stalled := engine.seconds_since_progress()) > serving.config.health_stall_timeout_s:
        reason = f"the engine loop made no progress for {stalled:.0f} s"
    else:
        return Response(status_code=200)
    envelope = error_envelope(reason, "server_error", None, "engine_unhealthy")
    return JSONResponse(envelope, status_code=503)


# ---- the app -----------------------------------------------------------------------------------
def build_app(
    engine: AsyncEngine, config: ServerConfig | None = None, metrics: Metrics | None = None,
    keys: KeyRegistry | None = None,
) -> FastAPI:
    """The FastAPI app over `engine`, which the app's lifespan starts and shuts down.

    Pass the `Metrics` whose `on_step` the engine reports to; without one, a fresh one is
    hooked to the engine here. `keys`: the API keys (`pagoda serve` reads the keys file
    before loading the model, so a bad file fails fast); without them, read from `config`.
    """
    config = config or ServerConfig()
    if metrics is None:
        metrics = Metrics(config.served_model_name or engine.model_path.name, max_model_len=engine.max_model_len)
        engine.set_step_hook(metrics.on_step)
    serving = OpenAIServing(engine, config, metrics)
    completion_serving = CompletionServing(serving)
    chat_serving = ChatServing(serving)
    responses_serving = ResponsesServing(
        serving, chat_serving, ResponseStore(config.responses_store_size, config.responses_store_ttl_s,
                                           max_bytes=config.responses_store_bytes)
    )
    tokenize_serving = TokenizeServing(serving, chat_serving)
    render_serving = RenderServing(serving, chat_serving, completion_serving)
    messages_serving = MessagesServing(serving, chat_serving)
    lora_serving = LoraServing(serving)
    if lora_serving.loras is not None:
        serving.lora = lora_serving

    keys = keys if keys is not None else KeyRegistry(config.api_keys_file, config.api_key)
    serving.keys = keys
    metrics.set_api_keys(keys.names)
    keys.on_reload = lambda named: metrics.set_api_keys([t.name for t in named])

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        install_reload_on_sighup(keys)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)
            serving.tokenizers.shutdown()

    app = FastAPI(title="Pagoda", version=pagoda_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    install_exception_handlers(app)
    install_openapi(app)
    if keys.enabled:
        app.add_middleware(APIKeyMiddleware, keys=keys)
    # Outermost: a refused key's 401 carries the request's id too.
    app.add_middleware(RequestIdMiddleware)

    @app.post("/v1/completions")
    async def completions_route(request: Request) -> Response:
        return await completion_serving.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions_route(request: Request) -> Response:
        return await chat_serving.create_chat_completion(request)

    # llama.cpp serves its OpenAI routes without the /v1 prefix too; its clients use both.
    app.add_api_route("/completions", completions_route, methods=["POST"], include_in_schema=False)
    app.add_api_route("/chat/completions", chat_completions_route, methods=["POST"], include_in_schema=False)

    @app.post("/invocations", include_in_schema=False)
    async def invocations_route(request: Request) -> Response:
        # SageMaker's inference route, dispatched by the body's shape as vLLM does.
        body = await read_body(request, config.max_body_bytes)
        shape = parse_json_object(body)
        replayed = _with_body(request, body)
        if "messages" in shape:
            return await chat_serving.create_chat_completion(replayed)
        if "prompt" in shape:
            return await completion_serving.create_completion(replayed)
        raise InvalidRequestError(
            "an /invocations body needs messages (a chat completion) or prompt (a completion)", param="messages")

    @app.post("/v1/responses")
    async def responses_route(request: Request) -> Response:
        return await responses_serving.create_response(request)

    @app.get("/v1/responses/{response_id}")
    async def response_route(request: Request, response_id: str) -> Response:
        return responses_serving.get_response(request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response_route(request: Request, response_id: str) -> Response:
        return responses_serving.delete_response(request, response_id)

    # Anthropic's Messages API; its errors use Anthropic's envelope (server/errors.py).
    @app.post("/v1/messages")
    async def messages_route(request: Request) -> Response:
        return await messages_serving.create_message(request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens_route(request: Request) -> Response:
        return await messages_serving.count_tokens(request)

    @app.get("/v1/models")
    async def models_route() -> Response:
        return json_response(ModelList(data=[model_card(serving), *lora_serving.model_cards()]))

    app.add_api_route("/models", models_route, methods=["GET"], include_in_schema=False)  # llama.cpp's path

    @app.get("/v1/models/{model:path}")
    async def model_route(model: str) -> Response:
        serving.check_model(model)
        card = next((c for c in lora_serving.model_cards() if c.id == model), None)
        return json_response(card or model_card(serving))

    # vLLM's runtime adapter API (server/serving_lora.py), behind --allow-runtime-lora-loading.
    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter_route(request: Request) -> Response:
        return await lora_serving.load(request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter_route(request: Request) -> Response:
        return await lora_serving.unload(request)

    # vLLM's render routes (server/serving_render.py): the token ids a request would prefill.
    @app.post("/v1/completions/render")
    async def render_completion_route(request: Request) -> Response:
        return await render_serving.render_completion(request)

    @app.post("/v1/chat/completions/render")
    async def render_chat_route(request: Request) -> Response:
        return await render_serving.render_chat(request)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize_serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await tokenize_serving.detokenize(request)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> Response:
        # vLLM's route, for clients that tokenize remotely (lm-eval): server/tokenizer_info.py
        from server.tokenizer_info import tokenizer_info

        return await tokenizer_info(serving, chat_serving.chat_template)

    @app.get("/health")
    async def health_route() -> Response:
        return health(serving)

    # SageMaker's health probe (vLLM serves it too): the same answer as /health.
    app.add_api_route("/ping", health_route, methods=["GET", "POST"], include_in_schema=False)

    @app.get("/version")
    async def version_route() -> Response:
        return JSONResponse({"version": pagoda_version()})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return app
