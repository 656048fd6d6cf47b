"""The FastAPI app: OpenAI routes over one `AsyncEngine`, SSE streams, auth, limits.

`build_app(engine, config, metrics)` wires it; `pagoda serve` (server/cli.py) runs it
under uvicorn. The request path: read the body (size-capped) -> parse JSON (NaN,
infinity and lone surrogates refused) -> pydantic model -> tokenize / render the chat
template in a worker thread -> `engine.validate` -> `engine.generate` -> JSON or SSE.
Every failure leaves through `server/errors.py` as the OpenAI error envelope.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import hmac
import importlib.metadata
import logging
import queue
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_engine import AsyncEngine, QueueFullError
from engine.engine_core import ContextLengthExceeded
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import (
    AuthenticationError,
    ClientDisconnectedError,
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestTooLargeError,
    ServiceUnavailableError,
    error_envelope,
    install_exception_handlers,
    sse_error_event,
    validation_error,
)
from server.metrics import Metrics
from server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    chat_logprobs,
    completion_logprobs,
    parse_json_object,
)

logger = logging.getLogger("pagoda.server")
T = TypeVar("T")
_M = TypeVar("_M", bound=BaseModel)

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
"""Routes that answer without an API key (probes and scrapers carry none)."""
_SSE_DONE = b"data: [DONE]\n\n"
_PARSE_INLINE_MAX_BYTES = 64 * 1024


@dataclass(slots=True)
class ServerConfig:
    served_model_name: str | None = None
    """The name clients put in `model`; default: the model folder's name."""
    api_key: str | None = None
    """With a key, every route except /health, /metrics and /version needs `Authorization: Bearer KEY`."""
    max_body_bytes: int = 4 * 2**20
    """Largest request body; 4 MiB holds 64 prompts of 8k token ids as JSON."""
    max_n: int = 16
    """Largest `n` (samples per prompt)."""
    health_stall_timeout_s: float = 30.0
    """/health answers 503 when work is pending and no step finished for this long."""
    tokenizer_threads: int = 2
    """Worker threads (each with its own tokenizer copy) for tokenization and chat templates."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.health_stall_timeout_s <= 0:
            raise ValueError(f"health_stall_timeout_s must be > 0, got {self.health_stall_timeout_s}")
        if self.tokenizer_threads < 1:
            raise ValueError(f"tokenizer_threads must be >= 1, got {self.tokenizer_threads}")


def pagoda_version() -> str:
    try:
        return importlib.metadata.version("pagoda-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# ---- tokenization off the event loop ----------------------------------------------------------
class TokenizerPool:
    """Runs tokenization and chat-template rendering in worker threads.

    A long prompt takes milliseconds to tokenize, which would stall every stream if done
    on the event loop. HF fast tokenizers are not safe to share between threads mid-call
    (transformers toggles truncation state on the Rust object), so each worker borrows
    its own copy; the engine loop keeps the original for detokenization.
    """

    def __init__(self, tokenizer: Any, num_threads: int) -> None:
        self._free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        for _ in range(num_threads):
            self._free.put(copy.deepcopy(tokenizer))
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="pagoda-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...]) -> T:
        # As many copies as threads, so this never waits.
        tokenizer = self._free.get()
        try:
            return fn(tokenizer, *args)
        finally:
            self._free.put(tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


@dataclass(slots=True)
class PromptInput:
    token_ids: list[int]
    text: str | None
    """The prompt as text (for echo); None when not needed."""
    params: SamplingParams
    """The request's params, with max_tokens resolved for this prompt when it was open."""


# ---- request bodies ----------------------------------------------------------------------------
async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refusing more than `max_bytes` - by Content-Length before reading, and
    by counting while reading (chunked bodies have no Content-Length)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequestError("invalid Content-Length header")
        if int(declared) > max_bytes:
            raise RequestTooLargeError(f"the request body ({declared} bytes) exceeds the limit of {max_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise RequestTooLargeError(f"the request body exceeds the limit of {max_bytes} bytes")
    return bytes(body)


def parse_request(body: bytes, model: type[_M]) -> _M:
    obj = parse_json_object(body)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors()) from e


