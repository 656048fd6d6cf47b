"""Typed HTTP errors and the OpenAI error envelope.

Everything below the edge raises typed exceptions (`ValueError`, `QueueFullError`, ...);
only here do they become status codes and `{"error": {message, type, param, code}}`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from engine.async_engine import EngineDeadError, QueueFullError, QueueTimeoutError, RequestTimeoutError
from engine.engine_core import ContextLengthExceeded, StepFailedError
from engine.structured_output import GrammarError

logger = logging.getLogger("pagoda.server")

# Seconds a client should wait before retrying after a 503 (queue full, queue timeout, draining).
RETRY_AFTER_S = 1


def retry_after() -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)}


class APIError(Exception):
    """An error with its HTTP status and envelope fields; raised anywhere in `server/`."""

    status_code = 400
    error_type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self, message: str, param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers

    def envelope(self) -> dict[str, Any]:
        return error_envelope(self.message, self.error_type, self.param, self.code)


class InvalidRequestError(APIError):
    """400: a field is missing, malformed or out of range."""


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class AuthenticationError(APIError):
    # OpenAI answers a bad key with type invalid_request_error and code invalid_api_key.
    status_code = 401
    code = "invalid_api_key"


class NotFoundError(APIError):
    status_code = 404
    code = "not_found"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"


class MethodNotAllowedError(APIError):
    status_code = 405
    code = "method_not_allowed"


class RequestTooLargeError(APIError):
    status_code = 413
    code = "request_too_large"


class RateLimitError(APIError):
    """429: over a limit of the caller's API key (server/rate_limit.py); OpenAI's envelope
    has type "requests" or "tokens" and code rate_limit_exceeded, with Retry-After."""

    status_code = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, error_type: str, headers: dict[str, str]) -> None:
        super().__init__(message, headers=headers)
        self.error_type = error_type


class ServiceUnavailableError(APIError):
    """503: the queue is full, the engine is unhealthy or the server is draining."""

    status_code = 503
    error_type = "server_error"
    code = "service_unavailable"


class RequestTimeoutAPIError(APIError):
    """504: the request ran past --request-timeout and was aborted."""

    status_code = 504
    error_type = "server_error"
    code = "request_timeout"


class ClientDisconnectedError(APIError):
    """The client left before the response (nobody reads it; the status is for the log)."""

    status_code = 499
    code = "client_disconnected"


class InternalServerError(APIError):
    status_code = 500
    error_type = "server_error"
    code = "internal_error"


def error_envelope(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def to_api_error(exc: BaseException) -> APIError:
    """Translate any exception from a request's path into the APIError a client sees."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError):
        return ServiceUnavailableError(str(exc), code="queue_full", headers=retry_after())
    if isinstance(exc, QueueTimeoutError):
        return ServiceUnavailableError(str(exc), code="queue_timeout", headers=retry_after())
    if isinstance(exc, RequestTimeoutError):
        return RequestTimeoutAPIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(str(exc), code="engine_dead")
    if isinstance(exc, GrammarError):
        # Raised by the engine's stream: the output could not follow the request's grammar.
        return InvalidRequestError(str(exc), param=exc.param, code="grammar_not_followed")
    if isinstance(exc, ContextLengthExceeded):
        return ContextLengthError(str(exc))
    if isinstance(exc, StepFailedError):
        # The engine ended this request (and logged nothing): log it, answer 500.
        logger.error("an engine step failed; its requests were ended", exc_info=exc.__cause__ or exc)
        return InternalServerError(str(exc), code="engine_step_failed")
    if isinstance(exc, ValidationError):
        return validation_error(exc.errors())
    if isinstance(exc, ClientDisconnect):
        return ClientDisconnectedError("the client disconnected")
    logger.error("unexpected error while serving a request", exc_info=exc)
    return InternalServerError(f"internal server error ({type(exc).__name__})")


def error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error as its route answers it: Anthropic's envelope on the Messages API routes
    (`path`), OpenAI's everywhere else."""
    if is_anthropic_path(path):
        return JSONResponse(anthropic_envelope(error), status_code=anthropic_status(error), headers=error.headers)
    return JSONResponse(error.envelope(), status_code=error.status_code, headers=error.headers)


