"""`X-Request-Id`: a gateway's trace id honoured, echoed and carried into the response id.

Gateways and proxies (SMG, llm-d, Envoy, nginx's `$request_id`) tag each request with an
`X-Request-Id` header and log it; so does vLLM, whose completion and chat responses take it
as their id (`chatcmpl-<X-Request-Id>`). Pagoda does the same (`response_id`): every
response carries the header back (the client's, or a fresh one when it sent none), and the
completion and chat routes name their response `cmpl-<id>` / `chatcmpl-<id>`, so one id lines
up the gateway's log, the client's and the response.

The id is checked before anything else reads the request: 1 to 128 visible ASCII characters
(no spaces or control characters, which would break log lines and header echoing); anything
else is a 400 naming the header. Two requests may send the same id (a retry while the first
still runs): the engine's own request id then gets a suffix (`OpenAIServing.engine_request_id`),
since engine ids must be unique while the response id stays what the client chose.
"""

from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import InvalidRequestError, error_response

HEADER = b"x-request-id"
STATE = "request_id"
"""scope["state"] key: (the id, whether the client sent it)."""
MAX_LENGTH = 128


def _valid(value: bytes) -> bool:
    return 0 < len(value) <= MAX_LENGTH and all(0x21 <= c <= 0x7E for c in value)


class RequestIdMiddleware:
    """Pure ASGI (no per-chunk overhead on streams): reads and checks the header, keeps the
    id in the request's state, adds it to the response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [value for name, value in scope["headers"] if name == HEADER]
        if given and (len(given) > 1 or not _valid(given[0])):
            error = InvalidRequestError(
                f"X-Request-Id must be one header of 1 to {MAX_LENGTH} visible ASCII characters (no spaces)",
                param="X-Request-Id")
            await error_response(error, scope["path"])(scope, receive, send)
            return
        request_id = given[0].decode("ascii") if given else uuid.uuid4().hex
        scope.setdefault("state", {})[STATE] = (request_id, bool(given))
        echoed = request_id.encode("ascii")

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, echoed)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def response_id(request, prefix: str) -> tuple[str, bool]:
    """`<prefix>-<X-Request-Id>` (a fresh id when the middleware is not in front), and
    whether the id came from the client."""
    request_id, given = request.scope.get("state", {}).get(STATE, (uuid.uuid4().hex, False))
    return f"{prefix}-{request_id}", given
