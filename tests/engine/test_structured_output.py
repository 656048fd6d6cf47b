"""Constrained decoding in the engine: every output matches its grammar, greedy or sampled,
with n > 1, under preemption, and a slow compile never holds up anyone else."""

import json
import re
import threading

import jsonschema
import torch
import pytest

from engine import LLM, SamplingParams
from engine.structured_output import GrammarError, StructuredOutputSpec
from engine.structured_output.llguidance_backend import LLGuidanceBackend

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_path):
    # A random-weight model: left alone it writes noise, so only the grammar makes outputs valid.
    return LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64)


def _all_free(llm) -> bool:
    core = llm.engine_core
    return core.block_manager.num_free_blocks == core.num_blocks and not core.requests


def _constrained(spec, **kw) -> SamplingParams:
    return SamplingParams(structured_output=spec, **{"max_tokens": 96, **kw})


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_json_schema_outputs_validate(llm, temperature):
    params = _constrained(StructuredOutputSpec.json_schema(PERSON), temperature=temperature, n=3, seed=5)
    [out] = llm.generate(["Describe a person:"], params)
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
        assert list(json.loads(c.text)) == ["name", "age", "tags"]  # the schema's property order
    assert _all_free(llm)


def test_regex_choice_and_lark_grammar(llm):
    specs = [
        StructuredOutputSpec.regex(r"[0-9]{3}-[0-9]{4}"),
        StructuredOutputSpec.choice(["red", "green", 'say "blue"']),
        StructuredOutputSpec.grammar('start: "x=" NUM ("+" NUM){1,3}\nNUM: /[1-9][0-9]?/'),
    ]
    outs = llm.generate(["a", "b", "c"], [_constrained(s, temperature=1.0, seed=3) for s in specs])
    texts = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[0])
    assert texts[1] in ("red", "green", 'say "blue"')
    assert re.fullmatch(r"x=[1-9][0-9]?(\+[1-9][0-9]?){1,3}", texts[2])
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_gbnf_grammar_is_accepted(llm):
    gbnf = 'root ::= "yes" | "no"'
    [out] = llm.generate(["?"], _constrained(StructuredOutputSpec.grammar(gbnf), temperature=0))
    assert out.outputs[0].text in ("yes", "no")


def test_max_tokens_still_cuts_with_length(llm):
    spec = StructuredOutputSpec.regex(r"[a-z]{50,}")
    [out] = llm.generate(["go"], _constrained(spec, temperature=0, max_tokens=5))
    c = out.outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 5
    assert re.fullmatch(r"[a-z]+", c.text)


def test_permissive_grammar_leaves_greedy_output_unchanged(llm):
    prompts = ["Hello there", "The quick brown fox"]
    free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    # Everything but special tokens: the unconstrained greedy text here has none.
    spec = StructuredOutputSpec.regex(r"[\s\S]*")
    constrained = llm.generate(prompts, _constrained(spec, temperature=0, max_tokens=12, ignore_eos=True))
    special = set(llm.tokenizer.all_special_ids)
    for a, b in zip(free, constrained):
        assert not special & set(a.outputs[0].token_ids), "pick prompts whose greedy output has no special token"
        assert b.outputs[0].token_ids == a.outputs[0].token_ids


def test_seeded_constrained_samples_are_reproducible(llm):
    params = _constrained(StructuredOutputSpec.json_schema(PERSON), temperature=1.0, n=2, seed=11)
    first = [c.token_ids for c in llm.generate(["p"], params)[0].outputs]
    again = [c.token_ids for c in llm.generate(["p"], params)[0].outputs]
    assert first == again and first[0] != first[1]


def test_preemption_does_not_replay_the_grammar(tiny_model_path):
    # 8 blocks of 16 tokens for 8 requests of ~30 tokens each: requests get preempted and
    # recomputed; their outputs must equal a roomy run's and still validate.
    spec = StructuredOutputSpec.json_schema(PERSON)
    prompts = [f"Person number {i} is" for i in range(8)]
    params = _constrained(spec, temperature=0)
    roomy = LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=64)
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = LLM(model=str(tiny_model_path), max_model_len=256, num_gpu_blocks_override=8)
    outs = tight.generate(prompts, params)
    assert tight.engine_core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_abort_mid_generation_frees_blocks(llm):
    core = llm.engine_core
    core.add_request("so-abort", llm.tokenizer.encode("abc"), _constrained(StructuredOutputSpec.json_schema(PERSON)))
    while not core.requests["so-abort"].output_token_ids:
        core.step()
    core.abort_request("so-abort")
    assert _all_free(llm)


def test_invalid_grammar_raises_before_queueing(llm):
    for spec in [
        StructuredOutputSpec.grammar("start: undefined_rule"),
        StructuredOutputSpec.regex("[a-"),
        StructuredOutputSpec.json_schema({"type": "object", "properties": {"x": {"type": "no-such-type"}}}),
    ]:
        with pytest.raises(GrammarError):
            llm.generate(["x"], _constrained(spec))
    assert _all_free(llm)


