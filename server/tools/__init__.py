"""OpenAI-style tool calling for /v1/chat/completions: prompts, output parsers, grammars.

Pure logic on plain dicts (the OpenAI request shapes, already validated); the server wires
it in. Four modules:

- `prompt` (prompt rendering): `prepare_conversation` gives what to pass to
  `tokenizer.apply_chat_template(conversation, tools=...)`. A template with a tools branch
  gets the tools and the tool history in Hugging Face's format; any other template (the
  bundled SmolLM2 one is plain ChatML) gets a Hermes-style system block
  (`DEFAULT_TOOL_SYSTEM_PROMPT`) and the history written out as `<tool_call>` /
  `<tool_response>` text.
- `parsers` (`TOOL_PARSERS`, `get_tool_parser`): model text -> content + tool calls, whole
  (`parse`) or streamed (`streaming()`). `parse` is the stream run over the whole text, so
  the two agree for any split of the text into deltas. A call is judged once its
  `{"name": "..."` has been read: before that, text that is not a call stays content
  (nothing is lost); after it, the call stands with its arguments exactly as written
  (possibly cut short by max_tokens), because streamed deltas cannot be taken back.
- `grammar` (`tool_call_grammar`): llguidance Lark grammars that force valid calls for
  tool_choice "required" or a named function, and for "auto" when a tool is `strict`: free
  text whose calls are constrained from the moment the model writes `<tool_call>` (a lazy
  lexeme ends the free text at the trigger; llguidance docs/syntax.md, "Tool calling").

- `guard` (`GuardedToolCallStream`): a parser's stream whose calls end at the first exact
  repeat of an earlier call of the same reply, or past a cap on calls per reply.

`prompt` and `parsers` import nothing from each other; `grammar` and `guard` build on `parsers`.
"""

from server.tools.grammar import JSON_FORMAT, tool_call_grammar, validate_tool_choice
from server.tools.guard import GuardedToolCallStream
from server.tools.parsers import (
    DEFAULT_TOOL_PARSER,
    END,
    PART,
    PYTHON_TAG,
    SKIP,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_PARSERS,
    CallObjectStream,
    ContentDelta,
    Delta,
    HermesToolParser,
    IdFactory,
    JsonValueScanner,
    Llama3JsonToolParser,
    ParsedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    collect_deltas,
    get_tool_parser,
    new_tool_call_id,
)
from server.tools.prompt import (
    DEFAULT_TOOL_SYSTEM_PROMPT,
    TOOLS_PLACEHOLDER,
    format_hermes_call,
    prepare_conversation,
    template_supports_tools,
    tool_system_prompt,
)

__all__ = [
    "CallObjectStream",
    "ContentDelta",
    "DEFAULT_TOOL_PARSER",
    "DEFAULT_TOOL_SYSTEM_PROMPT",
    "Delta",
    "GuardedToolCallStream",
    "END",
    "HermesToolParser",
    "IdFactory",
    "JSON_FORMAT",
    "JsonValueScanner",
    "Llama3JsonToolParser",
    "PART",
    "PYTHON_TAG",
    "ParsedToolCalls",
    "SKIP",
    "TOOLS_PLACEHOLDER",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_PARSERS",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "collect_deltas",
    "format_hermes_call",
    "get_tool_parser",
    "new_tool_call_id",
    "prepare_conversation",
    "template_supports_tools",
    "tool_call_grammar",
    "tool_system_prompt",
    "validate_tool_choice",
]
