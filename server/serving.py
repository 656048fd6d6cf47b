"""What completions and chat share between the HTTP request and the engine streams.

Reading the body (size-capped) and validating it, tokenizing in worker threads, turning a
request into `SamplingParams`, admission against the engine's queue limits, merging the
engine streams of several prompts, usage, and the JSON / SSE responses. The endpoint
logic lives in `serving_completion.py` and `serving_chat.py`.

Admission runs in two steps, each before the next expensive one: queue places for the
request's samples before tokenizing (so a full queue costs no tokenizer time), then its
prompt tokens right after tokenizing, before anything reaches the engine.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from engine.async_engine import AsyncEngine
from engine.engine_core import ContextLengthExceeded
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_output import GrammarError, StructuredOutputSpec
from server.config import ServerConfig
from server.errors import (
    ClientDisconnectedError,
    ContextLengthError,
    InternalServerError,
    InvalidRequestError,
    ModelNotFoundError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
    retry_after,
    sse_error_event,
    validation_error,
)
from server.metrics import Metrics
from server.protocol import PromptTokensDetails, SamplingRequest, UsageInfo, parse_json_object
from server.protocol_vllm import check_stop_token_ids, logit_bias_token_ids, num_logprobs, truncate_prompt
from server.rate_limit import CONCURRENCY_RETRY_AFTER_S, KeyLimiter, RateLimitExceeded, retry_after_headers
from server.tenants import TENANT_QUEUE_RESERVE, Tenant, request_tenant

logger = logging.getLogger("pagoda.server")
T = TypeVar("T")
_M = TypeVar("_M", bound=BaseModel)

SSE_DONE = b"data: [DONE]\n\n"
_PARSE_INLINE_MAX_BYTES = 64 * 1024


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
    first_token: str | None = None
    """The first token's text, for echo with logprobs: nothing predicts it, so the
    engine's prompt logprobs have no entry (and no text) for it."""


@dataclass(slots=True)
class PromptResult:
    """What the engine reports once per prompt; sample 0's outputs carry it."""

    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def update(self, out: RequestOutput) -> None:
        if any(c.index == 0 for c in out.outputs):
            self.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                self.prompt_logprobs = out.prompt_logprobs


def prompt_entries(prompt: PromptInput, result: PromptResult) -> list[dict[int, Logprob] | None]:
    """The engine's prompt logprob entries, one per prompt token (None first)."""
    entries = result.prompt_logprobs
    if entries is None or len(entries) != len(prompt.token_ids):
        # Misaligned entries would pair logprobs with the wrong tokens: fail loudly instead.
        got = "none" if entries is None else len(entries)
        raise InternalServerError(f"the engine returned {got} prompt logprobs for {len(prompt.token_ids)} prompt tokens")
    return entries


# ---- request bodies ----------------------------------------------------------------------------
MAX_CONTENT_LENGTH_DIGITS = 18
"""Longest Content-Length read (leading zeros count): past it the header is a 400."""


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refusing more than `max_bytes` - by Content-Length before reading, and
    by counting while reading (chunked bodies have no Content-Length)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        # ASCII digits only (str.isdigit() takes "²"), and few enough for int(): Python refuses
        # to parse more than 4,300 digits, and no body this server takes has 19.
        if not (declared.isascii() and declared.isdigit()) or len(declared) > MAX_CONTENT_LENGTH_DIGITS:
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
    """The body as `model`: 400 naming the field for anything invalid or refused. Fields
    `model` does not know are ignored (as vLLM), each name logged once per process."""
    from server.protocol import log_unknown_fields

    obj = parse_json_object(body)
    log_unknown_fields(model, obj)
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


