"""Workloads: the requests one run sends, built from a seed so every server gets the same ones.

Five datasets:

- ``random``: prompts of a random length in ``--input-len`` made of random vocabulary
  tokens (with a tokenizer; the text is re-tokenized and trimmed so the count is close to
  exact) or of random words from the bundled text (without one; ~1.3 tokens a word);
- ``prefix``: ``--num-prefixes`` shared prefixes of ``--prefix-len`` tokens, each prompt one
  of them plus a random suffix of ``--input-len`` tokens (what a prefix cache is for);
- ``chat``: one bundled passage plus one instruction as a chat message (/v1/chat/completions);
- ``grounded``: input-grounded chat requests whose answers quote their input: a bundled
  passage with "repeat / rewrite / summarise by quoting" instructions, or a bundled code
  file with an edit that returns the whole file (what prompt-lookup speculation is for);
- ``jsonl``: a file of ``{"prompt": str}`` or ``{"messages": [...]}`` objects, one a line,
  each optionally with ``"max_tokens"``.

Output lengths come from ``--output-len`` (a jsonl line's own ``max_tokens`` wins).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest import corpus

DATASETS = ("random", "prefix", "chat", "grounded", "jsonl")


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request: a completion prompt or a chat conversation, and its output budget."""

    max_tokens: int
    prompt: str | None = None  # -> /v1/completions
    messages: tuple[dict, ...] | None = None  # -> /v1/chat/completions
    prompt_len: int | None = None  # tokens, by the tokenizer that built it (None: unknown)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass(frozen=True, slots=True)
class LengthRange:
    """An inclusive range of lengths, written ``N`` or ``LOW:HIGH`` on the command line."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"length range must satisfy 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> "LengthRange":
        try:
            low, _, high = str(text).partition(":")
            return cls(int(low), int(high or low))
        except ValueError as e:
            raise ValueError(f"expected N or LOW:HIGH (positive integers), got {text!r}: {e}") from e

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    name: str = "random"
    input_len: LengthRange = LengthRange(128, 128)
    output_len: LengthRange = LengthRange(128, 128)
    prefix_len: int = 256
    num_prefixes: int = 4
    jsonl_path: Path | None = None
    tokenizer_path: Path | None = None  # folder with tokenizer.json, or the file; None: words

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"unknown dataset {self.name!r}; choose from {', '.join(DATASETS)}")
        if self.name == "jsonl" and self.jsonl_path is None:
            raise ValueError("the jsonl dataset needs --jsonl PATH")
        if self.prefix_len < 1 or self.num_prefixes < 1:
            raise ValueError("--prefix-len and --num-prefixes must be >= 1")

    def describe(self) -> dict:
        return {
            "dataset": self.name, "input_len": str(self.input_len), "output_len": str(self.output_len),
            "prefix_len": self.prefix_len if self.name == "prefix" else None,
            "num_prefixes": self.num_prefixes if self.name == "prefix" else None,
            "jsonl": str(self.jsonl_path) if self.jsonl_path else None,
            "tokenizer": str(self.tokenizer_path) if self.tokenizer_path else "words",
        }


class TextSource:
    """Random text of a given length in tokens: from a tokenizer's vocabulary, or from words."""

    def __init__(self, tokenizer_path: Path | None) -> None:
        self.tokenizer = _load_tokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer is not None:
            special = set(self.tokenizer.get_added_tokens_decoder())
            self._ids = [i for i in range(self.tokenizer.get_vocab_size()) if i not in special]
        self._words = corpus.words()

    def count(self, text: str) -> int | None:
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def random_text(self, rng: random.Random, num_tokens: int) -> str:
        if self.tokenizer is None:
            return " ".join(rng.choice(self._words) for _ in range(num_tokens))
        ids = [rng.choice(self._ids) for _ in range(num_tokens)]
        # Decoded random ids re-tokenize to a different count; trim to the target and settle.
        for _ in range(3):
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if len(ids) <= num_tokens:
                return text
            ids = ids[:num_tokens]
        return self.tokenizer.decode(ids)


