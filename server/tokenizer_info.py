"""GET /tokenizer_info: the served tokenizer's configuration, as vLLM serves it.

Clients that tokenize through the server instead of loading the tokenizer themselves read
it: lm-eval's `local-completions` with `tokenizer_backend=remote` (or `auto`, which picks
`remote` when this route answers with an `eos_token`) takes the special tokens and the chat
template from here and tokenizes through /tokenize and /detokenize.

The body is the tokenizer's `init_kwargs` (what tokenizer_config.json set) as JSON, as
vLLM's `TokenizerInfo` returns them: special tokens as their text, the file paths left out
(`name_or_path` is the folder's name only), and `tokenizer_class` (the Python class's name). Pagoda adds, where vLLM's may lack them:
the special tokens as the tokenizer holds them now, the chat template the server renders
(`--chat-template`'s file, else the model's own) and `max_model_len`, the server's limit
(`model_max_length` stays the tokenizer's own, often a placeholder such as 1e30).
"""

from __future__ import annotations

from pathlib import PurePath
from typing import Any

from fastapi.responses import JSONResponse

from server.serving import OpenAIServing

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _jsonable(value: Any) -> Any:
    """`value` with tokenizers' objects as plain JSON values (an AddedToken as its text)."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) else str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    content = getattr(value, "content", None)
    if isinstance(content, str):  # tokenizers.AddedToken
        return content
    return str(value)


def tokenizer_config(tokenizer: Any, chat_template: str | None, max_model_len: int) -> dict[str, Any]:
    """The /tokenizer_info body for `tokenizer`; `chat_template` is the server's override."""
    config = {
        name: value for name, value in (getattr(tokenizer, "init_kwargs", None) or {}).items()
        # Paths on the server's disk, of no use to a client.
        if not name.endswith("_file")
    }
    config = _jsonable(config)
    if isinstance(config.get("name_or_path"), str):
        # The folder's name, not the server's path to it (as /v1/models' `root`).
        config["name_or_path"] = PurePath(config["name_or_path"]).name
    for name in _SPECIAL_TOKENS:
        token = getattr(tokenizer, name, None)
        if token is not None:
            config[name] = str(token)
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = _jsonable(template)
    config["tokenizer_class"] = type(tokenizer).__name__
    config["max_model_len"] = max_model_len
    return config


async def tokenizer_info(serving: OpenAIServing, chat_template: str | None) -> JSONResponse:
    """The route's answer. Read from a worker thread's copy of the tokenizer: the original
    belongs to the engine thread once the engine runs."""
    body = await serving.tokenizers.run(tokenizer_config, chat_template, serving.max_model_len)
    return JSONResponse(body)
