"""One streamed request to an OpenAI-compatible server, timed token by token.

Every request streams (``stream: true``) so time to first token and the gaps between
tokens are seen as a user sees them. The output token count is the server's own
``usage.completion_tokens`` (asked for with ``stream_options.include_usage``); a server
that sends no usage gets the number of content chunks instead, and the result says so.

Failures never raise: each becomes a result with an ``error_kind`` (``http_503``,
``connect_error``, ``connection_lost``, ``timeout``, ``stream_error``, ``incomplete_stream``,
``bad_response``), so a dying server shows up as errors in the report, not as a hang.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import httpx

from loadtest.datasets import BenchRequest

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"


@dataclass(slots=True)
class RequestParams:
    """What every request of a run carries besides its prompt and ``max_tokens``."""

    model: str | None
    temperature: float = 0.0
    include_usage: bool = True
    # Fields that make the output length fixed on this server, as a function of max_tokens:
    # {"ignore_eos": True}, {"min_tokens": n}, ... (see loadtest.compat).
    fixed_length_fields: Callable[[int], dict] | None = None
    request_timeout_s: float = 600.0

    def body(self, req: BenchRequest) -> tuple[str, dict]:
        body: dict = {"max_tokens": req.max_tokens, "temperature": self.temperature, "stream": True}
        if self.model:
            body["model"] = self.model
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.fixed_length_fields is not None:
            body.update(self.fixed_length_fields(req.max_tokens))
        if req.is_chat:
            body["messages"] = list(req.messages)
            return CHAT_PATH, body
        body["prompt"] = req.prompt
        return COMPLETIONS_PATH, body


@dataclass(slots=True)
class RequestResult:
    ok: bool
    start_s: float  # when it was sent, seconds after the run started
    e2e_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between content chunks
    output_tokens: int = 0
    prompt_tokens: int | None = None
    tokens_from_usage: bool = False
    finish_reason: str | None = None
    max_tokens: int = 0
    error_kind: str | None = None
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for one-token outputs)."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class _Failure(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def send_request(client: httpx.AsyncClient, req: BenchRequest, params: RequestParams, run_start: float) -> RequestResult:
    """Send ``req`` as a streamed request and time it; never raises for server failures."""
    path, body = params.body(req)
    t0 = time.perf_counter()
    result = RequestResult(ok=False, start_s=t0 - run_start, e2e_s=0.0, max_tokens=req.max_tokens)
    try:
        await asyncio.wait_for(_stream(client, path, body, req.is_chat, t0, result), params.request_timeout_s)
        result.ok = True
    except _Failure as e:
        result.error_kind, result.error = e.kind, str(e)
    except (asyncio.TimeoutError, httpx.TimeoutException) as e:
        result.error_kind, result.error = "timeout", f"{type(e).__name__}: {e}"
    except httpx.ConnectError as e:
        result.error_kind, result.error = "connect_error", str(e) or type(e).__name__
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        result.error_kind, result.error = "connection_lost", str(e) or type(e).__name__
    except httpx.HTTPError as e:
        result.error_kind, result.error = "http_error", f"{type(e).__name__}: {e}"
    result.e2e_s = time.perf_counter() - t0
    return result


async def _stream(client: httpx.AsyncClient, path: str, body: dict, is_chat: bool, t0: float, result: RequestResult) -> None:
    last = t0
    chunks = 0
    done = False
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            raise _Failure(f"http_{response.status_code}", _error_message(text))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except json.JSONDecodeError as e:
                raise _Failure("bad_response", f"a stream chunk is not JSON: {payload[:200]!r}") from e
            if not isinstance(chunk, dict):
                raise _Failure("bad_response", f"a stream chunk is not an object: {payload[:200]!r}")
            if "error" in chunk:
                raise _Failure("stream_error", _error_message(json.dumps(chunk)))
            now = time.perf_counter()
            for choice in chunk.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") if is_chat else choice.get("text")
                if text:
                    if result.ttft_s is None:
                        result.ttft_s = now - t0
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    chunks += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
            usage = chunk.get("usage")
            if usage:
                result.output_tokens = int(usage.get("completion_tokens") or 0)
                result.prompt_tokens = usage.get("prompt_tokens")
                result.tokens_from_usage = True
    # Some servers (transformers serve) end the stream after the finish chunk without [DONE].
    if not done and result.finish_reason is None:
        raise _Failure("incomplete_stream", "the stream ended before a finish_reason or [DONE]")
    if not result.tokens_from_usage:
        result.output_tokens = chunks


def _error_message(text: str) -> str:
    """The message of an OpenAI error envelope (or FastAPI's detail), else the text itself."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:300]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
        if body.get("detail"):
            return str(body["detail"])[:300]
    return text[:300]
