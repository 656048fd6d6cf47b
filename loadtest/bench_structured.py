"""Structured-outputs benchmark: JSON-schema-constrained decoding vs unconstrained, one run.

    python -m loadtest.bench_structured              # full run (~2 min on 2 idle CPU cores)
    python -m loadtest.bench_structured --quick      # smoke test (tiny sizes)
    python -m loadtest.bench_structured --json out.json

What it measures, all in the same process so the ratios compare like with like (this
VM's speed drifts by up to 2x over minutes):

1. Batch `--batch-size` (32): output tokens/s with every row constrained by a JSON schema
   as a fraction of the same batch unconstrained. Lengths are equal by construction: the
   schema (an object with an array of at least output-len + 8 short strings) cannot be
   complete before `--output-len` tokens, and the unconstrained arm sets `ignore_eos`;
   the run checks that every row of both arms produced exactly output-len tokens and
   that every constrained output is a valid JSON prefix of a document the schema allows.
2. Batch 1: the time each output token gains from the grammar (ms), and the same from
   the engine's step stats minus the change in the model forward (which sees no grammar:
   this drops the forward's run-to-run noise, ~1 ms here, from a ~1 ms effect).
   Both: greedy, chat-template prompts, A/B repetitions interleaved (ABBA order), the
   figure is the median over the pairs of (constrained vs unconstrained of that pair).
3. Grammar compile time p50/p99 over 12 JSON schemas (nested objects, $defs/$ref,
   recursion, arrays with min/max items, enums, number ranges, string pattern/length,
   anyOf, nullable, a tool call), any-JSON-object, a regex, a choice, a Lark and a GBNF
   grammar, each compiled cold (`LLGuidanceBackend.compile`, which caches nothing; the
   engine's cache sits in StructuredOutputManager) several times.
4. Where a constrained step's extra time goes. The sampler asks each constrained row's
   grammar whether it allows the token the row would pick anyway (`GrammarMatcher.allows`)
   and fills (`StepGrammars.bitmask`) and applies (`apply_grammar_bitmask`) a mask only
   for the rows where it does not. (a) In the engine, during the A/B runs (`EngineTimers`):
   those calls, `Sampler._constrain` that makes them, the sampler call, `accept_token`,
   and the rows per step that needed a mask. (b) Alone, replaying the constrained run's
   tokens through fresh matchers: each call on every row, and `_constrain` with no row
   masked and with every row masked.

Progress goes to stderr, the table to stdout. Goals are informational: exit 0 (1 only if
a check of the outputs fails, since the ratios then compare unequal work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loadtest.bench_offline import Report, _check, log
from loadtest.machine import OtherCpu

GOAL_THROUGHPUT_FRACTION = 0.90  # batch 32 constrained tok/s >= 90% of unconstrained
GOAL_ADDED_MS_PER_TOKEN = 1.0  # batch 1: < 1 ms added per output token

BATCH1_PAIRS_PER_REPEAT = 4  # a batch-1 pair takes ~5 s, and its grammar cost is ~2% of a step
ITEM_MAX_LENGTH = 12
TITLE_MAX_LENGTH = 40

# ----------------------------------------------------------------------------- workload

_SUBJECTS = [
    "a lighthouse keeper on a remote island", "the history of the printing press",
    "how bees choose a new home", "a chess match between two old friends", "the water cycle",
    "a robot learning to cook pasta", "why the sky is blue", "a small bakery in a mountain village",
    "the first expedition to the South Pole", "how vaccines work", "a cat who is afraid of the dark",
    "the invention of the telephone", "a train journey across Canada", "compound interest",
    "a garden that blooms at night", "the life cycle of a star",
]
_TEMPLATES = [
    "Give a title and a list of tags for a blog post about {s}. Answer in JSON.",
    "Suggest a headline and keywords for an article on {s}, as a JSON object.",
]


def make_messages(n: int) -> list[list[dict[str, str]]]:
    """n short chat conversations (one user turn), distinct for the first 32."""
    texts = [t.format(s=s) for t in _TEMPLATES for s in _SUBJECTS]
    return [[{"role": "user", "content": texts[i % len(texts)]}] for i in range(n)]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """Token ids of the chat-templated conversations (plain text if the model has no template)."""
    prompts = []
    for messages in make_messages(n):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            if not isinstance(ids, list):  # newer transformers return a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer.encode(messages[0]["content"])
        prompts.append(list(ids))
    return prompts


def bench_schema(output_len: int) -> dict[str, Any]:
    """A schema no output can complete within `output_len` tokens: >= output_len + 8 array
    items, each needing at least one token of its own for its closing quote and separator."""
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": TITLE_MAX_LENGTH},
            "tags": {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": ITEM_MAX_LENGTH},
                "minItems": output_len + 8,
                "maxItems": output_len + 40,
            },
        },
        "required": ["title", "tags"],
        "additionalProperties": False,
    }


# ----------------------------------------------------------------------------- output checks


def complete_json_prefix(text: str) -> str | None:
    """A JSON text that starts with `text`, closed as briefly as possible (or None if `text`
    closes a bracket it never opened). Checks nothing else: json.loads of the result does.

    Tracks strings (escapes included, a partial escape is dropped), the open objects and
    arrays, and inside each what comes next (key, colon, value, comma); then closes the
    open string, fills a missing value with null, drops a dangling comma and closes the
    brackets. A partial number or literal (`tru`, `1.`) is left to `json_prefix_ok`.
    """
    frames: list[list[str]] = []  # [bracket, expecting: key | colon | value | comma]
    in_str = False
    esc_start = -1  # index of an escape's backslash while the escape is incomplete
    hex_left = 0

    def value_done() -> None:
        if frames:
            top = frames[-1]
            top[1] = "colon" if top[0] == "{" and top[1] == "key" else "comma"

    for i, ch in enumerate(text):
        if in_str:
            if hex_left:
                hex_left -= 1
                if not hex_left:
                    esc_start = -1
            elif esc_start >= 0:
                if ch == "u":
                    hex_left = 4
                else:
                    esc_start = -1
            elif ch == "\\":
                esc_start = i
            elif ch == '"':
                in_str = False
                value_done()
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            value_done()
            frames.append([ch, "key" if ch == "{" else "value"])
        elif ch in "}]":
            if not frames:
                return None
            frames.pop()
        elif ch == ":" and frames and frames[-1][0] == "{":
            frames[-1][1] = "value"
        elif ch == "," and frames:
            frames[-1][1] = "key" if frames[-1][0] == "{" else "value"
        elif not ch.isspace() and frames and frames[-1][1] == "value":
            frames[-1][1] = "comma"  # a number or literal started
    out = text
    if in_str:
        if esc_start >= 0:
            out = out[:esc_start]
        out += '"'
        value_done()
    out = out.rstrip()
    if frames:
        bracket, expecting = frames[-1]
        if expecting == "colon":
            out += ": null"
        elif expecting == "value" and out.endswith(":"):
            out += " null"
        elif out.endswith(","):
            out = out[:-1]
    return out + "".join("}" if b == "{" else "]" for b, _ in reversed(frames))


_LITERAL_TAILS = ["", "0", "e", "ue", "rue", "lse", "se", "ull", "ll", "l"]


def json_prefix_ok(text: str) -> Any:
    """The parsed completion of `text` if `text` is a prefix of a JSON document, else raise ValueError."""
    if not text.strip():
        return None
    for tail in _LITERAL_TAILS:  # a partial number or true/false/null at the very end
        completed = complete_json_prefix(text + tail) if tail else complete_json_prefix(text)
        if completed is None:
            break
        try:
            return json.loads(completed)
        except json.JSONDecodeError:
            continue
    raise ValueError(f"not a JSON prefix: {text!r}")


def check_bench_output(text: str) -> str | None:
    """None if `text` is a prefix of an object the bench schema allows, else why not."""
    try:
        doc = json_prefix_ok(text)
    except ValueError as e:
        return str(e)
    if doc is None:
        return None
    if not isinstance(doc, dict):
        return f"not an object: {text!r}"
    if list(doc) != ["title", "tags"][: len(doc)]:
        return f"keys {list(doc)} are not a prefix of ['title', 'tags']: {text!r}"
    title, tags = doc.get("title", ""), doc.get("tags", [])
    if not isinstance(title, str) or len(title) > TITLE_MAX_LENGTH:
        return f"bad title: {text!r}"
    if not isinstance(tags, list) or not all(isinstance(t, str) and len(t) <= ITEM_MAX_LENGTH for t in tags):
        return f"bad tags: {text!r}"
    if any(not t for t in tags[:-1]):  # the last item may be a string just opened
        return f"an empty tag: {text!r}"
    return None


# ----------------------------------------------------------------------------- A/B runs


@dataclass(slots=True)
class Run:
    wall_s: float
    token_counts: list[int]
    finish_reasons: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    num_steps: int | None
    step_time_s: float | None
    forward_time_s: float | None
    timers: dict[str, float] | None
    """Seconds inside the engine's grammar calls during this run (see `EngineTimers`)."""

    def per_step_ms(self, what: str) -> float | None:
        """Mean ms per engine step of `what`: "step", "forward" or a timer name."""
        if not self.num_steps:
            return None
        total = {"step": self.step_time_s, "forward": self.forward_time_s}.get(what)
        if total is None and self.timers is not None:
            total = self.timers.get(what)
        return None if total is None else total / self.num_steps * 1e3


