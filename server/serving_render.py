"""`POST /v1/completions/render` and `POST /v1/chat/completions/render`, as vLLM serves them.

A gateway that routes on a prompt's tokens (llm-d's precise prefix-cache scorer, Dynamo's
KV-aware router) asks a replica to render a request before routing it: the token ids the
engine would prefill for that exact request, chat template, tools, `chat_template_kwargs`,
reasoning switches and `truncate_prompt_tokens` included, with the sampling params the
request resolves to. Nothing is queued or generated. The rendering is the chat and
completion routes' own (`ChatServing.render_prompt`, `CompletionServing.render_prompts`:
the same tokenizer-thread function the generating routes call), so the ids cannot drift
from what a generating request prefills; invalid requests get the routes' own 400s.

Response shapes (vLLM's `GenerateRequest`): the chat route answers one object, the
completions route a list with one per prompt:

    {"request_id": "chatcmpl-...", "model": "...", "token_ids": [...],
     "sampling_params": {"temperature": 0.0, "max_tokens": 16, ...}}
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from server.protocol import ChatCompletionRequest, CompletionRequest
from server.serving import OpenAIServing, PromptInput, read_request
from server.serving_chat import ChatServing
from server.serving_completion import CompletionServing

_JSON_SCALARS = (bool, int, float, str, type(None))


def sampling_params_json(prompt: PromptInput) -> dict[str, Any]:
    """The prompt's resolved sampling params as JSON: every plain field (numbers, strings,
    lists of them, logit_bias); the structured-output spec as its kind and field, the
    thinking section as its budget, the LoRA adapter as its name."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(prompt.params):
        value = getattr(prompt.params, f.name)
        if isinstance(value, _JSON_SCALARS) or (isinstance(value, list) and all(isinstance(v, _JSON_SCALARS) for v in value)):
            out[f.name] = value
        elif f.name == "logit_bias":
            out[f.name] = {str(k): v for k, v in value.items()}
        elif f.name == "structured_output":
            out[f.name] = {"kind": value.kind, "param": value.param}
        elif f.name == "lora_request":
            out[f.name] = value.name
        elif f.name == "thinking":
            out[f.name] = {"budget": value.budget}
    return out


class RenderServing:
    def __init__(self, serving: OpenAIServing, chat: ChatServing, completion: CompletionServing) -> None:
        self.serving = serving
        self.chat = chat
        self.completion = completion

    def _generate_request(self, prompt: PromptInput, request_id: str, model: str | None) -> dict[str, Any]:
        return {"request_id": request_id, "model": model or self.serving.model_name,
                "token_ids": prompt.token_ids, "sampling_params": sampling_params_json(prompt)}

    async def render_chat(self, request: Request) -> Response:
        serving = self.serving
        req = await read_request(request, ChatCompletionRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        prompt = await self.chat.render_prompt(req)
        return _json(self._generate_request(prompt, f"chatcmpl-{uuid.uuid4().hex}", req.model))

    async def render_completion(self, request: Request) -> Response:
        serving = self.serving
        req = await read_request(request, CompletionRequest, serving.config.max_body_bytes)
        serving.check_model(req.model)
        prompts = await self.completion.render_prompts(req)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        return _json([self._generate_request(p, f"{request_id}-{i}" if len(prompts) > 1 else request_id, req.model)
                      for i, p in enumerate(prompts)])


def _json(body: Any) -> Response:
    return Response(json.dumps(body).encode(), media_type="application/json")
