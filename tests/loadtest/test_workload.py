"""Datasets, arrivals, SLOs and the --num-prompts/--concurrency parsing, without a server."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from loadtest.cli import build_parser, num_prompts_for, parse_levels
from loadtest.client import RequestResult
from loadtest.datasets import DatasetSpec, LengthRange, TextSource, build_dataset
from loadtest.runner import LoadSpec, arrival_times
from loadtest.summary import Slo, distribution, summarize


@pytest.fixture(scope="module")
def tokenizer_source(default_model_path) -> TextSource:
    return TextSource(default_model_path)


@pytest.mark.parametrize("length", [1, 15, 17, 128, 300])
def test_random_prompts_have_the_asked_token_count(tokenizer_source, length):
    spec = DatasetSpec("random", LengthRange(length, length), LengthRange(3, 9))
    requests = build_dataset(spec, 8, seed=1, source=tokenizer_source)
    assert [r.prompt_len for r in requests] == [length] * 8
    assert [tokenizer_source.count(r.prompt) for r in requests] == [length] * 8
    assert all(3 <= r.max_tokens <= 9 for r in requests)
    assert len({r.prompt for r in requests}) == 8


def test_same_seed_same_prompts_other_seed_other_prompts(tokenizer_source):
    spec = DatasetSpec("random", LengthRange(10, 20), LengthRange(4, 4))
    a = build_dataset(spec, 5, seed=3, source=tokenizer_source)
    assert a == build_dataset(spec, 5, seed=3, source=tokenizer_source)
    assert not {r.prompt for r in a} & {r.prompt for r in build_dataset(spec, 5, seed=4, source=tokenizer_source)}


def test_word_prompts_without_a_tokenizer():
    spec = DatasetSpec("random", LengthRange(12, 12), LengthRange(4, 4))
    requests = build_dataset(spec, 3, seed=0, source=TextSource(None))
    assert all(len(r.prompt.split()) == 12 and r.prompt_len is None for r in requests)


def test_prefix_dataset_shares_prefixes(tokenizer_source):
    spec = DatasetSpec("prefix", LengthRange(8, 8), LengthRange(4, 4), prefix_len=32, num_prefixes=2)
    requests = build_dataset(spec, 6, seed=0, source=tokenizer_source)
    heads = [r.prompt.split("\n")[0] for r in requests]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert len({r.prompt for r in requests}) == 6
    assert all(tokenizer_source.count(h) == 32 for h in heads)


def test_chat_dataset_is_distinct_conversations():
    requests = build_dataset(DatasetSpec("chat"), 200, seed=0)
    assert all(r.is_chat and r.messages[0]["role"] == "user" for r in requests)
    assert len({r.messages[0]["content"] for r in requests}) == 200  # past the 192 pairs too


def test_grounded_dataset_asks_for_answers_that_quote_the_input():
    requests = build_dataset(DatasetSpec("grounded"), 40, seed=0)
    contents = [r.messages[0]["content"] for r in requests]
    assert all(r.is_chat and r.max_tokens == 128 for r in requests)
    assert any("word for word" in c for c in contents) and any("```python" in c for c in contents)
    assert len(set(contents)) == 40  # 16 passages x 4 + 3 snippets x 3 tasks before repeats
    assert build_dataset(DatasetSpec("grounded"), 40, seed=0) == requests


def test_jsonl_dataset(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello", "max_tokens": 5}\n\n{"messages": [{"role": "user", "content": "Hi"}]}\n')
    requests = build_dataset(DatasetSpec("jsonl", output_len=LengthRange(7, 7), jsonl_path=path), 3, seed=0)
    assert [(r.prompt, r.is_chat, r.max_tokens) for r in requests] == [("Hello", False, 5), (None, True, 7), ("Hello", False, 5)]


@pytest.mark.parametrize("line", ['{"text": "x"}', "not json", '{"prompt": "x", "max_tokens": 0}', '["prompt"]'])
def test_jsonl_errors_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        build_dataset(DatasetSpec("jsonl", jsonl_path=path), 2, seed=0)


@pytest.mark.parametrize("text,expected", [("8", (8, 8)), ("4:16", (4, 16))])
def test_length_range_parse(text, expected):
    r = LengthRange.parse(text)
    assert (r.low, r.high) == expected


@pytest.mark.parametrize("text", ["0", "9:3", "a", "1:b", "-2"])
def test_length_range_rejects(text):
    with pytest.raises(ValueError):
        LengthRange.parse(text)


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_arrivals_have_the_asked_rate(burstiness):
    times = arrival_times(4000, rate=10.0, burstiness=burstiness, rng=random.Random(0))
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.06)
    # Gamma with shape k: coefficient of variation 1/sqrt(k) (burstier below 1).
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1 / math.sqrt(burstiness), rel=0.1)


def test_infinite_rate_sends_at_once():
    assert arrival_times(3, math.inf, 1.0, random.Random(0)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs", [{"concurrency": 0}, {"request_rate": 0}, {"burstiness": -1}, {"duration_s": 0}])
def test_load_spec_rejects(kwargs):
    with pytest.raises(ValueError):
        LoadSpec(**kwargs)


@pytest.mark.parametrize("text,concurrency,expected", [(None, 1, 8), (None, 32, 128), ("2x", 64, 128), ("2x", 1, 8), ("5", 64, 5), (None, None, 32)])
def test_num_prompts_for(text, concurrency, expected):
    assert num_prompts_for(text, concurrency) == expected


def test_sweep_levels():
    levels = parse_levels(build_parser().parse_args(["--sweep"]))
    assert [lv.load.concurrency for lv in levels] == [1, 8, 32, 64]
    assert [lv.label for lv in levels][:2] == ["concurrency 1", "concurrency 8"]


def _result(ttft, e2e, tokens, ok=True, kind=None):
    itl = [(e2e - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestResult(ok=ok, start_s=0, e2e_s=e2e, ttft_s=ttft, itl_s=itl,
                         output_tokens=tokens, max_tokens=tokens, error_kind=kind, error="x" if kind else None)


def test_summary_goodput_and_errors():
    results = [_result(0.1, 1.0, 10), _result(0.6, 1.5, 10), _result(0.1, 0.2, 1), _result(None, 0.01, 0, False, "connect_error")]
    s = summarize(results, wall_s=2.0, slos=(Slo.parse("ttft:500"), Slo.parse("tpot:200")))
    assert (s["completed"], s["failed"], s["errors_by_kind"]) == (3, 1, {"connect_error": 1})
    assert s["output_tokens"] == 21 and s["output_throughput"] == 10.5 and s["request_throughput"] == 1.5
    assert s["tpot"]["count"] == 2 and s["tpot"]["mean_ms"] == pytest.approx(100.0)
    assert s["goodput"]["good_requests"] == 2  # the 600 ms TTFT misses; the 1-token answer has no TPOT to miss
    assert s["goodput"]["request_goodput"] == 1.0


def test_distribution_percentiles():
    d = distribution([i / 1000 for i in range(1, 101)])
    assert (d["median_ms"], d["max_ms"], d["count"]) == (pytest.approx(50.5), pytest.approx(100.0), 100)
    assert d["p90_ms"] == pytest.approx(90.1) and d["p99_ms"] == pytest.approx(99.01)
    assert distribution([]) is None


@pytest.mark.parametrize("text", ["ttft", "ttft:x", "ttft:-1", "latency:10"])
def test_slo_rejects(text):
    with pytest.raises(ValueError):
        Slo.parse(text)
