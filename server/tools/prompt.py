"""Tool prompt rendering: what to pass to `tokenizer.apply_chat_template`.

`prepare_conversation` gives the conversation and `tools` argument for
`tokenizer.apply_chat_template(conversation, tools=...)`. A template with a tools branch
gets the tools and the tool history in Hugging Face's format; any other template (the
bundled SmolLM2 one is plain ChatML) gets a Hermes-style system block
(`DEFAULT_TOOL_SYSTEM_PROMPT`) and the history written out as `<tool_call>` /
`<tool_response>` text.
"""

from __future__ import annotations

import json
import re
from typing import Any

TOOLS_PLACEHOLDER = "{tools}"

# Short sentences and one literal example: a 135M model copies formats better than it
# follows abstract rules. Tool calls in the history are written in exactly this form.
DEFAULT_TOOL_SYSTEM_PROMPT = """You can call functions (tools) to help the user.
The tools are listed inside <tools></tools>, one JSON object per line:
<tools>
{tools}
</tools>

To call a tool, write its name and its arguments as JSON inside <tool_call></tool_call>, like this:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>
Write one <tool_call> block for each call. Use only the tools listed above and give every required argument.
Tool results come back inside <tool_response></tool_response>; use them to answer.
If no tool is needed, answer the user directly."""


def template_supports_tools(chat_template: str | None) -> bool:
    """Whether a Jinja chat template renders tools itself (its source uses `tools`)."""
    return bool(chat_template) and re.search(r"\btools\b", chat_template) is not None


def prepare_conversation(
    messages: list[dict], tools: list[dict] | None, supports_tools: bool
) -> tuple[list[dict], list[dict] | None]:
    """The conversation and `tools` argument for `tokenizer.apply_chat_template`.

    Without tools and without tool history the messages come back unchanged.
    """
    has_tool_history = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if not tools and not has_tool_history:
        return messages, None
    if supports_tools:
        return [_hf_message(m) for m in messages], (list(tools) if tools else None)
    conversation = _hermes_history(messages)
    if tools:
        conversation = _with_tool_system_prompt(conversation, tools)
    return conversation, None


def tool_system_prompt(tools: list[dict]) -> str:
    """`DEFAULT_TOOL_SYSTEM_PROMPT` with the tools filled in, one JSON line each."""
    lines = [json.dumps(_without_none(tool), ensure_ascii=False) for tool in tools]
    return DEFAULT_TOOL_SYSTEM_PROMPT.replace(TOOLS_PLACEHOLDER, "\n".join(lines))


def _without_none(tool: dict) -> dict:
    # Pydantic dumps unset fields as null; they cost prompt tokens and say nothing.
    function = {k: v for k, v in (tool.get("function") or {}).items() if v is not None}
    return {**{k: v for k, v in tool.items() if v is not None}, "function": function}


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.get("text") or "" for part in content)  # content parts


def _hf_message(message: dict) -> dict:
    if message.get("role") == "tool":
        return {"role": "tool", "content": _text(message.get("content")),
                "tool_call_id": message.get("tool_call_id")}
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") or {}
        calls.append({"id": call.get("id"), "type": "function", "function": {
            "name": function.get("name"), "arguments": _arguments_dict(function.get("arguments"))}})
    return {**message, "tool_calls": calls}


def _arguments_dict(arguments: Any) -> Any:
    # Hugging Face templates iterate or `tojson` a dict; a string that is not a JSON object
    # is passed on as it is rather than dropped.
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
        return parsed if isinstance(parsed, dict) else arguments
    return arguments


def _hermes_history(messages: list[dict]) -> list[dict]:
    conversation: list[dict] = []
    merging_tool_responses = False
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if merging_tool_responses:
                conversation[-1]["content"] += "\n" + block
            else:
                conversation.append({"role": "user", "content": block})
            merging_tool_responses = True
            continue
        merging_tool_responses = False
        rendered = {k: v for k, v in message.items() if k != "tool_calls"}
        parts = [_text(message.get("content"))] if message.get("content") else []
        parts += [format_hermes_call(c["function"]["name"], c["function"].get("arguments"))
                  for c in message.get("tool_calls") or []]
        rendered["content"] = "\n".join(parts)
        conversation.append(rendered)
    return conversation


def format_hermes_call(name: str, arguments: Any) -> str:
    """One `<tool_call>` block, as the default prompt asks the model to write it."""
    if isinstance(arguments, str):
        try:
            arguments_json = json.dumps(json.loads(arguments), ensure_ascii=False)
        except ValueError:
            arguments_json = json.dumps(arguments, ensure_ascii=False)
    else:
        arguments_json = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    name_json = json.dumps(name, ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name_json}, "arguments": {arguments_json}}}\n</tool_call>'


def _with_tool_system_prompt(conversation: list[dict], tools: list[dict]) -> list[dict]:
    text = tool_system_prompt(tools)
    if conversation and conversation[0].get("role") == "system":
        existing = _text(conversation[0].get("content"))
        merged = text + "\n\n" + existing if existing else text
        return [{**conversation[0], "content": merged}, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]