def sse_error_event(exc: BaseException) -> bytes:
    """An error after a stream started: one `data:` event with the envelope (then [DONE])."""
    return b"data: " + json.dumps(to_api_error(exc).envelope()).encode() + b"\n\n"


# ---- Anthropic's envelope, on the Messages API routes ----------------------------------------
ANTHROPIC_ROUTE = "/v1/messages"
_OVERLOADED = frozenset({"queue_full", "queue_timeout", "server_draining"})
"""503 codes that are Anthropic's 529 overloaded_error: come back later (retry-after kept)."""
_ANTHROPIC_TYPES = {
    401: "authentication_error", 403: "permission_error", 404: "not_found_error", 413: "request_too_large",
    429: "rate_limit_error", 504: "timeout_error", 529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


def anthropic_status(error: APIError) -> int:
    """Anthropic's status: 529 for an overloaded server, 500 for any other 5xx but a
    timeout (504), the OpenAI routes' status otherwise."""
    if error.status_code == 503:
        return 529 if error.code in _OVERLOADED else 500
    return error.status_code


def anthropic_envelope(error: APIError) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`. Anthropic's envelope has no
    `param`: the message starts with the field it is about."""
    status = anthropic_status(error)
    error_type = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    message = error.message
    if error.param and error.param not in message:
        message = f"{error.param}: {message}"
    return {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_sse_error_event(exc: BaseException) -> bytes:
    """An error after a Messages stream started: Anthropic's `error` event."""
    return b"event: error\ndata: " + json.dumps(anthropic_envelope(to_api_error(exc))).encode() + b"\n\n"


# ---- pydantic errors -> 400 with `param` naming the field ------------------------------------
def param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """`("messages", 2, "content", ...)` -> "messages[2].content"; union tags are dropped.

    Pydantic puts the union member it tried into `loc` ("str", "list[int]", ...); only
    the request's own field names and list indexes say where the problem is.
    """
    if not loc:
        return None
    param = str(loc[0])
    for part in loc[1:]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _PYDANTIC_TAGS:
            param += f".{part}"
        else:
            break
    return param


def _most_specific(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The error worth reporting: a union reports every member it tried ("should be a
    valid string" for a list that is merely too long); a range or custom error says more
    than a type mismatch, and of type mismatches the deepest one points at the bad item."""
    specific = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    if specific:
        return specific[0]
    return max(errors, key=lambda e: len(e.get("loc", ())))


_PYDANTIC_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"})


def validation_error(errors: list[dict[str, Any]]) -> InvalidRequestError:
    if not errors:
        return InvalidRequestError("invalid request")
    first = _most_specific(errors)
    loc = tuple(p for p in first.get("loc", ()) if p != "body")
    param = param_from_loc(loc)
    msg = str(first.get("msg", "invalid value"))
    # Custom validators raise ValueError("..."), which pydantic prefixes with "Value error, ".
    msg = msg.removeprefix("Value error, ")
    if first.get("type") == "missing":
        msg = f"'{param}' is a required field"
    elif first.get("type") == "extra_forbidden":
        msg = f"unknown field '{param}'"
    elif param and not msg.startswith(param):
        msg = f"{param}: {msg}"
    return InvalidRequestError(msg, param=param)


# ---- handlers -------------------------------------------------------------------------------
def install_exception_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc), request.url.path)

    async def on_request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())), request.url.path)

    async def on_http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            error: APIError = NotFoundError(f"route {request.method} {request.url.path} not found")
        elif exc.status_code == 405:
            error = MethodNotAllowedError(
                f"method {request.method} not allowed for {request.url.path}", headers=dict(exc.headers or {})
            )
        else:
            error = APIError(str(exc.detail), code=None, headers=dict(exc.headers or {}))
            error.status_code = exc.status_code
            error.error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(error, request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(to_api_error(exc), request.url.path)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(QueueFullError, on_api_error)
    app.add_exception_handler(QueueTimeoutError, on_api_error)
    app.add_exception_handler(RequestTimeoutError, on_api_error)
    app.add_exception_handler(EngineDeadError, on_api_error)
    app.add_exception_handler(ContextLengthExceeded, on_api_error)
    app.add_exception_handler(StepFailedError, on_api_error)
    app.add_exception_handler(ClientDisconnect, on_api_error)
    app.add_exception_handler(RequestValidationError, on_request_validation)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected)