# ---- engine streams ----------------------------------------------------------------------------
class Admission:
    """Queue places (samples) and prompt tokens a request holds between the server's
    capacity checks and the moment its engine streams start (only then does the engine
    count them).

    Without it, requests checked in the same moment could all pass and the later ones
    fail inside their already-started streams; with it, every refusal is a plain 503.
    """

    def __init__(
        self, serving: "OpenAIServing", num_places: int, tenant: Tenant | None = None,
        limiter: KeyLimiter | None = None, priority: int = 0,
    ) -> None:
        self.serving = serving
        self.num_places = num_places
        self.num_tokens = 0
        serving.num_reserved += num_places
        self.tenant = tenant
        """The caller's API key (None without keys); its name tags the engine requests."""
        self.limiter = limiter
        """The key's rate limits (None: none); holds a concurrency slot until release_all."""
        self.priority = priority
        """The scheduling priority the request runs at (lower first)."""
        self._slot_held = limiter is not None
        self._num_samples = num_places
        """What the key's concurrency limit counts until release_all."""
        if self.tenant_name is not None:
            reserved = serving.reserved_by_tenant
            reserved[self.tenant_name] = reserved.get(self.tenant_name, 0) + num_places

    @property
    def tenant_name(self) -> str | None:
        return None if self.tenant is None else self.tenant.name

    def charge_output(self, num_tokens: int) -> None:
        """Completion tokens the engine produced: they count against the key's limit (never
        refused) and in its per-key series."""
        if self.limiter is not None:
            self.limiter.charge_tokens(num_tokens)
        if self.tenant_name is not None and num_tokens > 0:
            self.serving.metrics.record_tenant_tokens(self.tenant_name, generation=num_tokens)

    def add_tokens(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        self.serving.num_reserved_tokens += num_tokens

    def release(self, num_places: int, num_tokens: int) -> None:
        num_places = min(num_places, self.num_places)
        num_tokens = min(num_tokens, self.num_tokens)
        self.num_places -= num_places
        self.num_tokens -= num_tokens
        self.serving.num_reserved -= num_places
        self.serving.num_reserved_tokens -= num_tokens
        if self.tenant_name is not None and num_places:
            reserved = self.serving.reserved_by_tenant
            reserved[self.tenant_name] -= num_places
            if not reserved[self.tenant_name]:
                del reserved[self.tenant_name]

    def release_all(self) -> None:
        """The request is over (or never started): everything it held goes back, its
        key's concurrency slot included."""
        self.release(self.num_places, self.num_tokens)
        if self._slot_held:
            self._slot_held = False
            self.limiter.release(self._num_samples)


async def _admitted(
    gen: AsyncIterator[RequestOutput], admission: Admission, n: int, num_tokens: int,
) -> AsyncIterator[RequestOutput]:
    """The engine stream, its output tokens charged to the caller's key as they come."""
    # Hand the places to the engine in the same synchronous run as generate()'s own
    # capacity check (which happens at its first __anext__), so nothing runs in between.
    admission.release(n, num_tokens)
    num_generated: dict[int, int] = {}
    async with aclosing(gen):
        async for out in gen:
            for c in out.outputs:
                admission.charge_output(len(c.token_ids) - num_generated.get(c.index, 0))
                num_generated[c.index] = len(c.token_ids)
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


# ---- the shared state and checks of the OpenAI endpoints -------------------------------------
class OpenAIServing:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: Metrics) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_name or engine.model_path.name
        # The folder's name, not its path: where the server keeps its files is no client's business.
        self.model_root = engine.model_path.name
        self.vocab_size = engine.vocab_size
        self.max_model_len = engine.max_model_len
        # Tokens the KV cache holds: a request longer than that could never run.
        self.cache_tokens = engine.num_kv_blocks * engine.config.cache.block_size
        self.created = int(time.time())
        # Read before the engine loop starts: the tokenizer is the engine thread's after that.
        self.special_ids = frozenset(engine.tokenizer.all_special_ids)
        self.num_reserved = 0
        self.reserved_by_tenant: dict[str, int] = {}
        """Named key -> its queue places admitted but not yet handed to the engine (`Admission`)."""
        """Queue places admitted but not yet handed to the engine (see Admission)."""
        self.num_reserved_tokens = 0
        """Prompt tokens admitted but not yet handed to the engine."""
        self.draining = False
        """Set on SIGTERM (server/shutdown.py): new requests get 503, /health too."""
        self.keys = None
        """The API keys (server/tenants.py `KeyRegistry`), set by build_app."""
        self.lora = None
        """The LoRA adapters a request's `model` may name (server/serving_lora.py `LoraServing`),
        set by build_app when LoRA is on."""
        self.engine_death_logged = False
        self._engine_id_counter = 0
        self.tokenizers = TokenizerPool(engine.tokenizer, config.tokenizer_threads)
        engine.set_grammar_compile_hook(metrics.on_grammar_compiled)
        metrics.set_engine_info(engine.facts)
        cache = engine.config.cache
        metrics.set_cache_config(cache.block_size, engine.num_kv_blocks, cache.kv_cache_dtype,  # vLLM's label values
                                 cache.enable_prefix_caching)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            if self.lora is not None:
                self.lora.lora_request(model)  # a loaded adapter, else 404
                return
            raise ModelNotFoundError(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}", param="model"
            )

    def log_engine_death(self) -> None:
        """Once: the engine loop's fault, with its traceback, for whoever reads the log."""
        if not self.engine_death_logged and self.engine.error is not None:
            self.engine_death_logged = True
            logger.error("the engine loop died; every request now fails with 503", exc_info=self.engine.error)

    @property
    def num_in_flight(self) -> int:
        """Samples admitted and not finished: in the engine, or on their way to it."""
        return self.engine.num_unfinished + self.num_reserved

    def admit(self, num_children: int, request: Request | None = None, priority: int | None = None) -> Admission:
        """Queue places for a request's samples, taken before tokenizing; refused here (a
        503) rather than inside a started stream (an error event). Then the caller's key
        (from `request`'s scope) is held to its limits (429) and `priority` to its bounds (400)."""
        engine = self.engine
        if self.draining:
            raise ServiceUnavailableError("the server is shutting down", code="server_draining", headers=retry_after())
        if not engine.is_alive:
            self.log_engine_death()
            raise ServiceUnavailableError("the engine is not running", code="engine_dead")
        if num_children > engine.max_waiting_requests:
            # Could never fit: a 503 would have the client retry forever.
            raise InvalidRequestError(
                f"the request asks for {num_children} samples (prompts x n) but this server queues at most "
                f"{engine.max_waiting_requests}",
                param="n",
            )
        engine.check_capacity(num_children, 0, self.num_reserved)
        tenant, limiter = request_tenant(request.scope.get("state", {})) if request is not None else (None, None)
        priority = self.resolve_priority(priority, tenant)
        name = None if tenant is None else tenant.name
        if name is not None:
            self._check_tenant_share(name, num_children)
        if limiter is not None:
            try:
                limiter.admit_request(num_children)
            except RateLimitExceeded as e:
                raise self._rate_limited(name, e) from None
            except ValueError as e:  # more samples than the key may ever have in flight
                raise InvalidRequestError(str(e), param="n") from None
        if name is not None:
            self.metrics.record_tenant_request(name)
        return Admission(self, num_children, tenant, limiter, priority)

    @property
    def tenant_queue_share(self) -> int:
        """The most samples one named key may have unfinished: the queue bound less a
        quarter of it, which stays open to the other keys (TENANT_QUEUE_RESERVE)."""
        limit = self.engine.max_waiting_requests
        return max(1, limit - int(limit * TENANT_QUEUE_RESERVE))

    def _check_tenant_share(self, name: str, num_samples: int) -> None:
        """One key cannot fill the queue: past its share, its requests wait (429) while the
        other keys' are still admitted; a request larger than the share never fits (400)."""
        share = self.tenant_queue_share
        if num_samples > share:
            raise InvalidRequestError(
                f"the request asks for {num_samples} samples (prompts x n) but one API key may have at most "
                f"{share} unfinished on this server", param="n")
        held = self.engine.unfinished_by_tenant.get(name, 0) + self.reserved_by_tenant.get(name, 0)
        if held + num_samples > share:
            self.metrics.record_tenant_rejection(name, "queue_share")
            raise RateLimitError(
                f"this API key has {held} samples unfinished and asks for {num_samples} more, past its share of the "
                f"queue ({share} of {self.engine.max_waiting_requests}); retry when some finish", "requests",
                retry_after_headers(CONCURRENCY_RETRY_AFTER_S))

    def resolve_priority(self, requested: int | None, tenant: Tenant | None) -> int:
        """The priority a request runs at: the one it asks for, else its key's. A named key's
        priority is also the most urgent its requests may ask for (lower is more urgent)."""
        if self.engine.config.scheduler.scheduling_policy == "fcfs":
            if requested not in (None, 0):
                raise InvalidRequestError(
                    "priority is not supported: this server schedules first come, first served "
                    "(--scheduling-policy fcfs)", param="priority")
            return 0
        floor = tenant.priority if tenant is not None and tenant.name is not None else None
        if requested is None:
            return floor or 0
        if floor is not None and requested < floor:
            raise InvalidRequestError(
                f"priority {requested} is more urgent than this API key allows: its requests may ask for "
                f"{floor} or more (lower is more urgent)", param="priority")
        return requested

    def _rate_limited(self, tenant_name: str | None, e: RateLimitExceeded) -> RateLimitError:
        if tenant_name is not None:
            self.metrics.record_tenant_rejection(tenant_name, e.kind)
        error_type = "tokens" if e.kind == "tokens" else "requests"
        return RateLimitError(e.message, error_type, retry_after_headers(e.retry_after_s))

    async def tokenize(
        self, admission: Admission, fn: Callable[..., list[PromptInput]], *args: Any
    ) -> list[PromptInput]:
        """`fn(tokenizer, *args)` in a tokenizer thread, then the prompts' tokens join the
        admission (503 when they do not fit); on any failure the admission is released."""
        try:
            prompts = await self.tokenizers.run(fn, *args)
            num_tokens = sum(len(p.token_ids) for p in prompts)
            self.engine.check_capacity(0, num_tokens, self.num_reserved, self.num_reserved_tokens)
            if admission.limiter is not None:
                try:
                    admission.limiter.admit_tokens(num_tokens)
                except RateLimitExceeded as e:
                    admission.limiter.refund_request()  # refused: the request does not count either
                    raise self._rate_limited(admission.tenant_name, e) from None
                except ValueError as e:
                    raise InvalidRequestError(str(e)) from None
            if admission.tenant_name is not None:
                self.metrics.record_tenant_tokens(admission.tenant_name, prompt=num_tokens)
            admission.add_tokens(num_tokens)
            return prompts
        except BaseException:
            admission.release_all()
            raise

    def sampling_params(
        self, req: SamplingRequest, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
        structured_output: StructuredOutputSpec | None = None,
    ) -> SamplingParams:
        if req.n > self.config.max_n:
            raise InvalidRequestError(f"n must be at most {self.config.max_n}, got {req.n}", param="n")
        logit_bias = logit_bias_token_ids(req.logit_bias, self.vocab_size) if req.logit_bias else None
        check_stop_token_ids(req.stop_token_ids, self.vocab_size)
        # Resolved here, where the request is admitted: an adapter unloaded since check_model is a 404, not the base.
        lora_request = self.lora.lora_request(req.model, count=True) if self.lora is not None else None
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
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens,
                structured_output=structured_output,
                use_beam_search=bool(req.use_beam_search),
                length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
                lora_request=lora_request,
            )
        except ValueError as e:
            if str(e).startswith("structured_output"):  # beam search: name the field that asked for a grammar
                raise InvalidRequestError(str(e), param=structured_output.param or "response_format") from e
            raise _params_error(e) from e

    async def prepare_structured_output(
        self, spec: StructuredOutputSpec | None, kind: str | None = None, count: bool = True
    ) -> None:
        """Compile the request's grammar (or find it compiled) before its stream starts: an
        invalid one, or one past --grammar-compile-timeout, is a 400 naming its field. A
        compile runs on the engine's compile threads, so it delays only this request.
        `count`: a request that will run (not a render) counts in the structured-output metric."""
        if spec is None:
            return
        try:
            await self.engine.prepare_structured_output(spec, self.config.grammar_compile_timeout_s)
        except GrammarError as e:
            # Compiles are shared and cached by content, failures included: the error may
            # have been raised for an earlier request that sent the same grammar in another
            # field, so the field to name is this request's.
            raise InvalidRequestError(str(e), param=spec.param or e.param) from e
        if count:
            self.metrics.record_structured_request(kind or spec.kind)

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

    def num_logprobs(self, value: int | None, param: str) -> int | None:
        """A request's logprobs count for the engine (-1: the vocabulary), held to --max-logprobs."""
        return num_logprobs(value, param, self.vocab_size, self.config.max_logprobs)

    def as_token_ids(self, req: SamplingRequest) -> bool:
        """Whether logprob tokens read `token_id:N`: the request's choice, else --return-tokens-as-token-ids."""
        value = req.return_tokens_as_token_ids
        return self.config.return_tokens_as_token_ids if value is None else value

    def truncate(self, token_ids: list[int], req: SamplingRequest) -> list[int]:
        """The prompt cut to its last `truncate_prompt_tokens` tokens (vLLM's field), if set."""
        return truncate_prompt(token_ids, req.truncate_prompt_tokens, self.max_model_len)

    def usage(self, prompts: list[PromptInput], results: list[PromptResult], num_completion_tokens: int) -> UsageInfo:
        num_prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return UsageInfo(
            prompt_tokens=num_prompt_tokens,
            completion_tokens=num_completion_tokens,
            total_tokens=num_prompt_tokens + num_completion_tokens,
            # Per prompt, not per sample: samples 1..n-1 share sample 0's prompt blocks.
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens for r in results)),
        )

    @staticmethod
    def chunk_usage(num_prompt_tokens: int, num_completion_tokens: int) -> UsageInfo:
        """The usage a stream chunk carries under vLLM's `continuous_usage_stats`: one
        choice's prompt and its completion tokens so far (the stream's last chunk still
        carries the whole request's, cached tokens included)."""
        return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                         total_tokens=num_prompt_tokens + num_completion_tokens)

    def deadline(self, arrival: float) -> float | None:
        """The `time.monotonic()` by which a request that arrived at `arrival` must end."""
        timeout = self.config.request_timeout_s
        return None if timeout is None else arrival + timeout

    def engine_request_id(self, response_id: str, from_client: bool) -> str:
        """The engine's id of a request whose response is `response_id`: the same, unless
        the client chose it (X-Request-Id, server/request_id.py), which another running
        request may share: then with a suffix unique to this server process."""
        if not from_client:
            return response_id
        self._engine_id_counter += 1
        return f"{response_id}~{self._engine_id_counter}"

    def start_streams(
        self, request_id: str, prompts: list[PromptInput], cache_salt: str | None, admission: Admission, arrival: float,
        endpoint: str,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """The merged engine streams of all prompts; they start when first iterated, taking
        their places from `admission` (which the caller releases once done, in case they
        never started). Each sample's end is counted under `endpoint` in the metrics, with
        the finish reason the engine gave it (as `request_success_total` counts it), even
        when the client left after the engine finished; a prompt's tokens count once."""
        deadline = self.deadline(arrival)

        def on_sample_end(num_prompt_tokens: int) -> Callable[[int, CompletionOutput | None], None]:
            def record(index: int, c: CompletionOutput | None) -> None:
                self.metrics.record_endpoint_request(
                    endpoint, c.finish_reason if c is not None and c.finish_reason else "abort",
                    num_prompt_tokens if index == 0 else 0, len(c.token_ids) if c is not None else 0,
                    time.monotonic() - arrival)
            return record

        gens = [
            _admitted(
                self.engine.generate(
                    f"{request_id}-{i}", p.token_ids, p.params, cache_salt, deadline, self.config.max_queue_time_s,
                    admission.tenant_name, admission.priority, on_sample_end(len(p.token_ids)),
                ),
                admission,
                p.params.n,
                len(p.token_ids),
            )
            for i, p in enumerate(prompts)
        ]
        return _merge(gens)

    def stop_sample(self, request_id: str, prompt_index: int, index: int) -> None:
        """End sample `index` of prompt `prompt_index` of `start_streams(request_id, ...)` now,
        as stopped: the endpoint found its output complete (the duplicate tool-call guard).
        Its stream still gets a last output."""
        self.engine.stop(f"{request_id}-{prompt_index}", index)

    async def collect(
        self, stream: AsyncIterator[tuple[int, RequestOutput]], num_prompts: int, n: int,
        on_output: Callable[[int, CompletionOutput], None] | None = None,
    ) -> tuple[list[list[CompletionOutput]], list[PromptResult]]:
        """The final CompletionOutput of every (prompt, sample), and what each prompt reported.
        `on_output(prompt index, output)` sees every step's output as it comes (to read it
        while it is generated, e.g. to stop a sample early)."""
        finals: list[list[CompletionOutput | None]] = [[None] * n for _ in range(num_prompts)]
        results = [PromptResult() for _ in range(num_prompts)]
        async with aclosing(stream):
            async for i, out in stream:
                results[i].update(out)
                for c in out.outputs:
                    finals[i][c.index] = c
                    if on_output is not None:
                        on_output(i, c)
        # The engine streams end only when every sample finished, so none is left None.
        return finals, results  # type: ignore[return-value]

    async def sse_events(
        self, events: AsyncIterator[bytes], done: bytes = SSE_DONE,
        error_event: Callable[[BaseException], bytes] = sse_error_event,
    ) -> AsyncIterator[bytes]:
        """`events`, then `done` (`[DONE]`; the Responses API sends nothing). After the
        headers an error can only be an event (`error_event`); a client that leaves before
        the end counts as a disconnect."""
        completed = False
        try:
            async with aclosing(events):
                async for event in events:
                    yield event
            completed = True
            if done:
                yield done
        except Exception as e:  # noqa: BLE001 - after the headers, errors can only be events
            completed = True
            yield error_event(e)
            if done:
                yield done
        finally:
            if not completed:
                self.metrics.record_client_disconnect()


def new_logprobs(c: CompletionOutput, num_sent: int) -> list[dict[int, Logprob]]:
    """The logprob entries of `c` not sent yet."""
    # `c.logprobs` is the engine's live list (it may already hold later steps' entries);
    # `c.token_ids` is this step's snapshot, so it bounds what belongs to this output.
    return c.logprobs[num_sent : len(c.token_ids)] if c.logprobs is not None else []


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _params_error(e: ValueError) -> InvalidRequestError:
    # SamplingParams messages start with the field name ("top_p must be in (0, 1]...").
    first = str(e).split(" ", 1)[0].strip("(")
    return InvalidRequestError(str(e), param=first if first in _SAMPLING_FIELDS else None)


# ---- responses -----------------------------------------------------------------------------------
def sse_event(chunk: BaseModel) -> bytes:
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json().encode(), media_type="application/json")


def sse_response(stream: AsyncIterator[bytes], admission: Admission) -> StreamingResponse:
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
