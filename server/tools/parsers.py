"""Tool-call parsers: model text -> content + tool calls, whole or streamed.

`TOOL_PARSERS` / `get_tool_parser` name the formats. A parser reads the text whole
(`parse`) or streamed (`streaming()`). `parse` is the stream run over the whole text, so
the two agree for any split of the text into deltas. A call is judged once its
`{"name": "..."` has been read: before that, text that is not a call stays content
(nothing is lost); after it, the call stands with its arguments exactly as written
(possibly cut short by max_tokens), because streamed deltas cannot be taken back.

Each parser class also gives the Lark rules of its format (`grammar`), which
server/tools/grammar.py fills with the JSON schema of the calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable, ClassVar, Collection

IdFactory = Callable[[], str]


def new_tool_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


# ---------------------------------------------------------------------------------------
# Parsed results and stream deltas

@dataclass(frozen=True)
class ToolCall:
    """One complete call; `arguments` is the JSON text of the arguments as the model wrote it."""
    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class ParsedToolCalls:
    content: str | None
    calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """Part of call `index`: its first delta carries id and name (arguments ""), later ones
    carry argument fragments only."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Delta = ContentDelta | ToolCallDelta


def collect_deltas(deltas: list[Delta]) -> ParsedToolCalls:
    """The whole result a list of stream deltas adds up to."""
    content = "".join(d.text for d in deltas if isinstance(d, ContentDelta))
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            call = calls.setdefault(d.index, ["", "", ""])
            call[0] = d.id or call[0]
            call[1] = d.name or call[1]
            call[2] += d.arguments
    return ParsedToolCalls(content or None, [ToolCall(name, arguments, call_id)
                                             for _, (call_id, name, arguments) in sorted(calls.items())])


def _coalesce(deltas: list[Delta]) -> list[Delta]:
    # One delta per character would mean one SSE chunk per character.
    merged: list[Delta] = []
    for d in deltas:
        last = merged[-1] if merged else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            merged[-1] = ContentDelta(last.text + d.text)
        elif (isinstance(d, ToolCallDelta) and isinstance(last, ToolCallDelta) and d.name is None
              and last.name is None and d.index == last.index):
            merged[-1] = ToolCallDelta(d.index, last.arguments + d.arguments)
        else:
            merged.append(d)
    return merged


# ---------------------------------------------------------------------------------------
# Incremental JSON

WHITESPACE = " \t\r\n"
_SCALAR_CHARS = re.compile(r"[A-Za-z0-9+\-.]")
PART, SKIP, END = "part", "skip", "end"


class JsonValueScanner:
    """Finds where one JSON value ends in a character stream, without parsing it.

    `push(ch)` says whether `ch` is PART of the value, whitespace to SKIP before it, or the
    END (the value ended before `ch`, which is not consumed). It tracks strings, escapes and
    bracket depth only; a top-level number or literal ends at the first character that cannot
    continue it, so only such a scalar is ever unknown-length. `<` outside a string ends the
    value too: it is never JSON, and it is how a closing tag cuts off an unbalanced object.
    """

    def __init__(self) -> None:
        self.started = False
        self.done = False
        self.scalar = False  # a top-level number/literal: its end is known one character late
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def push(self, ch: str) -> str:
        if self.done:
            return END
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                self.done = self._depth == 0
            return PART
        if not self.started:
            if ch in WHITESPACE:
                return SKIP
            self.started = True
        if self.scalar:
            if _SCALAR_CHARS.match(ch):
                return PART
            self.done = True
            return END
        if ch == '"':
            self._in_string = True
            return PART
        if ch in "{[":
            self._depth += 1
            return PART
        if ch in "}]" and self._depth > 0:
            self._depth -= 1
            self.done = self._depth == 0
            return PART
        if self._depth == 0 and _SCALAR_CHARS.match(ch):
            self.scalar = True
            return PART
        if self._depth == 0 or ch == "<":
            self.done = True
            return END
        return PART


def _top_level_spans(object_text: str) -> dict[str, tuple[int, int]]:
    """Where each top-level value of a valid JSON object's text starts and ends."""
    decoder, spans = json.JSONDecoder(), {}
    i = object_text.index("{") + 1
    while True:
        while object_text[i] in WHITESPACE + ",":
            i += 1
        if object_text[i] == "}":
            return spans
        key, i = decoder.raw_decode(object_text, i)
        i = object_text.index(":", i) + 1
        while object_text[i] in WHITESPACE:
            i += 1
        start = i
        _, i = decoder.raw_decode(object_text, i)
        spans[key] = (start, i)