class EngineTimers:
    """Times the engine's grammar calls in place during the A/B runs, and restores them.

    Wraps the engine's sampler call; on that sampler `_constrain` (counting steps and
    constrained rows); `StepGrammars.bitmask` (counting the rows masked);
    `engine.sampler.apply_grammar_bitmask` (looked up at each call); the matcher class's
    `allows` and `accept_token`. A wrapper costs ~0.3 us, ~2 per row and step: ~20 us at
    batch 32 against steps of 30-130 ms. If the engine's internals moved, `active` is False.
    """

    NAMES = ("sampler", "constrain", "allows", "bitmask", "apply", "accept", "steps", "rows", "masked")
    """Seconds in each call; then counts: steps with constrained rows, those rows, rows masked."""

    def __init__(self, llm, spec) -> None:
        self.totals = dict.fromkeys(self.NAMES, 0.0)
        self._undo: list = []
        self.active = False
        try:
            self._install(llm.engine_core, spec)
            self.active = True
        except Exception as e:  # noqa: BLE001 - instrumentation is optional
            log(f"in-engine timers unavailable ({type(e).__name__}: {e}); only the replay split is reported")
            self.uninstall()

    def _patch(self, owner, attr: str, name: str, count=None, instance: bool = False) -> None:
        """Replace `owner.attr` by a timed wrapper; `instance`: shadow a method on one object."""
        totals, fn = self.totals, getattr(owner, attr)

        def wrapper(*args, **kwargs):
            if count is not None:
                count(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t0

        setattr(owner, attr, wrapper)
        self._undo.append((lambda: delattr(owner, attr)) if instance else (lambda: setattr(owner, attr, fn)))

    def _install(self, core, spec) -> None:
        import engine.sampler as sampler_module
        from engine.structured_output import StepGrammars

        totals = self.totals

        def constrained(token_ids, logits, raw_logits, requests, grammar, noise) -> None:
            totals["steps"] += 1
            totals["rows"] += len(grammar.rows)

        def masked(step_grammars, rows) -> None:
            totals["masked"] += len(rows)

        self._patch(core.sampler, "_constrain", "constrain", constrained, instance=True)
        self._patch(StepGrammars, "bitmask", "bitmask", masked)
        self._patch(sampler_module, "apply_grammar_bitmask", "apply")
        matcher_cls = type(core.structured_output.compile(spec).result().new_matcher())
        self._patch(matcher_cls, "allows", "allows")
        self._patch(matcher_cls, "accept_token", "accept")
        self._patch(core, "sampler", "sampler")

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def take(self) -> dict[str, float] | None:
        """The totals since the last take (None when inactive), and reset."""
        out = dict(self.totals) if self.active else None
        self.totals.update(dict.fromkeys(self.NAMES, 0.0))
        return out


def generate(llm, prompts: list[list[int]], params, timers: EngineTimers | None = None) -> Run:
    stats = getattr(llm.engine_core, "stats", None)
    if stats is not None:
        stats.reset()
    if timers is not None:
        timers.take()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    cs = [o.outputs[0] for o in outs]
    return Run(
        wall, [len(c.token_ids) for c in cs], [str(c.finish_reason) for c in cs], [c.text for c in cs],
        [list(c.token_ids) for c in cs],
        None if stats is None else int(stats.num_steps), None if stats is None else float(stats.step_time_s),
        None if stats is None else float(stats.forward_time_s), None if timers is None else timers.take(),
    )


@dataclass
class ABResult:
    batch: int
    pairs: list[tuple[Run, Run]] = field(default_factory=list)  # (free, json), adjacent in time

    def median_tok_s(self, arm: int) -> float:
        return statistics.median(sum(p[arm].token_counts) / p[arm].wall_s for p in self.pairs)

    def median_ms_per_token(self, arm: int) -> float:
        return statistics.median(p[arm].wall_s / max(p[arm].token_counts) * 1e3 for p in self.pairs)

    def paired_throughput_fraction(self) -> float:
        """median over pairs of (json tok/s / free tok/s): equal tokens, so free wall / json wall."""
        return statistics.median(f.wall_s / j.wall_s for f, j in self.pairs)

    def paired_added_ms_per_token(self) -> float:
        """median over pairs of (json wall - free wall) / output tokens per row."""
        return statistics.median((j.wall_s - f.wall_s) / max(j.token_counts) * 1e3 for f, j in self.pairs)

    def in_engine_split(self) -> dict[str, float] | None:
        """Median over pairs of the per-step ms: added = step(json) - step(free); forward =
        its change in the model forward (which sees no grammar: outside_forward = added -
        forward drops the forward's run-to-run noise, ~1 ms at batch 1 here); sampler = the
        change of the whole sampler call, which holds constrain (`Sampler._constrain`), which
        holds allows, bitmask and apply; grammar = sampler + accept; rest = added - forward -
        grammar; masked = rows per step that needed a mask (masked_frac: of constrained rows).
        """
        def per_pair(f: Run, j: Run) -> dict[str, float] | None:
            parts = ("constrain", "allows", "bitmask", "apply", "accept")
            values = {k: j.per_step_ms(k) for k in ("step", "forward", "sampler", *parts)}
            base = {k: f.per_step_ms(k) for k in ("step", "forward", "sampler")}
            if any(v is None for v in [*values.values(), *base.values()]) or not j.timers["rows"]:
                return None
            out = {
                "step_free": base["step"], "step_json": values["step"], "added": values["step"] - base["step"],
                "forward": values["forward"] - base["forward"], "sampler": values["sampler"] - base["sampler"],
                **{k: values[k] for k in parts},
                "masked": j.timers["masked"] / j.timers["steps"], "masked_frac": j.timers["masked"] / j.timers["rows"],
            }
            out["grammar"] = out["sampler"] + out["accept"]
            out["outside_forward"] = out["added"] - out["forward"]
            out["rest"] = out["outside_forward"] - out["grammar"]
            return out

        splits = [per_pair(f, j) for f, j in self.pairs]
        if not splits or any(s is None for s in splits):
            return None
        return {k: statistics.median(s[k] for s in splits) for k in splits[0]}


def run_ab(llm, prompts, free_params, json_params, repeats: int, timers: EngineTimers | None = None) -> ABResult:
    result = ABResult(len(prompts))
    for rep in range(repeats):
        # ABBA: each arm goes first in half the pairs, so a steady drift cancels.
        if rep % 2 == 0:
            free = generate(llm, prompts, free_params, timers)
            constrained = generate(llm, prompts, json_params, timers)
        else:
            constrained = generate(llm, prompts, json_params, timers)
            free = generate(llm, prompts, free_params, timers)
        result.pairs.append((free, constrained))
        log(f"batch {len(prompts):3d} pair {rep + 1}/{repeats}: unconstrained {free.wall_s:.2f} s, "
            f"constrained {constrained.wall_s:.2f} s ({free.wall_s / constrained.wall_s:.1%})")
    return result


def check_runs(results: list[ABResult], output_len: int) -> tuple[list[str], list[str]]:
    """(summary lines, failures): equal lengths in both arms, constrained outputs valid."""
    lines, failures = [], []
    for res in results:
        for arm, name in ((0, "unconstrained"), (1, "constrained")):
            counts = [c for p in res.pairs for c in p[arm].token_counts]
            bad = [c for c in counts if c != output_len]
            lines.append(f"batch {res.batch}, {name}: {len(counts) - len(bad)}/{len(counts)} rows produced exactly "
                         f"{output_len} tokens")
            if bad:
                failures.append(f"batch {res.batch} {name}: rows with {sorted(set(bad))} tokens, not {output_len}")
        reasons = {r for p in res.pairs for r in p[1].finish_reasons}
        if reasons != {"length"}:
            failures.append(f"batch {res.batch} constrained: finish reasons {sorted(reasons)} (expected only length)")
        texts = [t for p in res.pairs for t in p[1].texts]
        errors = [e for e in map(check_bench_output, texts) if e is not None]
        lines.append(f"batch {res.batch}, constrained: {len(texts) - len(errors)}/{len(texts)} outputs are valid JSON "
                     f"prefixes of the schema")
        failures += errors[:3]
    return lines, failures



# ----------------------------------------------------------------------------- compile times


def compile_specs(output_len: int) -> list[tuple[str, Any]]:
    """(name, StructuredOutputSpec): the kinds of schema and grammar the tests and clients use."""
    from engine.structured_output import StructuredOutputSpec as S

    def obj(required: list[str] | None = None, **props) -> dict[str, Any]:
        return {"type": "object", "properties": props, "required": list(props) if required is None else required}

    string, integer, number = {"type": "string"}, {"type": "integer"}, {"type": "number"}
    address = obj(["street", "city"], street={"type": "string", "maxLength": 64}, city=string,
                  zip={"type": "string", "pattern": "^[0-9]{5}$"})
    schemas = {
        "person (string length, int range, enum array)": {**obj(
            name={"type": "string", "minLength": 1, "maxLength": 12},
            age={"type": "integer", "minimum": 0, "maximum": 120},
            tags={"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        ), "additionalProperties": False},
        "nested objects (order > customer > address)": obj(
            id=integer, customer=obj(name=string, address=address),
            lines={"type": "array", "items": obj(sku=string, qty={"type": "integer", "minimum": 1})}),
        "$defs/$ref (shared definitions)": {"$defs": {
            "address": address,
            "money": obj(amount={"type": "number", "minimum": 0}, currency={"enum": ["EUR", "USD", "GBP"]}),
        }, **obj(["billing", "total"], billing={"$ref": "#/$defs/address"}, shipping={"$ref": "#/$defs/address"},
                 total={"$ref": "#/$defs/money"})},
        "recursive $ref (tree)": {"$defs": {"node": obj(
            ["value"], value=integer, children={"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3},
        )}, "$ref": "#/$defs/node"},
        "arrays with min/max items": obj(
            scores={"type": "array", "items": number, "minItems": 2, "maxItems": 5},
            matrix={"type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "array", "items": integer, "minItems": 2, "maxItems": 2}}),
        "enums and const": obj(status={"enum": ["active", "inactive", "pending", "banned"]},
                               level={"enum": [1, 2, 3, None]}, version={"const": "v2"}),
        "integer/number ranges": obj(
            year={"type": "integer", "minimum": 1900, "maximum": 2100},
            temperature={"type": "number", "minimum": -273.15, "maximum": 1000},
            ratio={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
            count={"type": "integer", "minimum": 0}),
        "string pattern and length": obj(
            code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            email={"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
            note={"type": "string", "minLength": 5, "maxLength": 80}),
        "anyOf (two shapes)": obj(shape={"anyOf": [
            obj(kind={"const": "circle"}, radius=number), obj(kind={"const": "rect"}, w=number, h=number)]}),
        "nullable fields": obj(nickname={"type": ["string", "null"]},
                               manager={"anyOf": [{"type": "null"}, obj(name=string)]},
                               age={"type": ["integer", "null"], "minimum": 0}),
        "tool call (name + arguments)": obj(name={"const": "get_weather"}, arguments={**obj(
            ["location"], location=string, unit={"enum": ["celsius", "fahrenheit"]},
            days={"type": "integer", "minimum": 1, "maximum": 14}), "additionalProperties": False}),
        f"this bench's schema ({output_len + 8}+ tags)": bench_schema(output_len),
    }
    return [(f"json: {name}", S.json_schema(schema)) for name, schema in schemas.items()] + [
        ("json_object (any object)", S.json_object()),
        ("regex (ISO date-time)", S.regex(r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-5][0-9]Z")),
        ("choice (5 strings)", S.choice(["positive", "negative", "neutral", "mixed", 'say "unknown"'])),
        ("lark (arithmetic, recursive)", S.grammar(
            'start: expr\nexpr: term (("+" | "-") term)*\nterm: factor (("*" | "/") factor)*\n'
            'factor: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+(\\.[0-9]+)?/\n')),
        ("gbnf (yes/no + reason)", S.grammar('root ::= ("yes" | "no") ", because " [a-z ]{1,40} "."')),
    ]


def time_compiles(llm, specs, repeats: int) -> dict[str, list[float]]:
    """Cold compile times (ms) per spec, `repeats` each, on a backend of its own."""
    from engine.structured_output.llguidance_backend import LLGuidanceBackend

    core = llm.engine_core
    eos_ids = [t for t in [core.eos_token_id, *core.extra_eos_token_ids] if t is not None]
    backend = LLGuidanceBackend(llm.tokenizer, core.model.args.vocab_size, eos_ids)
    backend.compile(specs[0][1])  # one-time: builds llguidance's tokenizer (vocab trie)
    compile_ms: dict[str, list[float]] = {name: [] for name, _ in specs}
    for rep in range(repeats):
        # A different order each round, so no spec follows its own compile.
        for name, spec in specs[rep % len(specs):] + specs[: rep % len(specs)]:
            t0 = time.perf_counter()
            backend.compile(spec)  # no cache in the backend: a full compile each time
            compile_ms[name].append((time.perf_counter() - t0) * 1e3)
    for name, _ in specs:
        log(f"compile {name}: median {statistics.median(compile_ms[name]):.2f} ms")
    return compile_ms


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(-(-q * len(s) // 100)) - 1))]


# ----------------------------------------------------------------------------- grammar costs alone

STANDALONE_KEYS = ("allows", "bitmask", "apply", "accept", "constrain_hit", "constrain_masked")


def time_standalone(llm, spec, token_ids: list[list[int]], rows: int, repeats: int) -> dict[str, float]:
    """Mean ms per step of the sampler's grammar calls alone, replaying `token_ids[:rows]`
    (the constrained run's own outputs) through fresh matchers: `StepGrammars.allows` of
    every row's token, `StepGrammars.bitmask` of every row, `apply_grammar_bitmask` on
    random logits [rows, vocab] float32, `accept_token` of every row, and `Sampler._constrain`
    of greedy rows whose argmax is the replayed token (allowed: no mask) and of rows using
    top-k (always masked; no noise passed, so it takes the masked argmax: the mask's cost
    without the filter's). Counts `bad`: replayed tokens refused and picks outside the grammar."""
    from engine.request import Request
    from engine.sampler import Sampler, apply_grammar_bitmask
    from engine.sampling_params import SamplingParams
    from engine.structured_output import StepGrammars

    manager = llm.engine_core.structured_output
    compiled = manager.compile(spec).result()
    seqs = token_ids[:rows]
    steps = min(len(s) for s in seqs)
    base = torch.randn(rows, llm.engine_core.model.args.vocab_size, generator=torch.Generator().manual_seed(0))
    row_ids, sampler = list(range(rows)), Sampler()
    greedy = [Request(f"g{i}", [0], SamplingParams(temperature=0), None, steps) for i in row_ids]
    top_k = [Request(f"k{i}", [0], SamplingParams(temperature=1.0, top_k=50), None, steps) for i in row_ids]
    totals = dict.fromkeys(STANDALONE_KEYS, 0.0)
    bad = n = 0

    def timed(key: str, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        totals[key] += time.perf_counter() - t0
        return out

    for _ in range(repeats):
        matchers = [compiled.new_matcher() for _ in row_ids]
        for k in range(steps):
            toks = [s[k] for s in seqs]
            grammar = StepGrammars(manager, row_ids, matchers)
            hit = base.clone()
            hit[torch.arange(rows), torch.tensor(toks)] = 1e4
            hit_ids, masked_ids = hit.argmax(dim=-1), base.argmax(dim=-1)
            allowed = timed("allows", lambda: [grammar.allows(r, t) for r, t in zip(row_ids, toks)])
            bitmask = timed("bitmask", grammar.bitmask, row_ids)
            timed("apply", apply_grammar_bitmask, base, bitmask)
            timed("constrain_hit", sampler._constrain, hit_ids, hit, hit, greedy, grammar, {})
            timed("constrain_masked", sampler._constrain, masked_ids, base, base, top_k, grammar, {})
            bad += allowed.count(False) + (hit_ids.tolist() != toks)
            bad += sum(not grammar.allows(r, t) for r, t in zip(row_ids, masked_ids.tolist()))
            bad += timed("accept", lambda: [m.accept_token(t) for m, t in zip(matchers, toks)]).count(False)
            n += 1
    out = {key: v / n * 1e3 for key, v in totals.items()}
    out["steps"], out["bad"] = steps, bad
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_structured", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--batch-size", type=int, default=None, help="constrained-throughput batch (default 32; --quick 4)")
    p.add_argument("--output-len", type=int, default=None, help="tokens every row generates (default 64; --quick 12)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved A/B pairs at the batch size (default 3; --quick 1); batch 1 runs 4x as many")
    p.add_argument("--compile-repeats", type=int, default=None, help="cold compiles per spec (default 5; --quick 1)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, one repetition")
    p.add_argument("--json", default=None, help="save the raw numbers and outputs here")
    args = p.parse_args(argv)
    quick = args.quick
    sizes = (("batch_size", 32, 4), ("output_len", 64, 12), ("repeats", 3, 1), ("compile_repeats", 5, 1))
    for name, full, small in sizes:
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    if args.batch_size < 1 or args.output_len < 2 or args.repeats < 1 or args.compile_repeats < 1:
        p.error("--batch-size, --repeats and --compile-repeats must be >= 1, --output-len >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    command = "python -m loadtest.bench_structured" + "".join(
        " " + shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    args = parse_args(argv)
    from engine import LLM, SamplingParams

    other_cpu = OtherCpu()
    log(f"loading engine (model={args.model or 'bundled default'}, dtype={args.dtype}) ...")
    llm = LLM(model=args.model, dtype=args.dtype)
    from engine.structured_output import StructuredOutputSpec

    n = args.output_len
    spec = StructuredOutputSpec.json_schema(bench_schema(n))
    free_params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    json_params = SamplingParams(temperature=0, max_tokens=n, structured_output=spec)
    big = chat_prompts(llm.tokenizer, args.batch_size)
    one = big[:1]
    log(f"prompts: {len(big)} chat conversations of {min(map(len, big))}-{max(map(len, big))} tokens; "
        f"{n} output tokens per row; torch threads {torch.get_num_threads()}")

    # Warm-up: compiles the schema (then cached, as for any repeated schema), fills the
    # prefix cache with these prompts (so every timed run sees the same cache), warms the shapes.
    llm.engine_core.structured_output.compile(spec).result()
    for prompts in (big, one):
        for params in (free_params, json_params):
            generate(llm, prompts, dataclasses.replace(params, max_tokens=4))

    timers = EngineTimers(llm, spec)
    try:
        log(f"batch {args.batch_size}: {args.repeats} interleaved pairs ...")
        res_big = run_ab(llm, big, free_params, json_params, args.repeats, timers)
        log(f"batch 1: {BATCH1_PAIRS_PER_REPEAT * args.repeats} interleaved pairs ...")
        res_one = run_ab(llm, one, free_params, json_params, BATCH1_PAIRS_PER_REPEAT * args.repeats, timers)
    finally:
        timers.uninstall()
    check_lines, failures = check_runs([res_big, res_one], n)

    log("grammar costs alone (replaying the constrained outputs) ...")
    alone = {res.batch: time_standalone(llm, spec, res.pairs[-1][1].token_ids, res.batch, reps)
             for res, reps in ((res_big, 1 if args.quick else 3), (res_one, 1 if args.quick else 5))}
    for rows, split in alone.items():
        if split["bad"]:
            failures.append(f"replay at {rows} rows: {split['bad']} tokens refused or picked outside the grammar")

    log(f"compile times ({args.compile_repeats} cold compiles per spec) ...")
    specs = compile_specs(n)
    compile_ms = time_compiles(llm, specs, args.compile_repeats)
    other = other_cpu.cores()

    # ------------------------------------------------------------------ report
    report = Report()
    b = args.batch_size
    frac = res_big.paired_throughput_fraction()
    report.add(f"batch {b} unconstrained (ignore_eos), median of {args.repeats}", res_big.median_tok_s(0), "tok/s")
    report.add(f"batch {b} JSON schema on every row, median of {args.repeats}", res_big.median_tok_s(1), "tok/s")
    report.add(f"batch {b} constrained / unconstrained tok/s (median of pairs)", frac * 100, "%", f"{frac:.1%}",
               f">= {GOAL_THROUGHPUT_FRACTION:.0%}", _check(frac, GOAL_THROUGHPUT_FRACTION))
    r1 = BATCH1_PAIRS_PER_REPEAT * args.repeats
    added = res_one.paired_added_ms_per_token()
    report.add(f"batch 1 unconstrained, median of {r1}", res_one.median_ms_per_token(0), "ms/token")
    report.add(f"batch 1 JSON schema, median of {r1}", res_one.median_ms_per_token(1), "ms/token")
    report.add("batch 1 added time per output token (median of pairs)", added, "ms",
               f"{res_one.paired_throughput_fraction():.1%} tok/s kept",
               f"< {GOAL_ADDED_MS_PER_TOKEN:g} ms", "PASS" if added < GOAL_ADDED_MS_PER_TOKEN else "MISS")
    in_engine = {res.batch: res.in_engine_split() for res in (res_big, res_one)}
    if in_engine[1] is not None:
        e = in_engine[1]
        report.add("batch 1 added time per step outside the model forward (engine stats, median of pairs)",
                   e["outside_forward"], "ms", f"grammar work {e['grammar']:.2f} ms",
                   f"< {GOAL_ADDED_MS_PER_TOKEN:g} ms",
                   "PASS" if e["outside_forward"] < GOAL_ADDED_MS_PER_TOKEN else "MISS")
    if in_engine[b] is not None:
        e = in_engine[b]
        report.add(f"batch {b} added time per step (engine stats; grammar work: sampler + accept_token)",
                   e["added"], "ms", f"{e['grammar']:.1f} ms = {e['grammar'] / e['step_free']:.1%} of a step")
    for rows, e in in_engine.items():
        if e is not None:
            report.add(f"batch {rows} rows per step that needed a mask (the grammar forbade the pick)",
                       e["masked"], "rows", f"{e['masked_frac']:.1%} of constrained rows")
    all_compile = [t for ts in compile_ms.values() for t in ts]
    slowest = max(compile_ms, key=lambda k: statistics.median(compile_ms[k]))
    ns = len(specs)
    report.add(f"grammar compile p50 ({ns} specs x {args.compile_repeats}, cold)", percentile(all_compile, 50), "ms")
    report.add(f"grammar compile p99 (slowest: {slowest})", percentile(all_compile, 99), "ms")

    print(
        f"\nStructured outputs benchmark: {os.path.basename(str(llm.engine_core.model_path))}, {args.dtype}, greedy, "
        f"{n} output tokens per row, chat prompts of {min(map(len, big))}-{max(map(len, big))} tokens, "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, other processes' average CPU use "
        f"{'n/a' if other is None else f'{other:.2f}'} cores\n"
    )
    print(f"```\n{command}\n```\n")
    print(report.markdown())

    if all(v is not None for v in in_engine.values()):
        print("\nPer decode step in the engine, where the added time goes (ms per step, median over the A/B pairs; "
              "added = constrained step - unconstrained step from the engine's stats; masked = rows whose pick the "
              "grammar forbade; sampler = the change in the whole sampler call, which holds Sampler._constrain, "
              "which holds the allows checks, StepGrammars.bitmask (the fills) and apply_grammar_bitmask; grammar "
              "work = sampler + accept_token; forward = the change in the model forward; rest = added - forward - "
              "grammar work):\n")
        print("| rows | unconstrained step | constrained step | added | masked rows per step "
              "| sampler (_constrain: allows / bitmask / apply) | accept_token | grammar work | forward | rest |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for batch, e in in_engine.items():
            print(f"| {batch} | {e['step_free']:.2f} | {e['step_json']:.2f} | {e['added']:.2f} "
                  f"({e['added'] / e['step_free']:.1%}) | {e['masked']:.2f} ({e['masked_frac']:.0%}) | "
                  f"{e['sampler']:.2f} ({e['constrain']:.2f}: {e['allows']:.3f} / {e['bitmask']:.2f} / "
                  f"{e['apply']:.2f}) | {e['accept']:.2f} | {e['grammar']:.2f} "
                  f"({e['grammar'] / e['step_free']:.1%}) | {e['forward']:+.2f} | {e['rest']:+.2f} |")

    vocab = llm.engine_core.model.args.vocab_size
    print("\nThe same calls timed alone (mean ms per step; the constrained run's tokens replayed through fresh "
          "matchers; allows, bitmask (the fill) and accept_token of every row; apply_grammar_bitmask on logits "
          f"[rows, {vocab}] float32; Sampler._constrain with no row masked (every argmax allowed) and with every "
          "row masked):\n")
    print("| rows | allows | bitmask | apply_grammar_bitmask | accept_token | _constrain, no row masked "
          "| _constrain, every row masked |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rows, s in alone.items():
        print(f"| {rows} | " + " | ".join(f"{s[k]:.3f}" for k in STANDALONE_KEYS) + " |")

    print("\nChecks:")
    for line in check_lines:
        print(f"- {line}")
    for line in failures:
        print(f"- FAILED: {line}")
    print(f"- {'all checks passed' if not failures else f'{len(failures)} check(s) failed'}")

    if args.json:
        raw = {
            "command": command, "config": vars(args), "schema": bench_schema(n),
            "throughput_fraction": frac, "batch1_added_ms_per_token": added,
            "runs": {str(res.batch): [
                {arm: {k: v for k, v in dataclasses.asdict(r).items() if k != "token_ids"}
                 for arm, r in (("unconstrained", f), ("constrained", j))} for f, j in res.pairs]
                for res in (res_big, res_one)},
            "compile_ms": compile_ms, "in_engine_split": {str(k): v for k, v in in_engine.items()},
            "alone": {str(k): v for k, v in alone.items()}, "failures": failures,
        }
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2)
        log(f"raw numbers saved to {args.json}")
    llm.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
