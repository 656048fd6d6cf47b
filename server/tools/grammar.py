"""tool_choice validation and tool-call grammars (`tool_call_grammar`).

llguidance Lark grammars that force valid calls for tool_choice "required" or a named
function, and for "auto" when a tool is `strict`: free text whose calls are constrained
from the moment the model writes `<tool_call>` (a lazy lexeme ends the free text at the
trigger; llguidance docs/syntax.md, "Tool calling"). The format of the calls is the
parser's (`ToolParser.grammar`); this module gives the JSON schema of one call.
"""

from __future__ import annotations

import json
from typing import Any, Collection

from server.tools.parsers import Llama3JsonToolParser, ToolParser, get_tool_parser

def validate_tool_choice(tools: list[dict] | None, tool_choice: str | dict | None) -> None:
    """Raises ValueError (-> 400, param "tool_choice") for a tool_choice that cannot apply."""
    if tool_choice is None:
        return
    if not tools:
        raise ValueError("tool_choice is only allowed when tools are specified")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or a function, not {tool_choice!r}")
        return
    name = (tool_choice.get("function") or {}).get("name")
    if tool_choice.get("type") != "function" or not name:
        raise ValueError('tool_choice must look like {"type": "function", "function": {"name": ...}}')
    names = [tool["function"]["name"] for tool in tools]
    if name not in names:
        raise ValueError(f"tool_choice names function {name!r}, which is not among the tools: {', '.join(names)}")


# Compact JSON with the separators json.dumps writes (and the prompt shows): free
# whitespace lets a small model spend its token budget on newlines.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_grammar(
    tools: list[dict] | None,
    tool_choice: str | dict | None,
    parallel_tool_calls: bool,
    parser_name: str,
    special_tokens: Collection[str] = (),
) -> str | None:
    """An llguidance Lark grammar forcing valid calls in `parser_name`'s format, or None.

    "required": one call (one or more, newline/`; `-separated, with parallel_tool_calls);
    a named function: exactly one call of it; "auto" with a `strict` tool: free text that
    may end in calls, constrained once a call starts; "none" or plain "auto": None.
    `special_tokens`: tags (`<tool_call>`, `<|python_tag|>`) that are single special tokens
    in the model's vocabulary, which a grammar must name as tokens, not as text.
    """
    parser = get_tool_parser(parser_name)
    if not tools or tool_choice == "none":
        return None
    if isinstance(tool_choice, dict):
        validate_tool_choice(tools, tool_choice)
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
        return parser.grammar(_call_json(chosen, parser), False, False, special_tokens)
    if tool_choice == "required":
        return parser.grammar(_call_json(tools, parser), parallel_tool_calls, False, special_tokens)
    if any((t.get("function") or {}).get("strict") for t in tools):
        return parser.grammar(_call_json(tools, parser), parallel_tool_calls, True, special_tokens)
    return None


def _call_json(tools: list[dict], parser: type[ToolParser]) -> str:
    """`%json` of one call of any of `tools`: name first, so streaming can emit it early."""
    arguments_key = "parameters" if parser is Llama3JsonToolParser else "arguments"
    definitions: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        parameters = tool["function"].get("parameters") or {"type": "object"}
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]},
                           arguments_key: _hoist_definitions(parameters, f"tool{i}", definitions)},
            "required": ["name", arguments_key],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema = {**schema, "x-guidance": JSON_FORMAT}
    if definitions:
        schema["$defs"] = definitions
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _hoist_definitions(parameters: dict, prefix: str, definitions: dict) -> dict:
    """`parameters` with its `$defs` moved to the root under `prefix`-ed names and its local
    `$ref`s rewritten: once nested in the call schema, "#/$defs/X" would point elsewhere."""

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(item) for item in node]
        if not isinstance(node, dict):
            return node
        rewritten = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions") or node is not parameters}
        ref = node.get("$ref")
        if ref == "#":
            rewritten["$ref"] = f"#/$defs/{prefix}"
            definitions[prefix] = root
        elif isinstance(ref, str):
            for local in ("#/$defs/", "#/definitions/"):
                if ref.startswith(local):
                    rewritten["$ref"] = f"#/$defs/{prefix}_{ref[len(local):]}"
        return rewritten

    root: dict = {}
    root.update(rewrite(parameters))
    for key in ("definitions", "$defs"):
        for name, schema in (parameters.get(key) or {}).items():
            definitions[f"{prefix}_{name}"] = rewrite(schema)
    return root