def _load_tokenizer(path: Path):
    from tokenizers import Tokenizer

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file))


def random_dataset(n: int, spec: DatasetSpec, source: TextSource, rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(n):
        text = source.random_text(rng, spec.input_len.sample(rng))
        out.append(BenchRequest(spec.output_len.sample(rng), prompt=text, prompt_len=source.count(text)))
    return out


def shared_prefix_dataset(n: int, spec: DatasetSpec, source: TextSource, rng: random.Random) -> list[BenchRequest]:
    prefixes = [source.random_text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
    out = []
    for i in range(n):
        text = prefixes[i % len(prefixes)] + "\n" + source.random_text(rng, spec.input_len.sample(rng))
        out.append(BenchRequest(spec.output_len.sample(rng), prompt=text, prompt_len=source.count(text)))
    return out


def chat_dataset(n: int, spec: DatasetSpec, rng: random.Random) -> list[BenchRequest]:
    pairs = [(p, q) for p in corpus.PASSAGES for q in corpus.INSTRUCTIONS]
    rng.shuffle(pairs)
    out = []
    for i in range(n):
        passage, instruction = pairs[i % len(pairs)]
        if i >= len(pairs):  # past the distinct pairs: still a distinct conversation
            instruction = f"{instruction} (Variant {i // len(pairs)}.)"
        message = {"role": "user", "content": f"{passage}\n\n{instruction}"}
        out.append(BenchRequest(spec.output_len.sample(rng), messages=(message,)))
    return out


def grounded_dataset(n: int, spec: DatasetSpec, rng: random.Random) -> list[BenchRequest]:
    tasks = [f"{p}\n\n{q}" for p in corpus.PASSAGES for q in corpus.GROUNDED_INSTRUCTIONS]
    tasks += [f"```python\n{code}```\n\n{q}" for code in corpus.CODE_SNIPPETS for q in corpus.CODE_EDITS]
    rng.shuffle(tasks)
    out = []
    for i in range(n):
        content = tasks[i % len(tasks)]
        message = {"role": "user", "content": content}
        out.append(BenchRequest(spec.output_len.sample(rng), messages=(message,)))
    return out


def jsonl_dataset(n: int, spec: DatasetSpec, rng: random.Random) -> list[BenchRequest]:
    rows = read_jsonl(spec.jsonl_path)
    out = []
    for i in range(n):
        row = rows[i % len(rows)]
        max_tokens = row.get("max_tokens") or spec.output_len.sample(rng)
        if "messages" in row:
            out.append(BenchRequest(max_tokens, messages=tuple(row["messages"])))
        else:
            out.append(BenchRequest(max_tokens, prompt=row["prompt"]))
    return out


def read_jsonl(path: Path) -> list[dict]:
    """The prompt objects of a JSONL file; ValueError naming the line for anything else."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            ok_prompt = isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"]
            ok_messages = isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]
            if not (ok_prompt or ok_messages):
                raise ValueError(f'{path}:{lineno}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
            max_tokens = row.get("max_tokens")
            if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                raise ValueError(f"{path}:{lineno}: max_tokens must be a positive integer")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def build_dataset(spec: DatasetSpec, n: int, seed: int, source: TextSource | None = None) -> list[BenchRequest]:
    """``n`` requests of ``spec``; the same (spec, n, seed) always gives the same requests."""
    rng = random.Random(seed)
    if spec.name == "chat":
        return chat_dataset(n, spec, rng)
    if spec.name == "grounded":
        return grounded_dataset(n, spec, rng)
    if spec.name == "jsonl":
        return jsonl_dataset(n, spec, rng)
    source = source or TextSource(spec.tokenizer_path)
    if spec.name == "prefix":
        return shared_prefix_dataset(n, spec, source, rng)
    return random_dataset(n, spec, source, rng)
