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
2. Batch 1: the time each output token gains from the grammar (ms).
   Both: greedy, chat-template prompts, A/B repetitions interleaved (ABBA order), the
   figure is the median over the pairs of (constrained vs unconstrained of that pair).
3. Grammar compile time p50/p99 over 12 JSON schemas (nested objects, $defs/$ref,
   recursion, arrays with min/max items, enums, number ranges, string pattern/length,
   anyOf, nullable, a tool call), any-JSON-object, a regex, a choice, a Lark and a GBNF
   grammar, each compiled cold (`LLGuidanceBackend.compile`, which caches nothing; the
   engine's cache sits in StructuredOutputManager) several times; plus the first mask
   of a fresh matcher, and the one-time cost of a backend's first grammar.
4. Where a constrained step's extra time goes, per step: `StructuredOutputManager.fill_bitmask`
   for the batch's rows, `engine.sampler.apply_grammar_bitmask` on logits
   [rows, vocab] float32, the logits copy the sampler makes when a bitmask is present,
   and `accept_token` of every row, timed directly while replaying the constrained
   run's own tokens (so the matchers walk realistic states), against the added step time
   the engine measured.

Progress goes to stderr, the table to stdout. Goals are informational: exit 0 (1 only if
a check of the outputs fails, since the ratios then compare unequal work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from loadtest.bench_offline import OtherCpu, Report, _check, log

GOAL_THROUGHPUT_FRACTION = 0.90  # batch 32 constrained tok/s >= 90% of unconstrained
GOAL_ADDED_MS_PER_TOKEN = 1.0  # batch 1: < 1 ms added per output token

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
    pairs = [(t, s) for t in _TEMPLATES for s in _SUBJECTS]
    return [[{"role": "user", "content": pairs[i % len(pairs)][0].format(s=pairs[i % len(pairs)][1])}] for i in range(n)]


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
    arm: str  # "free" | "json"
    wall_s: float
    token_counts: list[int]
    finish_reasons: list[str]
    texts: list[str]
    token_ids: list[list[int]]
    num_steps: int | None
    step_time_s: float | None


def generate(llm, prompts: list[list[int]], params) -> Run:
    stats = getattr(llm.engine_core, "stats", None)
    if stats is not None:
        stats.reset()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    cs = [o.outputs[0] for o in outs]
    return Run(
        "json" if params.structured_output is not None else "free", wall,
        [len(c.token_ids) for c in cs], [str(c.finish_reason) for c in cs], [c.text for c in cs],
        [list(c.token_ids) for c in cs],
        None if stats is None else int(stats.num_steps), None if stats is None else float(stats.step_time_s),
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

    def paired_added_ms_per_step(self) -> tuple[float, str]:
        """Added time per engine step: the engine's summed step time if it keeps stats, else wall."""
        if all(r.step_time_s is not None and r.num_steps for p in self.pairs for r in p):
            return statistics.median((j.step_time_s / j.num_steps - f.step_time_s / f.num_steps) * 1e3
                                     for f, j in self.pairs), "engine stats"
        return statistics.median((j.wall_s - f.wall_s) / max(j.token_counts) * 1e3 for f, j in self.pairs), "wall"

    def median_step_ms(self, arm: int) -> float | None:
        if not all(p[arm].step_time_s is not None and p[arm].num_steps for p in self.pairs):
            return None
        return statistics.median(p[arm].step_time_s / p[arm].num_steps * 1e3 for p in self.pairs)


def run_ab(llm, prompts, free_params, json_params, repeats: int) -> ABResult:
    result = ABResult(len(prompts))
    for rep in range(repeats):
        # ABBA: each arm goes first in half the pairs, so a steady drift cancels.
        if rep % 2 == 0:
            free = generate(llm, prompts, free_params)
            constrained = generate(llm, prompts, json_params)
        else:
            constrained = generate(llm, prompts, json_params)
            free = generate(llm, prompts, free_params)
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

    address = {
        "type": "object",
        "properties": {"street": {"type": "string", "maxLength": 64}, "city": {"type": "string"},
                       "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city"],
    }
    schemas = {
        "person (string length, int range, enum array)": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
            },
            "required": ["name", "age", "tags"], "additionalProperties": False,
        },
        "nested objects (order > customer > address)": {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "customer": {"type": "object", "properties": {"name": {"type": "string"}, "address": address},
                             "required": ["name", "address"]},
                "lines": {"type": "array", "items": {"type": "object", "properties": {
                    "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}, "required": ["sku", "qty"]}},
            },
            "required": ["id", "customer", "lines"],
        },
        "$defs/$ref (shared definitions)": {
            "$defs": {"address": address, "money": {"type": "object", "properties": {
                "amount": {"type": "number", "minimum": 0}, "currency": {"enum": ["EUR", "USD", "GBP"]}},
                "required": ["amount", "currency"]}},
            "type": "object",
            "properties": {"billing": {"$ref": "#/$defs/address"}, "shipping": {"$ref": "#/$defs/address"},
                           "total": {"$ref": "#/$defs/money"}},
            "required": ["billing", "total"],
        },
        "recursive $ref (tree)": {
            "$defs": {"node": {"type": "object", "properties": {
                "value": {"type": "integer"},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}},
                "required": ["value"]}},
            "$ref": "#/$defs/node",
        },
        "arrays with min/max items": {
            "type": "object",
            "properties": {"scores": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 5},
                           "matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
                               "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}}},
            "required": ["scores", "matrix"],
        },
        "enums and const": {
            "type": "object",
            "properties": {"status": {"enum": ["active", "inactive", "pending", "banned"]},
                           "level": {"enum": [1, 2, 3, None]}, "version": {"const": "v2"}},
            "required": ["status", "level", "version"],
        },
        "integer/number ranges": {
            "type": "object",
            "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                           "temperature": {"type": "number", "minimum": -273.15, "maximum": 1000},
                           "ratio": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                           "count": {"type": "integer", "minimum": 0}},
            "required": ["year", "temperature", "ratio", "count"],
        },
        "string pattern and length": {
            "type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                           "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
                           "note": {"type": "string", "minLength": 5, "maxLength": 80}},
            "required": ["code", "email", "note"],
        },
        "anyOf (two shapes)": {
            "type": "object",
            "properties": {"shape": {"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
                 "required": ["kind", "radius"]},
                {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "number"},
                                                  "h": {"type": "number"}}, "required": ["kind", "w", "h"]}]}},
            "required": ["shape"],
        },
        "nullable fields": {
            "type": "object",
            "properties": {"nickname": {"type": ["string", "null"]},
                           "manager": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
                               "name": {"type": "string"}}, "required": ["name"]}]},
                           "age": {"type": ["integer", "null"], "minimum": 0}},
            "required": ["nickname", "manager", "age"],
        },
        "tool call (name + arguments)": {
            "type": "object",
            "properties": {"name": {"const": "get_weather"}, "arguments": {
                "type": "object",
                "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
                               "days": {"type": "integer", "minimum": 1, "maximum": 14}},
                "required": ["location"], "additionalProperties": False}},
            "required": ["name", "arguments"],
        },
        f"this bench's schema ({output_len + 8}+ tags)": bench_schema(output_len),
    }
    specs = [(f"json: {name}", S.json_schema(schema)) for name, schema in schemas.items()]
    specs += [
        ("json_object (any object)", S.json_object()),
        ("regex (ISO date-time)", S.regex(r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-5][0-9]Z")),
        ("choice (5 strings)", S.choice(["positive", "negative", "neutral", "mixed", 'say "unknown"'])),
        ("lark (arithmetic, recursive)", S.grammar(
            "start: expr\n"
            "expr: term ((\"+\" | \"-\") term)*\n"
            "term: factor ((\"*\" | \"/\") factor)*\n"
            "factor: NUMBER | \"(\" expr \")\"\n"
            "NUMBER: /[0-9]+(\\.[0-9]+)?/\n")),
        ("gbnf (yes/no + reason)", S.grammar('root ::= ("yes" | "no") ", because " [a-z ]{1,40} "."')),
    ]
    return specs


def time_compiles(llm, specs, repeats: int) -> dict[str, Any]:
    """Cold compile and first-mask times per spec; the backend's one-time start-up cost."""
    from engine.structured_output.llguidance_backend import LLGuidanceBackend

    core = llm.engine_core
    eos_ids = [t for t in [core.eos_token_id, *core.extra_eos_token_ids] if t is not None]
    vocab = core.model.args.vocab_size

    def first_mask_ms(backend, compiled) -> float:
        t0 = time.perf_counter()
        bitmask = backend.allocate_bitmask(1)
        backend.fill_bitmask([compiled.new_matcher()], bitmask)
        return (time.perf_counter() - t0) * 1e3

    # One-time: a fresh backend's first grammar builds llguidance's tokenizer (vocab trie).
    t0 = time.perf_counter()
    backend = LLGuidanceBackend(llm.tokenizer, vocab, eos_ids)
    first = backend.compile(specs[0][1])
    first_mask_ms(backend, first)
    startup_ms = (time.perf_counter() - t0) * 1e3

    compile_ms: dict[str, list[float]] = {name: [] for name, _ in specs}
    mask_ms: dict[str, list[float]] = {name: [] for name, _ in specs}
    for rep in range(repeats):
        # A different order each round, so no spec follows its own compile.
        order = specs[rep % len(specs):] + specs[: rep % len(specs)]
        for name, spec in order:
            t0 = time.perf_counter()
            compiled = backend.compile(spec)  # no cache in the backend: a full compile each time
            compile_ms[name].append((time.perf_counter() - t0) * 1e3)
            mask_ms[name].append(first_mask_ms(backend, compiled))
    for name, _ in specs:
        log(f"compile {name}: median {statistics.median(compile_ms[name]):.2f} ms, "
            f"first mask {statistics.median(mask_ms[name]):.2f} ms")
    return {"startup_ms": startup_ms, "compile_ms": compile_ms, "mask_ms": mask_ms}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(-(-q * len(s) // 100)) - 1))]


# ----------------------------------------------------------------------------- per-step split


def time_step_split(llm, spec, token_ids: list[list[int]], rows: int, repeats: int) -> dict[str, float]:
    """Mean ms per engine step of each grammar cost, replaying `token_ids[:rows]` (the
    constrained run's own outputs) through fresh matchers: fill the bitmask, apply it
    (on a fresh copy of random logits [rows, vocab] float32), the sampler's logits copy,
    accept every row's token. Also counts steps where the sampled token was not allowed."""
    from engine.sampler import GrammarBitmask, apply_grammar_bitmask

    manager = llm.engine_core.structured_output
    compiled = manager.compile(spec).result()
    vocab = llm.engine_core.model.args.vocab_size
    seqs = token_ids[:rows]
    steps = min(len(s) for s in seqs)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(rows, vocab, generator=gen)
    row_ids = list(range(rows))
    totals = {"fill": 0.0, "apply": 0.0, "clone": 0.0, "accept": 0.0}
    disallowed = 0
    n = 0
    for _ in range(repeats):
        matchers = [compiled.new_matcher() for _ in range(rows)]
        for k in range(steps):
            t0 = time.perf_counter()
            bitmask = manager.fill_bitmask(matchers)
            t1 = time.perf_counter()
            logits = base.clone()  # what the sampler does when a bitmask is present
            t2 = time.perf_counter()
            apply_grammar_bitmask(logits, GrammarBitmask(bitmask, row_ids), base)
            t3 = time.perf_counter()
            ok = [m.accept_token(s[k]) for m, s in zip(matchers, seqs)]
            t4 = time.perf_counter()
            disallowed += ok.count(False)
            for key, dt in zip(("fill", "clone", "apply", "accept"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[key] += dt
            n += 1
    out = {key: v / n * 1e3 for key, v in totals.items()}
    out["total"] = sum(out.values())
    out["steps"] = steps
    out["disallowed"] = disallowed
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.bench_structured", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--batch-size", type=int, default=None, help="constrained-throughput batch (default 32; --quick 4)")
    p.add_argument("--output-len", type=int, default=None, help="tokens every row generates (default 64; --quick 12)")
    p.add_argument("--repeats", type=int, default=None,
                   help="interleaved A/B pairs at the batch size (default 3; --quick 1); batch 1 runs twice as many")
    p.add_argument("--compile-repeats", type=int, default=None, help="cold compiles per spec (default 5; --quick 1)")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny sizes, one repetition")
    p.add_argument("--json", default=None, help="save the raw numbers and outputs here")
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("batch_size", 32, 4), ("output_len", 64, 12), ("repeats", 3, 1), ("compile_repeats", 5, 1)):
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
    t0 = time.perf_counter()
    llm.engine_core.structured_output.compile(spec).result()
    engine_first_compile_ms = (time.perf_counter() - t0) * 1e3
    for prompts in (big, one):
        for params in (free_params, json_params):
            generate(llm, prompts, dataclasses.replace(params, max_tokens=4))

    log(f"batch {args.batch_size}: {args.repeats} interleaved pairs ...")
    res_big = run_ab(llm, big, free_params, json_params, args.repeats)
    log(f"batch 1: {2 * args.repeats} interleaved pairs ...")
    res_one = run_ab(llm, one, free_params, json_params, 2 * args.repeats)
    check_lines, failures = check_runs([res_big, res_one], n)

    log("per-step split (replaying the constrained outputs) ...")
    tokens_big = res_big.pairs[-1][1].token_ids
    split_big = time_step_split(llm, spec, tokens_big, args.batch_size, 1 if args.quick else 3)
    split_one = time_step_split(llm, spec, res_one.pairs[-1][1].token_ids, 1, 1 if args.quick else 5)
    for split in (split_big, split_one):
        if split["disallowed"]:
            failures.append(f"replay: {split['disallowed']} sampled tokens were outside the grammar")

    log(f"compile times ({args.compile_repeats} cold compiles per spec) ...")
    specs = compile_specs(n)
    comp = time_compiles(llm, specs, args.compile_repeats)
    other = other_cpu.cores()

    # ------------------------------------------------------------------ report
    report = Report()
    b = args.batch_size
    frac = res_big.paired_throughput_fraction()
    report.add(f"batch {b} unconstrained (ignore_eos), median of {args.repeats}", res_big.median_tok_s(0), "tok/s")
    report.add(f"batch {b} JSON schema on every row, median of {args.repeats}", res_big.median_tok_s(1), "tok/s")
    report.add(f"batch {b} constrained / unconstrained tok/s (median of pairs)", frac * 100, "%", f"{frac:.1%}",
               f">= {GOAL_THROUGHPUT_FRACTION:.0%}", _check(frac, GOAL_THROUGHPUT_FRACTION))
    r1 = 2 * args.repeats
    added = res_one.paired_added_ms_per_token()
    report.add(f"batch 1 unconstrained, median of {r1}", res_one.median_ms_per_token(0), "ms/token")
    report.add(f"batch 1 JSON schema, median of {r1}", res_one.median_ms_per_token(1), "ms/token")
    report.add("batch 1 added time per output token (median of pairs)", added, "ms",
               f"{res_one.paired_throughput_fraction():.1%} tok/s kept",
               f"< {GOAL_ADDED_MS_PER_TOKEN:g} ms", "PASS" if added < GOAL_ADDED_MS_PER_TOKEN else "MISS")
    all_compile = [t for ts in comp["compile_ms"].values() for t in ts]
    all_mask = [t for ts in comp["mask_ms"].values() for t in ts]
    slowest = max(comp["compile_ms"], key=lambda k: statistics.median(comp["compile_ms"][k]))
    ns = len(specs)
    report.add(f"grammar compile p50 ({ns} specs x {args.compile_repeats}, cold)", percentile(all_compile, 50), "ms")
    report.add(f"grammar compile p99 (slowest: {slowest})", percentile(all_compile, 99), "ms")
    report.add("first mask of a fresh matcher p50 / p99", percentile(all_mask, 50), "ms",
               f"p99 {percentile(all_mask, 99):.3g} ms")
    report.add("a fresh backend's first grammar (tokenizer build + compile + mask)", comp["startup_ms"], "ms")
    report.add("engine's first grammar (import + tokenizer + compile, once per engine)", engine_first_compile_ms, "ms")

    print(
        f"\nStructured outputs benchmark: {os.path.basename(str(llm.engine_core.model_path))}, {args.dtype}, greedy, "
        f"{n} output tokens per row, chat prompts of {min(map(len, big))}-{max(map(len, big))} tokens, "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs, other processes' average CPU use "
        f"{'n/a' if other is None else f'{other:.2f}'} cores\n"
    )
    print(f"```\n{command}\n```\n")
    print(report.markdown())

    print("\nPer decode step, where the grammar's time goes (mean ms per step; replay of the constrained "
          "run's tokens through fresh matchers; logits [rows, "
          f"{llm.engine_core.model.args.vocab_size}] float32):\n")
    print("| rows | fill_bitmask | apply_grammar_bitmask | sampler logits copy | accept_token (all rows) "
          "| sum | measured added step time | other | constrained step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    split_rows = []
    for res, split in ((res_big, split_big), (res_one, split_one)):
        measured, source = res.paired_added_ms_per_step()
        step = res.median_step_ms(1)
        split_rows.append({**split, "measured_ms": measured, "measured_source": source, "step_ms": step})
        print(f"| {res.batch} | {split['fill']:.3f} | {split['apply']:.3f} | {split['clone']:.3f} | "
              f"{split['accept']:.3f} | {split['total']:.3f} | {measured:.3f} ({source}) | "
              f"{measured - split['total']:.3f} | {'n/a' if step is None else f'{step:.1f}'} |")

    print("\nChecks:")
    for line in check_lines:
        print(f"- {line}")
    for line in failures:
        print(f"- FAILED: {line}")
    print(f"- {'all checks passed' if not failures else f'{len(failures)} check(s) failed'}")

    if args.json:
        raw = {
            "command": command,
            "config": vars(args),
            "schema": bench_schema(n),
            "throughput_fraction": frac,
            "batch1_added_ms_per_token": added,
            "runs": {str(res.batch): [
                {arm: {"wall_s": r.wall_s, "token_counts": r.token_counts, "finish_reasons": r.finish_reasons,
                       "texts": r.texts, "num_steps": r.num_steps, "step_time_s": r.step_time_s}
                 for arm, r in (("unconstrained", f), ("constrained", j))} for f, j in res.pairs]
                for res in (res_big, res_one)},
            "compile_ms": comp["compile_ms"], "first_mask_ms": comp["mask_ms"], "startup_ms": comp["startup_ms"],
            "step_split": split_rows,
            "failures": failures,
        }
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=2)
        log(f"raw numbers saved to {args.json}")
    llm.shutdown()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
