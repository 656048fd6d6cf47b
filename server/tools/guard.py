"""The duplicate-call guard and the cap on calls per message (`GuardedToolCallStream`).

Under tool_choice "required" with parallel calls the grammar lets every call be followed by
another, and a small model takes that offer until max_tokens, repeating its first call. The
guard sits on the tool parser's stream: a call that repeats an earlier call of the same
message exactly (name and arguments text) ends the list instead of being emitted, and so
does a call past `max_calls`. `ended` tells the caller to stop the engine request; the
choice then finishes with "tool_calls".

A call whose name matches an earlier call's is held back while its arguments so far are a
prefix of that call's: once they differ it goes out (everything held, at once), and if they
end up equal it is dropped. So a streamed client never sees a call that is later taken back.
"""

from __future__ import annotations

from server.tools.parsers import ContentDelta, Delta, ToolCallDelta, ToolCallStream, _coalesce


class GuardedToolCallStream:
    """A `ToolCallStream` whose calls end at the first exact repeat or past `max_calls`."""

    def __init__(self, stream: ToolCallStream, max_calls: int) -> None:
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        self.max_calls = max_calls
        self.ended = False
        """The list ended (a repeat, or the cap): nothing more is emitted; stop generating."""
        self._stream = stream
        self._calls: list[list[str]] = []  # [name, arguments so far] of each call let through or held
        self._held: list[ToolCallDelta] = []  # the deltas of the last call while it may be a repeat

    def feed(self, text: str) -> list[Delta]:
        return [] if self.ended else self._filter(self._stream.feed(text))

    def finish(self) -> list[Delta]:
        """The text ended. A call held back and cut short stands as written, as every call does."""
        if self.ended:
            return []
        out = self._filter(self._stream.finish())
        return out if self.ended else _coalesce(out + self._release())

    def _filter(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if isinstance(d, ContentDelta):
                out += self._release()  # text after a held call: it was complete and new
                out.append(d)
            elif d.name is not None:  # a call starts: the one before it is complete
                out += self._release()
                if len(self._calls) >= self.max_calls:
                    self.ended = True
                    break
                earlier = [name for name, _ in self._calls]
                self._calls.append([d.name, ""])
                if d.name in earlier:
                    self._held.append(d)
                else:
                    out.append(d)
            else:
                self._calls[-1][1] += d.arguments
                if not self._held:
                    out.append(d)
                    continue
                self._held.append(d)
                name, arguments = self._calls[-1]
                earlier = [args for other, args in self._calls[:-1] if other == name]
                if arguments in earlier:  # the same complete JSON value: a repeat
                    self._calls.pop()
                    self._held = []
                    self.ended = True
                    break
                if not any(args.startswith(arguments) for args in earlier):
                    out += self._release()
        return _coalesce(out)

    def _release(self) -> list[Delta]:
        held, self._held = self._held, []
        return list(held)
