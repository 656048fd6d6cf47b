"""Reasoning parsers: a reasoning model's thinking kept apart from its answer.

Qwen3 and DeepSeek-R1 (and their distillations) think between `<think>` and `</think>`
before they answer. `--reasoning-parser` (vLLM's names) says which form a model uses:

- `qwen3`: the model opens the thinking itself (its first output token is `<think>`); an
  output that begins otherwise has no thinking. The template's `enable_thinking: false`
  closes it in the prompt (`<think>\\n\\n</think>`): then there is none.
- `deepseek_r1`: the thinking is open from the first output token (the template opened it,
  or the model writes `<think>` first, which is skipped); everything up to `</think>` is
  thinking, all of it when `</think>` never comes.

Either way a prompt that already ends with `<think>` opens the thinking, and one that ends
with `</think>` closes it. The work is done on token ids, in the engine (engine/thinking.py):
a request whose `SamplingParams.thinking` is set gets `CompletionOutput.reasoning_text`,
`delta_reasoning_text` (streams) and `num_reasoning_tokens`, while its `text` and
`delta_text` are the answer alone, tags excluded; its grammar starts after the thinking and
a budget forces `</think>`.

Use, for any route that renders a chat prompt (chat completions, Responses, Anthropic
Messages):

    parser = reasoning_parser(name, tokenizer, chat_template)   # once; None: no reasoning
    kwargs = parser.template_kwargs(enabled=False)              # thinking off, where the
                                                                # template can (else ValueError)
    params.thinking = parser.thinking_spec(tokenizer, prompt_token_ids, budget)
    ... then per CompletionOutput c: c.delta_reasoning_text / c.delta_text (streams),
        c.reasoning_text / c.text (whole), c.num_reasoning_tokens

`thinking_spec` returns None when the prompt closed the thinking: the output is then all
answer, with `reasoning_text` None.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from engine.thinking import ThinkingSpec

# Prompt tokens decoded to see whether the prompt opened or closed the thinking: the tag and
# the whitespace after it (Qwen3's `</think>\n\n`) fit in far fewer.
_PROMPT_TAIL_TOKENS = 8


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    name: str
    start_tag: str
    end_tag: str
    model_opens: bool
    """The model writes the start tag itself, and without it does not think (Qwen3)."""


REASONING_FORMATS = {
    "qwen3": ReasoningFormat("qwen3", "<think>", "</think>", model_opens=True),
    "deepseek_r1": ReasoningFormat("deepseek_r1", "<think>", "</think>", model_opens=False),
}
REASONING_PARSER_CHOICES = ("auto", "none", *REASONING_FORMATS)


class ReasoningParser:
    """One model's thinking form, with its tags as token ids."""

    def __init__(self, fmt: ReasoningFormat, tokenizer: Any, chat_template: str | None) -> None:
        self.format = fmt
        self.name = fmt.name
        self.start_token_ids = _tag_token_ids(tokenizer, fmt.start_tag)
        self.end_token_ids = _tag_token_ids(tokenizer, fmt.end_tag)
        self.can_disable = chat_template is not None and "enable_thinking" in chat_template
        """The chat template reads `enable_thinking` (Qwen3's switch)."""

    def template_kwargs(self, enabled: bool) -> dict[str, Any]:
        """The chat-template variables that turn thinking on or off; ValueError when the
        template has no switch and thinking is to be off."""
        if not self.can_disable:
            if enabled:
                return {}
            raise ValueError("this model's chat template has no switch to turn its thinking off")
        return {"enable_thinking": enabled}

    def thinking_spec(self, tokenizer: Any, prompt_token_ids: list[int], budget: int | None) -> ThinkingSpec | None:
        """The engine's view of the thinking for this prompt (SamplingParams.thinking); None
        when the prompt closed it (e.g. `enable_thinking: false`), so all output is answer."""
        tail = tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False).rstrip()
        if tail.endswith(self.format.end_tag):
            return None
        if tail.endswith(self.format.start_tag):
            return ThinkingSpec(self.end_token_ids, budget=budget)
        return ThinkingSpec(self.end_token_ids, self.start_token_ids, start_required=self.format.model_opens,
                            budget=budget)


def _announce(choice: str) -> None:
    # Beside the engine's start-up facts, in their form.
    print(f"[pagoda] reasoning_parser: {choice}", file=sys.stderr, flush=True)


def _tag_token_ids(tokenizer: Any, tag: str) -> tuple[int, ...]:
    """The tag's token: its own (special or added) token where the vocabulary has one, else
    the tokens of its text."""
    token_id = tokenizer.convert_tokens_to_ids(tag)
    if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
        return (token_id,)
    return tuple(tokenizer.encode(tag, add_special_tokens=False))


def detect_reasoning_format(chat_template: str | None) -> str | None:
    """The reasoning form a chat template implies, when it is unambiguous: a template that
    handles `</think>` in ChatML (`<|im_start|>`) is Qwen3's (QwQ's too: it opens the
    thinking in the prompt, which the parser sees); in DeepSeek's `<｜Assistant｜>` turns,
    DeepSeek-R1's. GGUF files carry their template in their metadata, so this covers them."""
    if not chat_template or "</think>" not in chat_template:
        return None
    if "<｜Assistant｜>" in chat_template:
        return "deepseek_r1"
    if "<|im_start|>" in chat_template:
        return "qwen3"
    return None


def reasoning_parser(choice: str, tokenizer: Any, chat_template: str | None) -> ReasoningParser | None:
    """The server's parser for `--reasoning-parser CHOICE`: "none", a name, or "auto" (the
    chat template's form when unambiguous, announced with the start-up facts).
    `chat_template`: the template in force (--chat-template, else the tokenizer's)."""
    if choice == "none":
        return None
    if choice == "auto":
        name = detect_reasoning_format(chat_template)
        if name is None:
            if chat_template and "</think>" in chat_template:
                _announce("none: the chat template writes </think> in a form not recognised, so the thinking stays "
                          "in the content (set --reasoning-parser)")
            return None
        _announce(f"{name} (from the chat template; --reasoning-parser none turns it off)")
    elif choice in REASONING_FORMATS:
        name = choice
    else:
        raise ValueError(f"unknown reasoning parser {choice!r}; choose one of {', '.join(REASONING_PARSER_CHOICES)}")
    return ReasoningParser(REASONING_FORMATS[name], tokenizer, chat_template)