def test_slow_compile_does_not_hold_up_other_requests(llm):
    """A request whose grammar is still compiling waits in the queue; the others run."""
    core = llm.engine_core
    manager = core.structured_output
    release = threading.Event()
    real_compile = manager.backend.compile

    def slow_compile(spec):
        release.wait(timeout=30)
        return real_compile(spec)

    manager.backend.compile = slow_compile
    try:
        spec = StructuredOutputSpec.regex(r"slow[0-9]{2}")
        core.add_request("slow", llm.tokenizer.encode("a"), _constrained(spec, temperature=0))
        core.add_request("free", llm.tokenizer.encode("b"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        finished = {}
        while "free" not in finished:
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = out
        assert not core.requests["slow"].output_token_ids  # still waiting for its grammar
        release.set()
        while "slow" not in finished:
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = out
        assert re.fullmatch(r"slow[0-9]{2}", finished["slow"].outputs[0].text)
    finally:
        release.set()
        manager.backend.compile = real_compile
    assert _all_free(llm)


def test_byte_level_tokens_decode_to_their_text(default_model_path):
    """llguidance must read "Ġ" as a space in the bundled (GGUF-converted) tokenizer."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_model_path))
    backend = LLGuidanceBackend(hf, len(hf), [hf.eos_token_id])
    ids = hf.encode(' {"a": 1}')
    assert backend.tokenizer.decode_bytes(ids) == b' {"a": 1}'


class _FakeGrammars:
    """A GrammarConstraint over fixed random bitmasks; `check_first=False` makes the sampler
    mask every constrained row (the reference the shortcut must equal)."""

    def __init__(self, allowed: torch.Tensor, rows: list[int], check_first: bool) -> None:
        self.rows, self._allowed, self._check_first = rows, allowed, check_first  # allowed: [batch, vocab] bool

    def allows(self, row: int, token_id: int) -> bool:
        return self._check_first and bool(self._allowed[row, token_id])

    def bitmask(self, rows: list[int]) -> torch.Tensor:
        bits = self._allowed[rows].view(len(rows), -1, 32).to(torch.int64)
        words = (bits << torch.arange(32)).sum(dim=-1)
        return words.to(torch.int64).apply_(lambda w: w - 2**32 if w >= 2**31 else w).to(torch.int32)


def _sampling_request(i: int, **kw) -> "Request":
    from engine.request import Request

    return Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8, **kw), eos_token_id=2, max_tokens=8)


@pytest.mark.parametrize("kind", ["greedy", "temperature", "top_p"])
def test_checking_the_argmax_first_equals_masking_first(kind):
    from engine.sampler import Sampler

    vocab, batch = 256, 12
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    allowed = torch.rand(batch, vocab, generator=gen) < 0.3
    allowed[:, 0] = True
    params = {"greedy": dict(temperature=0.0), "temperature": dict(temperature=0.9),
              "top_p": dict(temperature=0.9, top_p=0.8)}[kind]
    rows = list(range(0, batch, 2)) + [3]  # some rows unconstrained
    results = []
    for check_first in (True, False):
        requests = [_sampling_request(i, seed=100 + i, **params) for i in range(batch)]
        out = Sampler(seed=1)(logits.clone(), requests, _FakeGrammars(allowed, sorted(rows), check_first))
        results.append(out.token_ids)
    assert results[0] == results[1]
    assert all(allowed[row, results[0][row]] for row in rows)


def test_grammar_wins_over_min_tokens():
    """The grammar allows only end-of-sequence while min_tokens forbids it: the grammar wins."""
    from engine.sampler import Sampler

    vocab = 64
    allowed = torch.zeros(1, vocab, dtype=torch.bool)
    allowed[0, 2] = True  # EOS only
    request = _sampling_request(0, temperature=0.0, min_tokens=4)
    out = Sampler()(torch.randn(1, vocab), [request], _FakeGrammars(allowed, [0], True))
    assert out.token_ids == [2]


def test_a_token_outside_the_grammar_fails_the_request_instead_of_stopping_it(llm, monkeypatch):
    """A matcher that fails mid-output (a parser limit reached late) leaves the sampler no
    allowed token; here something forces one the grammar refuses (a letter where it takes
    digits). The request ends with "abort" and an error naming its field - never "stop"
    with output that breaks the grammar - the bad token stays out of the output, the blocks
    come back, and a server answers the error as a 400 naming the field."""
    from engine import engine_core
    from server.errors import to_api_error

    core = llm.engine_core
    spec = StructuredOutputSpec("regex", "[0-9]{6}", "response_format")
    core.add_request("so-broken", llm.tokenizer.encode("digits:"), _constrained(spec, temperature=0.0))
    while not core.requests["so-broken"].output_token_ids:
        core.step()
    digits = list(core.requests["so-broken"].output_token_ids)
    letter = llm.tokenizer.encode("x", add_special_tokens=False)[0]
    monkeypatch.setattr(engine_core, "_forced_tokens", lambda rows: {i: letter for i in range(len(rows))})
    outputs = []
    while "so-broken" in core.requests:
        outputs += [o for o in core.step() if o.request_id == "so-broken"]
    c = outputs[-1].outputs[0]
    assert c.finish_reason == "abort" and c.token_ids == digits and letter not in c.token_ids
    assert "response_format" in c.error and "could not follow" in c.error
    assert _all_free(llm)
    error = to_api_error(GrammarError(c.error, spec.param))
    assert (error.status_code, error.param, error.code) == (400, "response_format", "grammar_not_followed")