async def read_request(request: Request, model: type[_M], max_bytes: int) -> _M:
    body = await read_body(request, max_bytes)
    if len(body) > _PARSE_INLINE_MAX_BYTES:
        # Parsing megabytes of token ids takes tens of milliseconds: not on the event loop.
        return await asyncio.to_thread(parse_request, body, model)
    return parse_request(body, model)


# ---- auth ----------------------------------------------------------------------------------------
class APIKeyMiddleware:
    """`Authorization: Bearer KEY` on every route but the open ones (pure ASGI: no
    per-chunk overhead on streams, unlike BaseHTTPMiddleware)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        scheme, _, token = given.partition(b" ")
        # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send 'Authorization: Bearer KEY'" if not given else "incorrect API key provided"
        error = AuthenticationError(message)
        response = JSONResponse(error.envelope(), status_code=error.status_code, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def _new_logprobs(c: CompletionOutput, num_sent: int) -> list[dict[int, Logprob]]:
    # `c.logprobs` is the engine's live list (it may already hold later steps' entries);
    # `c.token_ids` is this step's snapshot, so it bounds what belongs to this output.
    return c.logprobs[num_sent : len(c.token_ids)] if c.logprobs is not None else []


def _sse(chunk: BaseModel) -> bytes:
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


class Admission:
    """Queue places a request holds between the server's capacity check and the moment
    its engine streams start (only then does the engine count them).

    Without it, requests checked in the same moment could all pass and the later ones
    fail inside their already-started streams; with it, every refusal is a plain 503.
    """

    def __init__(self, server: "OpenAIServer", num_places: int) -> None:
        self.server = server
        self.num_places = num_places
        server.num_reserved += num_places

    def release(self, num_places: int) -> None:
        num_places = min(num_places, self.num_places)
        self.num_places -= num_places
        self.server.num_reserved -= num_places

    def release_all(self) -> None:
        self.release(self.num_places)


async def _admitted(gen: AsyncIterator[RequestOutput], admission: Admission, n: int) -> AsyncIterator[RequestOutput]:
    # Hand the places to the engine in the same synchronous run as generate()'s own
    # capacity check (which happens at its first __anext__), so nothing runs in between.
    admission.release(n)
    async with aclosing(gen):
        async for out in gen:
            yield out


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave the engine streams of several prompts as (prompt index, output).

    Closing this iterator closes every engine stream, which aborts what is unfinished.
    """
    if len(gens) == 1:
        async with aclosing(gens[0]) as gen:
            async for out in gen:
                yield 0, out
        return
    outputs: asyncio.Queue[tuple[int, RequestOutput | None] | BaseException] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(gen):
                async for out in gen:
                    outputs.put_nowait((i, out))
            outputs.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            outputs.put_nowait(e)

    tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await outputs.get()
            if isinstance(item, BaseException):
                raise item
            i, out = item
            if out is None:
                remaining -= 1
            else:
                yield i, out
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next ASGI message is the disconnect (uvicorn sends
    # one when the client closes, or once our response completed).
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the OpenAI-compatible server ----------------------------------------------------------------
class OpenAIServer:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        core = engine.core
        self.model_name = config.served_model_name or core.model_path.name
        self.model_root = str(core.model_path)
        self.vocab_size = core.model.args.vocab_size
        self.max_model_len = engine.max_model_len
        # Tokens the KV cache holds: a request longer than that could never run.
        self.cache_tokens = core.num_blocks * engine.config.cache.block_size
        self.created = int(time.time())
        # Read before the engine loop starts: the tokenizer is the engine thread's after that.
        self.special_ids = frozenset(engine.tokenizer.all_special_ids)
        self.num_reserved = 0
        self.engine_death_logged = False
        """Queue places admitted but not yet handed to the engine (see Admission)."""
        self.tokenizers = TokenizerPool(engine.tokenizer, config.tokenizer_threads)

    # ---- shared checks -----------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def admit(self, num_children: int) -> Admission:
        """Refuse before a stream starts (so it is a 503, not an error event mid-stream)."""
        engine = self.engine
        if not engine.is_alive:
            self.log_engine_death()
            raise ServiceUnavailableError("the engine is not running", code="engine_dead")
        if engine.num_unfinished + self.num_reserved + num_children > engine.max_waiting_requests:
            raise QueueFullError(f"the server is at its limit of {engine.max_waiting_requests} queued requests")
        return Admission(self, num_children)

    def sampling_params(self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if req.n > self.config.max_n:
            raise InvalidRequestError(f"n must be at most {self.config.max_n}, got {req.n}", param="n")
        logit_bias = None
        if req.logit_bias:
            logit_bias = {}
            for key, value in req.logit_bias.items():
                if not key.isdigit() or int(key) >= self.vocab_size:
                    raise InvalidRequestError(
                        f"logit_bias keys must be token ids in [0, {self.vocab_size}), got {key!r}", param="logit_bias"
                    )
                logit_bias[int(key)] = value
        if req.stop_token_ids and max(req.stop_token_ids) >= self.vocab_size:
            raise InvalidRequestError(f"stop_token_ids must be in [0, {self.vocab_size})", param="stop_token_ids")
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k or 0,
                min_p=req.min_p or 0.0,
                seed=req.seed,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias=logit_bias,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=req.stop_list,
                stop_token_ids=list(req.stop_token_ids or []),
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as e:
            raise _params_error(e) from e

    def fit_open_max_tokens(self, token_ids: list[int], params: SamplingParams, prompt_param: str) -> SamplingParams:
        """No max_tokens: run to the end of the context - or of the KV cache, when that
        holds less, so that the request can run at all."""
        limit = min(self.max_model_len, self.cache_tokens)
        room = limit - len(token_ids)
        if room < 1:
            raise ContextLengthError(
                f"this model's maximum context length is {limit} tokens, but the prompt has {len(token_ids)}",
                param=prompt_param,
            )
        try:
            return dataclasses.replace(params, max_tokens=room)
        except ValueError as e:
            raise _params_error(e) from e

    def validate_prompt(self, token_ids: list[int], params: SamplingParams, prompt_param: str) -> None:
        """engine.validate with the field to blame: the prompt if it alone does not fit."""
        try:
            self.engine.validate(token_ids, params)
        except ContextLengthExceeded as e:
            param = prompt_param if len(token_ids) >= self.max_model_len else "max_tokens"
            raise ContextLengthError(str(e), param=param) from e
        except ValueError as e:
            param = prompt_param if "prompt" in str(e) else "max_tokens"
            raise InvalidRequestError(str(e), param=param) from e

    async def until_disconnected(self, request: Request, work: Awaitable[T]) -> T:
        """Await `work` unless the client leaves first; then cancel it (aborting its engine
        requests, whose blocks are freed at the next step) and count the disconnect."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            self.metrics.record_client_disconnect()
            raise ClientDisconnectedError("the client disconnected")
        finally:
            task.cancel()
            watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)

    def hidden_ids(self, req: SamplingRequest) -> frozenset[int]:
        """Tokens whose logprob entries read "": those the text leaves out."""
        return self.special_ids if req.skip_special_tokens else frozenset()

    def usage(self, prompts: list[PromptInput], num_completion_tokens: int) -> UsageInfo:
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
        )

    def start_streams(
        self, request_id: str, prompts: list[PromptInput]
    ) -> tuple[AsyncIterator[tuple[int, RequestOutput]], Admission]:
        """The merged engine streams of all prompts (they start when first iterated) and
        their admission, which the caller releases once done, in case they never started."""
        admission = self.admit(sum(p.params.n for p in prompts))
        gens = [
            _admitted(self.engine.generate(f"{request_id}-{i}", p.token_ids, p.params), admission, p.params.n)
            for i, p in enumerate(prompts)
        ]
        return _merge(gens), admission

    async def collect(self, stream: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int, n: int):
        """The final CompletionOutput of every (prompt, sample)."""
        finals: list[list[CompletionOutput | None]] = [[None] * n for _ in range(num_prompts)]
        async with aclosing(stream):
            async for i, out in stream:
                for c in out.outputs:
                    finals[i][c.index] = c
        return finals

    # ---- /v1/completions -------------------------------------------------------------------
    async def create_completion(self, request: Request) -> Response:
        req = await read_request(request, CompletionRequest, self.config.max_body_bytes)
        self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise echo_with_logprobs_unsupported()
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        prompts = await self.tokenizers.run(self._tokenize_completion, req.prompts, req.echo, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream, admission = self.start_streams(request_id, prompts)
        if req.stream:
            return _sse_response(self._completion_stream(req, request_id, created, prompts, stream), admission)
        try:
            finals = await self.until_disconnected(request, self.collect(stream, len(prompts), req.n))
        finally:
            admission.release_all()
        choices = []
        num_completion_tokens = 0
        for i, prompt in enumerate(prompts):
            for j, c in enumerate(finals[i]):
                assert c is not None  # the engine stream ends only when every sample finished
                num_completion_tokens += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = completion_logprobs(c.logprobs or [], 0, self.hidden_ids(req))[0]
                choices.append(
                    CompletionChoice(
                        index=i * req.n + j,
                        text=(prompt.text or "") + c.text if req.echo else c.text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                    )
                )
        response = CompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=self.usage(prompts, num_completion_tokens),
        )
        return _json_response(response)

    def _tokenize_completion(self, tokenizer: Any, raw: list[str | list[int]], echo: bool, params: SamplingParams) -> list[PromptInput]:
        prompts = []
        for i, prompt in enumerate(raw):
            where = "prompt" if len(raw) == 1 else f"prompt {i}"
            if isinstance(prompt, str):
                token_ids, text = tokenizer.encode(prompt), prompt
            else:
                token_ids = list(prompt)
                if max(token_ids) >= self.vocab_size:
                    raise InvalidRequestError(f"{where}: token ids must be in [0, {self.vocab_size})", param="prompt")
                text = tokenizer.decode(token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) if echo else None
            if not token_ids:
                raise InvalidRequestError(f"{where} is empty: it tokenizes to no tokens", param="prompt")
            prompt_params = params if params.max_tokens is not None else self.fit_open_max_tokens(token_ids, params, "prompt")
            self.validate_prompt(token_ids, prompt_params, "prompt")
            prompts.append(PromptInput(token_ids, text, prompt_params))
        return prompts

    async def _completion_stream(
        self, req: CompletionRequest, request_id: str, created: int, prompts: list[PromptInput],
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        n = req.n
        num_choices = len(prompts) * n
        num_logprobs_sent = [0] * num_choices
        text_offsets = [0] * num_choices
        num_tokens = [0] * num_choices
        started = [False] * num_choices
        hidden_ids = self.hidden_ids(req)
        completed = False
        try:
            async with aclosing(stream):
                async for i, out in stream:
                    for c in out.outputs:
                        index = i * n + c.index
                        text = c.delta_text
                        if req.echo and not started[index]:
                            text = (prompts[i].text or "") + text
                        started[index] = True
                        num_tokens[index] = len(c.token_ids)
                        logprobs = None
                        if req.logprobs is not None:
                            new = _new_logprobs(c, num_logprobs_sent[index])
                            num_logprobs_sent[index] += len(new)
                            if new:
                                logprobs, text_offsets[index] = completion_logprobs(new, text_offsets[index], hidden_ids)
                        if not text and logprobs is None and c.finish_reason is None:
                            continue
                        chunk = CompletionStreamResponse(
                            id=request_id, created=created, model=self.model_name,
                            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                      finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                        )
                        yield _sse(chunk)
            if req.include_usage:
                usage_chunk = CompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name, choices=[],
                    usage=self.usage(prompts, sum(num_tokens)),
                )
                yield _sse(usage_chunk)
            completed = True
            yield _SSE_DONE
        except Exception as e:  # noqa: BLE001 - after the headers, errors can only be events
            completed = True
            yield sse_error_event(e)
            yield _SSE_DONE
        finally:
            if not completed:
                self.metrics.record_client_disconnect()

    # ---- /v1/chat/completions --------------------------------------------------------------
    async def create_chat_completion(self, request: Request) -> Response:
        req = await read_request(request, ChatCompletionRequest, self.config.max_body_bytes)
        self.check_model(req.model)
        top_k = req.top_logprobs or 0
        params = self.sampling_params(req, req.output_limit, top_k if req.logprobs else None)
        prompt = await self.tokenizers.run(self._tokenize_chat, req, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        stream, admission = self.start_streams(request_id, [prompt])
        if req.stream:
            return _sse_response(self._chat_stream(req, request_id, created, prompt, stream), admission)
        try:
            finals = (await self.until_disconnected(request, self.collect(stream, 1, req.n)))[0]
        finally:
            admission.release_all()
        choices = []
        num_completion_tokens = 0
        for c in finals:
            assert c is not None  # the engine stream ends only when every sample finished
            num_completion_tokens += len(c.token_ids)
            choices.append(
                ChatChoice(
                    index=c.index,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=chat_logprobs(c.logprobs or [], top_k, self.hidden_ids(req)) if req.logprobs else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name, choices=choices,
            usage=self.usage([prompt], num_completion_tokens),
        )
        return _json_response(response)

    def _tokenize_chat(self, tokenizer: Any, req: ChatCompletionRequest, params: SamplingParams) -> PromptInput:
        token_ids = render_chat(tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message)
        if not token_ids:
            raise InvalidRequestError("the messages render to no tokens", param="messages")
        if params.max_tokens is None:
            params = self.fit_open_max_tokens(token_ids, params, "messages")
        self.validate_prompt(token_ids, params, "messages")
        return PromptInput(token_ids, None, params)

    async def _chat_stream(
        self, req: ChatCompletionRequest, request_id: str, created: int, prompt: PromptInput,
        stream: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[bytes]:
        top_k = req.top_logprobs or 0
        hidden_ids = self.hidden_ids(req)
        num_logprobs_sent = [0] * req.n
        num_tokens = [0] * req.n
        completed = False

        def chunk(index: int, delta: dict[str, str], logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
            return _sse(
                ChatCompletionStreamResponse(
                    id=request_id, created=created, model=self.model_name,
                    choices=[ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                              finish_reason=finish_reason, stop_reason=stop_reason)],
                )
            )

        try:
            for index in range(req.n):
                yield chunk(index, {"role": "assistant", "content": ""})
            async with aclosing(stream):
                async for _, out in stream:
                    for c in out.outputs:
                        num_tokens[c.index] = len(c.token_ids)
                        logprobs = None
                        if req.logprobs:
                            new = _new_logprobs(c, num_logprobs_sent[c.index])
                            num_logprobs_sent[c.index] += len(new)
                            if new:
                                logprobs = chat_logprobs(new, top_k, hidden_ids)
                        if c.delta_text or logprobs is not None:
                            yield chunk(c.index, {"content": c.delta_text}, logprobs)
                        if c.finish_reason is not None:
                            yield chunk(c.index, {}, None, c.finish_reason, c.stop_reason)
            if req.include_usage:
                yield _sse(
                    ChatCompletionStreamResponse(
                        id=request_id, created=created, model=self.model_name, choices=[],
                        usage=self.usage([prompt], sum(num_tokens)),
                    )
                )
            completed = True
            yield _SSE_DONE
        except Exception as e:  # noqa: BLE001 - after the headers, errors can only be events
            completed = True
            yield sse_error_event(e)
            yield _SSE_DONE
        finally:
            if not completed:
                self.metrics.record_client_disconnect()

    # ---- /tokenize, /detokenize, /v1/models ------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        req = await read_request(request, TokenizeRequest, self.config.max_body_bytes)
        self.check_model(req.model)

        def run(tokenizer: Any) -> list[int]:
            if req.messages is not None:
                return render_chat(tokenizer, req.messages, req.add_generation_prompt, req.continue_final_message)
            return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)

        tokens = await self.tokenizers.run(run)
        return _json_response(TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.max_model_len))

    async def detokenize(self, request: Request) -> Response:
        req = await read_request(request, DetokenizeRequest, self.config.max_body_bytes)
        self.check_model(req.model)
        if req.tokens and max(req.tokens) >= self.vocab_size:
            raise InvalidRequestError(f"tokens must be in [0, {self.vocab_size})", param="tokens")
        text = await self.tokenizers.run(
            lambda tokenizer: tokenizer.decode(req.tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )
        return _json_response(DetokenizeResponse(prompt=text))

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, root=self.model_root, max_model_len=self.max_model_len)

    def models(self) -> Response:
        return _json_response(ModelList(data=[self.model_card()]))

    def model(self, model: str) -> Response:
        self.check_model(model)
        return _json_response(self.model_card())

    def log_engine_death(self) -> None:
        """Once: the engine loop's fault, with its traceback, for whoever reads the log."""
        if not self.engine_death_logged and self.engine.error is not None:
            self.engine_death_logged = True
            logger.error("the engine loop died; every request now fails with 503", exc_info=self.engine.error)

    def health(self) -> Response:
        engine = self.engine
        if not engine.is_alive:
            self.log_engine_death()
            reason = "the engine loop is not running"
            if engine.error is not None:
                reason += f" ({type(engine.error).__name__}: {engine.error})"
        elif (stalled := engine.seconds_since_progress()) > self.config.health_stall_timeout_s:
            reason = f"the engine loop made no progress for {stalled:.0f} s"
        else:
            return Response(status_code=200)
        envelope = error_envelope(reason, "server_error", None, "engine_unhealthy")
        return JSONResponse(envelope, status_code=503)


def echo_with_logprobs_unsupported() -> InvalidRequestError:
    """The one place that refuses echo + logprobs: the engine does not compute prompt
    logprobs yet. Once it does, the prompt tokens' entries (the first one null) go in
    front of the generated ones and this check goes away."""
    return InvalidRequestError("echo with logprobs is not supported yet", param="echo")


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> list[int]:
    conversation = [m.for_template() for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except (jinja2.TemplateError, ValueError) as e:
        # The template's own raise_exception (e.g. "roles must alternate") and a missing template.
        raise InvalidRequestError(f"cannot apply the chat template: {e}", param="messages") from e
    # The template writes the special tokens itself.
    return tokenizer.encode(text, add_special_tokens=False)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _params_error(e: ValueError) -> InvalidRequestError:
    # SamplingParams messages start with the field name ("top_p must be in (0, 1]...").
    first = str(e).split(" ", 1)[0].strip("(")
    return InvalidRequestError(str(e), param=first if first in _SAMPLING_FIELDS else None)


def _json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json().encode(), media_type="application/json")


def _sse_response(stream: AsyncIterator[bytes], admission: Admission) -> StreamingResponse:
    response = _ClosingStreamingResponse(
        stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    response.admission = admission
    return response


class _ClosingStreamingResponse(StreamingResponse):
    """Closes the body iterator however the response ends.

    When the client leaves while our generator is parked at a `yield` (its chunk being
    sent), Starlette cancels the send and drops the generator; its cleanup would then
    wait for garbage collection. Closing it here aborts the engine requests now.
    """

    admission: Admission | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            if self.admission is not None:  # a stream that never started still held places
                self.admission.release_all()


# ---- the app -----------------------------------------------------------------------------------
def build_app(engine: AsyncEngine, config: ServerConfig | None = None, metrics: Metrics | None = None) -> FastAPI:
    """The FastAPI app over `engine`, which the app's lifespan starts and shuts down.

    Pass the `Metrics` whose `on_step` the engine reports to; without one, a fresh one is
    hooked to the engine here.
    """
    config = config or ServerConfig()
    if metrics is None:
        metrics = Metrics(config.served_model_name or engine.core.model_path.name, max_model_len=engine.max_model_len)
        engine.core.on_step = metrics.on_step
    server = OpenAIServer(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)
            server.tokenizers.shutdown()

    app = FastAPI(title="Pagoda", version=pagoda_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    install_exception_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.create_chat_completion(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return server.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        return server.model(model)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await server.detokenize(request)

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": pagoda_version()})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        body, content_type = metrics.render()
        return Response(body, headers={"Content-Type": content_type})

    return app
