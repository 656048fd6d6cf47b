"""GET /openapi.json with the request bodies in it.

The routes read their bodies themselves (size cap, strict JSON, errors in the OpenAI
envelope), so FastAPI cannot see which model each one takes; this adds them to the
generated schema for clients, API tools and the fuzz test (tests/server/test_fuzz.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.protocol import ChatCompletionRequest, CompletionRequest
from server.protocol_anthropic import CountTokensRequest, MessagesRequest
from server.protocol_responses import ResponsesRequest
from server.serving_lora import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.serving_tokenize import DetokenizeRequest, TokenizeRequest

REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in REQUEST_BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
                }
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