def _decode_call(object_text: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a complete call object, or None if it is not one."""
    try:
        decoded = json.loads(object_text)
    except ValueError:
        return None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("name"), str):
        return None
    spans = _top_level_spans(object_text)
    for key in ARGUMENT_KEYS:
        if key in spans:
            return decoded["name"], object_text[spans[key][0]:spans[key][1]]
    return decoded["name"], "{}"


ARGUMENT_KEYS = ("arguments", "parameters")


def _is_cut_arguments_key(text: str) -> bool:
    """Whether `text` is `, "arguments":` cut short: call syntax, not content."""
    compact = re.sub(r"\s+", "", text)
    return any(f',"{key}":'.startswith(compact) for key in ARGUMENT_KEYS)


CALL, NOT_CALL = "call", "not_call"


class CallObjectStream:
    """One `{"name": ..., "arguments": ...}` object, character by character.

    Emits the id+name delta as soon as the name string closes (when "name" is the first
    key), then the arguments value as it streams. An object in another key order is held
    whole and judged by `json.loads` when it closes. `outcome` becomes CALL or NOT_CALL;
    for NOT_CALL, `raw` (everything consumed) is the caller's content, and for CALL,
    `leftover` is text inside the object that belongs to neither name nor arguments.
    """

    _NAME_FIRST = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
    _ARGUMENTS_KEY = re.compile(r'\s*,\s*"(?:arguments|parameters)"\s*:')
    _CLOSE = re.compile(r"\s*\}?\s*")  # the closing brace may be missing before a tag

    def __init__(self, index: int, new_id: IdFactory) -> None:
        self.index = index
        self.outcome: str | None = None
        self.raw = ""
        self.leftover = ""
        self.name: str | None = None
        self._new_id = new_id
        self._object = JsonValueScanner()
        self._stage = "name"  # -> after_name -> arguments -> after_arguments
        self._pending = ""
        self._arguments = JsonValueScanner()
        self._held_scalar = ""

    def push(self, ch: str) -> tuple[bool, list[Delta]]:
        """Offers one character: whether it was consumed, and the deltas it produced."""
        out: list[Delta] = []
        if not self._object.started and ch not in WHITESPACE and ch != "{":
            self.outcome = NOT_CALL
            return False, out
        step = self._object.push(ch)
        if step == END:
            self._resolve(out)
            return False, out
        self.raw += ch
        self._advance(ch, out)
        if self._object.done:
            self._resolve(out)
        return True, out

    def finish(self) -> list[Delta]:
        """The text ended inside the object."""
        out: list[Delta] = []
        if self.outcome is None:
            if self._stage == "name":
                self.outcome = NOT_CALL
            else:
                self._resolve(out, truncated=True)
        return out

    def _start(self, name: str, out: list[Delta]) -> None:
        self.name = name
        out.append(ToolCallDelta(self.index, "", self._new_id(), name))

    def _arguments_fragment(self, text: str, out: list[Delta]) -> None:
        if text:
            out.append(ToolCallDelta(self.index, text))

    def _advance(self, ch: str, out: list[Delta]) -> None:
        if self._stage == "name":
            match = self._NAME_FIRST.fullmatch(self.raw) if ch == '"' else None
            if match:
                try:
                    name = json.loads(match.group(1))
                except ValueError:
                    return  # a bad escape: judged as a whole when the object closes
                self._start(name, out)
                self._stage = "after_name"
        elif self._stage == "after_name":
            self._pending += ch
            if self._ARGUMENTS_KEY.fullmatch(self._pending):
                self._stage, self._pending = "arguments", ""
        elif self._stage == "arguments":
            step = self._arguments.push(ch)
            if step == PART and self._arguments.scalar:
                self._held_scalar += ch
            elif step == PART:
                self._arguments_fragment(ch, out)
            if step == END:
                self._arguments_fragment(self._held_scalar, out)
                self._stage, self._pending = "after_arguments", ch
            elif self._arguments.done:
                self._stage = "after_arguments"
        else:
            self._pending += ch

    def _resolve(self, out: list[Delta], truncated: bool = False) -> None:
        self.outcome = CALL
        if self._stage == "name":
            decoded = _decode_call(self.raw)
            if decoded is None:
                self.outcome = NOT_CALL
            else:
                self._start(decoded[0], out)
                self._arguments_fragment(decoded[1], out)
        elif self._stage == "after_name":
            decoded = None if truncated else _decode_call(self.raw)
            if decoded is not None and decoded[0] == self.name:
                self._arguments_fragment(decoded[1], out)
            elif not (truncated and _is_cut_arguments_key(self._pending)):
                self.leftover = self._pending
        elif self._stage == "arguments":  # cut off inside the arguments: they stand as written
            self._arguments_fragment(self._held_scalar, out)
        elif not self._CLOSE.fullmatch(self._pending) and (truncated or _decode_call(self.raw) is None):
            self.leftover = self._pending


# ---------------------------------------------------------------------------------------
# Parsers

class ToolCallStream:
    """Incremental parser state for one response: `feed` each text delta, then `finish`."""

    def __init__(self, new_id: IdFactory) -> None:
        self._new_id = new_id
        self._out: list[Delta] = []
        self._index = 0
        self._call: CallObjectStream | None = None

    def feed(self, delta_text: str) -> list[Delta]:
        for ch in delta_text:
            self._push(ch)
        return self._take()

    def finish(self) -> list[Delta]:
        self._finish()
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = _coalesce(self._out), []
        return out

    def _emit(self, text: str) -> None:
        if text:
            self._out.append(ContentDelta(text))

    def _push_to_call(self, ch: str) -> bool:
        """Feeds the open call; True if it consumed `ch`."""
        consumed, deltas = self._call.push(ch)
        self._out += deltas
        if self._call.outcome is not None:
            self._end_call()
        return consumed

    def _finish_call(self) -> None:
        self._out += self._call.finish()
        self._end_call()

    def _push(self, ch: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        raise NotImplementedError

    def _end_call(self) -> None:
        raise NotImplementedError


class ToolParser:
    """Turns model output in one tool-call format into content and calls."""

    name: ClassVar[str]

    def __init__(self, new_id: IdFactory = new_tool_call_id) -> None:
        self.new_id = new_id

    def streaming(self) -> ToolCallStream:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedToolCalls:
        """The whole output at once: exactly what streaming it would add up to."""
        stream = self.streaming()
        return collect_deltas(stream.feed(text) + stream.finish())

    @classmethod
    def grammar(cls, call_json: str, multiple: bool, free_text: bool, special_tokens: Collection[str]) -> str:
        """Lark rules for output in this format; `call_json` is a `%json {...}` of one call."""
        raise NotImplementedError


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class _HermesStream(ToolCallStream):
    """Content with `<tool_call>\\n{json}\\n</tool_call>` blocks. Whitespace touching a call
    (before or after its block) is not content, so "Sure.\\n<tool_call>..." gives "Sure."."""

    def __init__(self, new_id: IdFactory) -> None:
        super().__init__(new_id)
        self._state = "text"  # | "call" | "close"
        self._tag = ""  # the end of the text, while it may be the start of <tool_call>
        self._held_ws = ""  # trailing content whitespace, until we know no call follows
        self._ws_before_call = ""
        self._after_call = False
        self._close = ""

    def _push(self, ch: str) -> None:
        if self._state == "call":
            if not self._push_to_call(ch):
                self._push(ch)
        elif self._state == "close":
            self._close += ch
            if not TOOL_CALL_CLOSE.startswith(self._close.lstrip()):
                self._reread_close()
            elif self._close.lstrip() == TOOL_CALL_CLOSE:
                self._state, self._close = "text", ""
        else:
            candidate = self._tag + ch
            if candidate == TOOL_CALL_OPEN:
                self._tag, self._ws_before_call, self._held_ws = "", self._held_ws, ""
                self._call = CallObjectStream(self._index, self._new_id)
                self._state = "call"
                return
            cut = next(k for k in range(len(candidate) + 1) if TOOL_CALL_OPEN.startswith(candidate[k:]))
            self._tag = candidate[cut:]
            self._content(candidate[:cut])

    def _reread_close(self) -> None:
        # No closing tag after the call: what came instead is read again as text.
        pending, self._close, self._state = self._close, "", "text"
        for ch in pending:
            self._push(ch)

    def _content(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._emit(self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if call.outcome == NOT_CALL:
            self._state = "text"
            self._content(self._ws_before_call + TOOL_CALL_OPEN + call.raw)
            return
        self._index += 1
        self._state, self._after_call = "close", True
        self._content(call.leftover)

    def _finish(self) -> None:
        if self._state == "call":
            self._finish_call()
        if self._state == "close" and not TOOL_CALL_CLOSE.startswith(self._close.strip()):
            self._reread_close()  # otherwise it is a closing tag cut short: call syntax, dropped
        self._content(self._tag)
        self._tag = ""
        self._emit(self._held_ws)
        self._held_ws = ""


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks (Hermes, Qwen,
    and the default prompt); several calls allowed, text before the first call is content."""

    name = "hermes"

    def streaming(self) -> ToolCallStream:
        return _HermesStream(self.new_id)

    @classmethod
    def grammar(cls, call_json: str, multiple: bool, free_text: bool, special_tokens: Collection[str]) -> str:
        open_ = TOOL_CALL_OPEN if TOOL_CALL_OPEN in special_tokens else json.dumps(TOOL_CALL_OPEN)
        close = TOOL_CALL_CLOSE if TOOL_CALL_CLOSE in special_tokens else json.dumps(TOOL_CALL_CLOSE)
        more = ' ("\\n" call)*' if multiple else ""
        rules = [f"call: {open_} body", f'body: "\\n" call_json "\\n" {close}', f"call_json: {call_json}"]
        if not free_text:
            rules.insert(0, f"start: call{more}")
        elif TOOL_CALL_OPEN in special_tokens:  # free text cannot contain a special token
            rules[:0] = [f"start: TEXT | TEXT call{more}", "TEXT: /(.|\\n)*/"]
        else:  # the lazy lexeme ends the free text at the first "<tool_call>"
            rules[:0] = [f"start: TEXT | head body{more}", f"head[lazy]: TEXT {open_}", "TEXT: /(.|\\n)*/"]
        return "%llguidance {}\n" + "\n".join(rules) + "\n"


PYTHON_TAG = "<|python_tag|>"


class _Llama3JsonStream(ToolCallStream):
    """`[<|python_tag|>]{"name": ..., "parameters": {...}}; {...}`: the output is calls
    only if it starts with one; otherwise all of it is content."""

    _BETWEEN = re.compile(r"\s*;?\s*")
    _NEXT_CALL = re.compile(r"\s*;?\s*\{")  # some models leave out the ";"

    def __init__(self, new_id: IdFactory) -> None:
        super().__init__(new_id)
        self._state = "start"  # | "call" | "between" | "text"
        self._pending = ""
        self._before_call = ""

    def _push(self, ch: str) -> None:
        if self._state == "text":
            self._emit(ch)
            return
        if self._state == "call":
            if not self._push_to_call(ch):
                self._push(ch)
            return
        self._pending += ch
        if self._state == "start":
            head = self._pending.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            elif PYTHON_TAG.startswith(head):
                return
            if head == "{":
                self._start_call()
            elif head:
                self._to_text()
        elif self._NEXT_CALL.fullmatch(self._pending):
            self._start_call()
        elif not self._BETWEEN.fullmatch(self._pending):
            self._to_text()

    def _start_call(self) -> None:
        self._before_call, self._pending = self._pending[:-1], ""
        self._call = CallObjectStream(self._index, self._new_id)
        self._call.push("{")
        self._state = "call"

    def _to_text(self) -> None:
        self._emit(self._pending)
        self._pending, self._state = "", "text"

    def _end_call(self) -> None:
        call, self._call = self._call, None
        if call.outcome == NOT_CALL:
            self._emit(self._before_call + call.raw)
            self._state = "text"
            return
        self._index += 1
        self._emit(call.leftover)
        self._state = "text" if call.leftover else "between"

    def _finish(self) -> None:
        if self._state == "call":
            self._finish_call()
        if self._state == "start":
            self._emit(self._pending)
        self._pending = ""


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: optional `<|python_tag|>`, then one or more
    `{"name": ..., "parameters": {...}}` objects separated by `;` ("arguments" works too)."""

    name = "llama3_json"

    def streaming(self) -> ToolCallStream:
        return _Llama3JsonStream(self.new_id)

    @classmethod
    def grammar(cls, call_json: str, multiple: bool, free_text: bool, special_tokens: Collection[str]) -> str:
        tag = f"{PYTHON_TAG} " if PYTHON_TAG in special_tokens else ""
        rules = [f"calls: {tag}call" + (' ("; " call)*' if multiple else ""), f"call: {call_json}"]
        if free_text:  # text that does not start like a call
            rules[:0] = ["start: calls | TEXT?", "TEXT: /[^{\\s](.|\\n)*/"]
        else:
            rules.insert(0, "start: calls")
        return "%llguidance {}\n" + "\n".join(rules) + "\n"


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
DEFAULT_TOOL_PARSER = HermesToolParser.name


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]
