"""IncrementalDetokenizer against the bundled model's byte-level BPE tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from engine.default_model import ensure_default_model
from engine.detokenizer import IncrementalDetokenizer

IM_END_ID = 2
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(ensure_default_model())


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    return tokenizer.encode(PROMPT, add_special_tokens=False)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detokenizer: IncrementalDetokenizer, token_ids: list[int]
) -> tuple[str | None, list[str]]:
    """Feed tokens one per step as the engine does; return (stop string, deltas).

    The last delta is the one taken with finished=True.
    """
    deltas = []
    stop_reason = None
    for token_id in token_ids:
        stop_reason = detokenizer.update([token_id])
        if stop_reason is not None:
            break
        deltas.append(detokenizer.get_delta_text(finished=False))
    deltas.append(detokenizer.get_delta_text(finished=True))
    return stop_reason, deltas


DECODE_TEXTS = [
    pytest.param("Hello there, how are you today?", id="ascii"),
    pytest.param("Hi 👋🌍 bye", id="emoji"),
    pytest.param("你好世界", id="cjk"),
    pytest.param("café naïve", id="accented"),
    pytest.param("def f(x):\n    if x:\n        return x  # ok\n\treturn 0\n", id="code"),
    pytest.param("  leading spaces and trailing  ", id="spaces"),
]


@pytest.mark.parametrize("text", DECODE_TEXTS)
def test_output_text_equals_full_decode(tokenizer: Any, prompt_ids: list[int], text: str) -> None:
    output_ids = encode(tokenizer, text)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])

    stop_reason, deltas = stream(detokenizer, output_ids)

    assert stop_reason is None
    assert detokenizer.output_text == tokenizer.decode(output_ids, skip_special_tokens=True)
    assert detokenizer.output_text == text
    assert "".join(deltas) == text


@pytest.mark.parametrize("text", DECODE_TEXTS)
def test_streamed_deltas_are_whole_characters(
    tokenizer: Any, prompt_ids: list[int], text: str
) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])

    _, deltas = stream(detokenizer, encode(tokenizer, text))

    assert [d for d in deltas if "\ufffd" in d] == []


def test_output_ending_inside_a_character_is_flushed_when_finished(
    tokenizer: Any, prompt_ids: list[int]
) -> None:
    # "👋" is three byte-level tokens here; generation stops after the first two.
    output_ids = encode(tokenizer, "ok 👋")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])

    _, deltas = stream(detokenizer, output_ids)

    # The space before the unfinished emoji is final; its bytes so far are not.
    assert deltas[:-1] == ["ok", " ", ""]
    assert deltas[-1] == "\ufffd"
    assert detokenizer.output_text == tokenizer.decode(output_ids)


def test_no_prompt_context(tokenizer: Any) -> None:
    output_ids = encode(tokenizer, " leading space kept")
    detokenizer = IncrementalDetokenizer(tokenizer, [], stop=[])

    _, deltas = stream(detokenizer, output_ids)

    assert "".join(deltas) == detokenizer.output_text == " leading space kept"


@pytest.mark.parametrize(
    ("skip_special_tokens", "expected"),
    [
        pytest.param(True, "Hi there", id="skip"),
        pytest.param(False, "Hi there<|im_end|>", id="keep"),
    ],
)
def test_special_tokens(
    tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool, expected: str
) -> None:
    output_ids = encode(tokenizer, "Hi there") + [IM_END_ID]
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, stop=[], skip_special_tokens=skip_special_tokens
    )

    _, deltas = stream(detokenizer, output_ids)

    assert detokenizer.output_text == expected
    assert expected == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected


# (text, stop strings, include_stop_str_in_output, expected stop, expected output text)
STOP_CASES = [
    pytest.param("Hello world. Bye", ["."], False, ".", "Hello world", id="single-token"),
    pytest.param("Hello world. Bye", ["lo wor"], False, "lo wor", "Hel", id="spans-tokens"),
    pytest.param("Hello world. Bye", ["o world. B"], False, "o world. B", "Hell", id="spans-3-tokens"),
    pytest.param("Hello world. Bye", ["wor"], False, "wor", "Hello ", id="mid-token"),
    pytest.param("Stop here", ["Stop"], False, "Stop", "", id="first-token"),
    pytest.param("Hello world. Bye", ["lo wor"], True, "lo wor", "Hello wor", id="include"),
    pytest.param("Stop here", ["Stop"], True, "Stop", "Stop", id="include-first-token"),
    pytest.param("Hello world. Bye", ["world", "o w"], False, "o w", "Hell", id="earliest-wins"),
    pytest.param("Hello world. Bye", ["Bye", "."], False, ".", "Hello world", id="first-found-wins"),
    pytest.param("你好世界!", ["世界"], False, "世界", "你好", id="multibyte"),
    pytest.param("Hello world. Bye", ["xyz"], False, None, "Hello world. Bye", id="no-match"),
]


@pytest.mark.parametrize(
    ("text", "stop", "include", "expected_stop", "expected_text"), STOP_CASES
)
def test_stop_strings(
    tokenizer: Any,
    prompt_ids: list[int],
    text: str,
    stop: list[str],
    include: bool,
    expected_stop: str | None,
    expected_text: str,
) -> None:
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, stop=stop, include_stop_str_in_output=include
    )

    stop_reason, deltas = stream(detokenizer, encode(tokenizer, text))

    assert stop_reason == expected_stop
    assert detokenizer.output_text == expected_text
    assert "".join(deltas) == expected_text


def test_stop_prefix_is_held_back_until_stop_completes(
    tokenizer: Any, prompt_ids: list[int]
) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["lo wor"])

    assert detokenizer.update(encode(tokenizer, "Hello")) is None
    # "lo" may begin the stop string, so it is not shown yet.
    assert detokenizer.get_delta_text(finished=False) == "Hel"
    assert detokenizer.update(encode(tokenizer, " world")) == "lo wor"
    assert detokenizer.get_delta_text(finished=True) == ""


def test_stop_prefix_is_released_when_text_continues_differently(
    tokenizer: Any, prompt_ids: list[int]
) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["Hello!"])

    assert detokenizer.update(encode(tokenizer, "Hello")) is None
    assert detokenizer.get_delta_text(finished=False) == ""
    assert detokenizer.update(encode(tokenizer, " there")) is None
    assert detokenizer.get_delta_text(finished=False) == "Hello there"
    assert detokenizer.get_delta_text(finished=True) == ""


def test_stop_prefix_is_released_when_finished(tokenizer: Any, prompt_ids: list[int]) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["Hello!"])

    assert detokenizer.update(encode(tokenizer, "Hello")) is None
    assert detokenizer.get_delta_text(finished=False) == ""
    assert detokenizer.get_delta_text(finished=True) == "Hello"


def test_update_after_stop_changes_nothing(tokenizer: Any, prompt_ids: list[int]) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=["."])
    assert detokenizer.update(encode(tokenizer, "Hello world.")) == "."

    assert detokenizer.update(encode(tokenizer, " More text")) is None
    assert detokenizer.output_text == "Hello world"
    assert detokenizer.get_delta_text(finished=True) == "Hello world"


class CountingTokenizer:
    """Wraps a tokenizer and records how many tokens each decode call was given, and how
    often its special ids were asked for (the tokenizer rebuilds them at every ask)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.decoded_lengths: list[int] = []
        self.special_id_asks = 0

    @property
    def all_special_ids(self) -> list[int]:
        self.special_id_asks += 1
        return self._tokenizer.all_special_ids

    def convert_ids_to_tokens(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        # As transformers' tokenizers do it: the special ids asked for at every skipping call.
        skipped = set(self.all_special_ids) if skip_special_tokens else set()
        return self._tokenizer.convert_ids_to_tokens([i for i in ids if i not in skipped])

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        self.decoded_lengths.append(len(tokens))
        return self._tokenizer.convert_tokens_to_string(tokens)


def test_each_update_decodes_a_bounded_window(tokenizer: Any, prompt_ids: list[int]) -> None:
    text = "The quick brown fox 🦊 jumps over the lazy dog 你好. " * 40
    output_ids = encode(tokenizer, text)
    counting = CountingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(counting, prompt_ids, stop=["never appears"])

    _, deltas = stream(detokenizer, output_ids)

    assert len(output_ids) > 500
    assert max(counting.decoded_lengths) <= 10
    assert "".join(deltas) == detokenizer.output_text == text
    assert counting.special_id_asks <= 1  # once per request, not once per token


def test_several_tokens_per_update(tokenizer: Any, prompt_ids: list[int]) -> None:
    # A chunk of "你好世界" ends mid-character, so its tail comes out only with the next.
    output_ids = encode(tokenizer, "Hi 你好世界 there")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[])

    assert detokenizer.update(output_ids[:5]) is None
    first = detokenizer.get_delta_text(finished=False)
    assert detokenizer.update(output_ids[5:]) is None
    rest = detokenizer.get_delta_text(finished=True)

    assert "\ufffd" not in first
    assert first + rest == detokenizer.output_text == "Hi 你好世界 there"
