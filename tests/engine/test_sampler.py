"""Sampler: greedy, seeded reproducibility, filters, penalties, bias, min_tokens, logprobs.

Penalty tests use crafted logits where the greedy choice flips exactly when the penalty
is applied with the right size, so a wrong formula picks a different token.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, argmax_suffices
from engine.sampling_params import SamplingParams

VOCAB = 32
EOS = 3


def make_request(
    params: SamplingParams,
    *,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos_token_id: int | None = EOS,
    request_id: str = "r",
) -> Request:
    request = Request(request_id, prompt if prompt is not None else [30, 31], params, eos_token_id, max_tokens=64)
    request.output_token_ids.extend(output or [])
    return request


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def crafted(values: dict[int, float], vocab: int = VOCAB, fill: float = 0.0) -> torch.Tensor:
    """One row of logits: `fill` everywhere except the given token ids."""
    row = torch.full((1, vocab), fill)
    for token, value in values.items():
        row[0, token] = value
    return row


def greedy(logits: torch.Tensor, request: Request) -> int:
    return Sampler(0)(logits, [request]).token_ids[0]


def draw_many(logits_row: torch.Tensor, params: SamplingParams, n: int = 2000, seed: int = 0) -> Counter:
    """n independent unseeded rows with the same logits in one batch."""
    requests = [make_request(params, request_id=str(i)) for i in range(n)]
    out = Sampler(seed)(logits_row.expand(n, -1).clone(), requests)
    return Counter(out.token_ids)


# --- greedy ---------------------------------------------------------------------------


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    requests = [make_request(SamplingParams(temperature=0.0), request_id=str(i)) for i in range(8)]
    out = Sampler(0)(logits, requests)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ignores_filters_and_sampler_seed() -> None:
    logits = random_logits(4, seed=1)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.2, min_p=0.5)
    requests = [make_request(params, request_id=str(i)) for i in range(4)]
    assert Sampler(1)(logits, requests).token_ids == Sampler(2)(logits, requests).token_ids
    assert Sampler(1)(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


# --- seeded sampling ------------------------------------------------------------------


STEPS = 6


def step_logits(step: int, rows: int) -> torch.Tensor:
    # Flat-ish logits so a sample is far from the argmax most of the time.
    return random_logits(rows, vocab=64, seed=100 + step, scale=1.0)


def run_seeded_alone(params: SamplingParams, sampler_seed: int) -> list[int]:
    request = make_request(params, request_id="seeded")
    sampler = Sampler(sampler_seed)
    for step in range(STEPS):
        logits = step_logits(step, 1)
        request.output_token_ids.append(sampler(logits, [request]).token_ids[0])
    return request.output_token_ids


SEEDED_PARAMS = {
    "plain": SamplingParams(temperature=1.0, seed=1234),
    "filtered": SamplingParams(temperature=0.8, seed=99, top_k=20, top_p=0.9, min_p=0.02),
    "penalised": SamplingParams(temperature=1.2, seed=7, frequency_penalty=0.5, repetition_penalty=1.3),
}


@pytest.mark.parametrize("params", list(SEEDED_PARAMS.values()), ids=list(SEEDED_PARAMS))
def test_seeded_request_reproducible_across_samplers(params: SamplingParams) -> None:
    first = run_seeded_alone(params, sampler_seed=0)
    second = run_seeded_alone(params, sampler_seed=12345)
    assert first == second
    # Not a constant: the test would pass trivially if sampling collapsed to one token.
    assert len(set(first)) > 1


@pytest.mark.parametrize("position", [0, 2, 4], ids=lambda p: f"row{p}")
@pytest.mark.parametrize("params", list(SEEDED_PARAMS.values()), ids=list(SEEDED_PARAMS))
def test_seeded_request_independent_of_batch(params: SamplingParams, position: int) -> None:
    alone = run_seeded_alone(params, sampler_seed=0)

    seeded = make_request(params, request_id="seeded")
    others = [
        make_request(SamplingParams(temperature=1.0), request_id="random"),
        make_request(SamplingParams(temperature=0.0), request_id="greedy"),
        make_request(SamplingParams(temperature=0.5, top_k=5, top_p=0.5, min_p=0.1), request_id="filtered"),
        make_request(SamplingParams(temperature=1.0, seed=1, presence_penalty=1.0), request_id="other_seed"),
    ]
    batch = others[:position] + [seeded] + others[position:]
    sampler = Sampler(777)
    for step in range(STEPS):
        logits = step_logits(step, len(batch))
        # The seeded row sees the same logits as when it ran alone; the others see noise.
        logits[position] = step_logits(step, 1)[0]
        logits[[i for i in range(len(batch)) if i != position]] = random_logits(len(batch) - 1, vocab=64, seed=step)
        out = sampler(logits, batch)
        for request, token in zip(batch, out.token_ids):
            request.output_token_ids.append(token)
    assert seeded.output_token_ids == alone


def _lowbias32(x: int) -> int:
    """Wellons' lowbias32 in plain Python integers (the reference of the sampler's torch version)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_seeded_noise_hash_is_exact_in_int64() -> None:
    """The device hash splits its multiplications so nothing overflows int64: equal to the
    plain-integer hash on values across the whole 32-bit range."""
    from engine.sampler import _mix32

    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, *torch.randint(0, 2**32, (500,)).tolist()]
    assert _mix32(torch.tensor(values, dtype=torch.int64)).tolist() == [_lowbias32(v) for v in values]


def test_seeded_noise_is_per_seed_and_position_and_exponential() -> None:
    from engine.sampler import seeded_exponential

    q = seeded_exponential([7, 7, 8, 7], [0, 1, 0, 0], 4096, torch.device("cpu"))
    assert torch.equal(q[0], q[3])  # a function of (seed, position) alone
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    assert bool((q > 0).all()) and bool(torch.isfinite(q).all())
    # Exp(1): mean 1, P(q > 1) = 1/e (4096 x 3 draws: standard errors ~0.01 and ~0.005).
    distinct = q[:3]
    assert abs(distinct.mean().item() - 1.0) < 0.05
    assert abs((distinct > 1).float().mean().item() - math.exp(-1)) < 0.025


def test_seeded_rows_sample_the_distribution() -> None:
    """2000 requests with distinct seeds, one batch: the tokens follow softmax(logits)."""
    row = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    requests = [make_request(SamplingParams(temperature=1.0, seed=s), request_id=str(s)) for s in range(2000)]
    counts = Counter(Sampler(0)(row.expand(2000, -1).clone(), requests).token_ids)
    for token, p in enumerate([0.5, 0.3, 0.15, 0.05]):
        assert abs(counts[token] / 2000 - p) < 4 * math.sqrt(p * (1 - p) / 2000), counts


def test_unseeded_requests_follow_the_sampler_seed() -> None:
    logits = random_logits(16, vocab=64, scale=1.0)
    requests = [make_request(SamplingParams(temperature=1.0), request_id=str(i)) for i in range(16)]
    a = Sampler(5)(logits, requests).token_ids
    assert Sampler(5)(logits, requests).token_ids == a
    assert Sampler(6)(logits, requests).token_ids != a


# --- filters --------------------------------------------------------------------------


def test_top_k_1_is_argmax_at_high_temperature() -> None:
    logits = random_logits(200, seed=3, scale=0.1)  # nearly flat: temperature 50 makes it uniform
    requests = [make_request(SamplingParams(temperature=50.0, top_k=1), request_id=str(i)) for i in range(200)]
    assert Sampler(0)(logits, requests).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("k", [2, 5, 10])
def test_top_k_samples_only_among_the_k_best(k: int) -> None:
    row = random_logits(1, seed=4, scale=0.5)
    counts = draw_many(row, SamplingParams(temperature=1.0, top_k=k), n=3000)
    allowed = set(torch.topk(row[0], k).indices.tolist())
    assert set(counts) == allowed  # nothing outside, and every one of the k shows up


def test_small_top_p_keeps_only_the_top_token() -> None:
    row = random_logits(1, seed=5, scale=0.5)  # top token has well under half the mass
    counts = draw_many(row, SamplingParams(temperature=1.0, top_p=0.01))
    assert set(counts) == {int(row.argmax())}


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: mass before token 2 is 0.8 >= 0.7, so {0, 1} remain.
    row = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = draw_many(row, SamplingParams(temperature=1.0, top_p=0.7))
    assert set(counts) == {0, 1}


def test_min_p_drops_tokens_below_fraction_of_max_prob() -> None:
    # min_p 0.2 of max prob 0.5 => threshold 0.1: token 3 (0.05) goes, token 2 (0.15) stays.
    row = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    counts = draw_many(row, SamplingParams(temperature=1.0, min_p=0.2), n=3000)
    assert set(counts) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [1.0, 0.5], ids=lambda t: f"t{t}")
def test_empirical_frequencies_match_softmax(temperature: float) -> None:
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    row = torch.log(probs)[None, :]
    n = 4000
    counts = draw_many(row, SamplingParams(temperature=temperature), n=n, seed=2024)
    expected = torch.softmax(row[0] / temperature, dim=-1)
    observed = torch.tensor([counts[i] / n for i in range(4)])
    # Binomial std for p <= 0.5 at n = 4000 is under 0.008; 0.03 is about four of them.
    torch.testing.assert_close(observed, expected, atol=0.03, rtol=0)


# --- logit bias -----------------------------------------------------------------------


def test_logit_bias_plus_100_forces_a_token() -> None:
    row = random_logits(1, seed=6)
    target = int(row.argmin())
    counts = draw_many(row, SamplingParams(temperature=1.0, logit_bias={target: 100.0}), n=500)
    assert set(counts) == {target}


def test_logit_bias_minus_100_bans_a_token() -> None:
    row = random_logits(1, seed=7)
    best, second = torch.topk(row[0], 2).indices.tolist()
    assert greedy(row, make_request(SamplingParams(temperature=0.0, logit_bias={best: -100.0}))) == second
    counts = draw_many(row, SamplingParams(temperature=1.0, logit_bias={best: -100.0}), n=2000)
    assert best not in counts


def test_logit_bias_ignores_ids_outside_the_vocab() -> None:
    row = random_logits(1, seed=8)
    params = SamplingParams(temperature=0.0, logit_bias={VOCAB + 5: 100.0})
    assert greedy(row, make_request(params)) == int(row.argmax())


# --- penalties ------------------------------------------------------------------------
# Token 0 leads token 1 by 0.5; token 0 was generated twice.
PENALTY_LOGITS = {0: 5.0, 1: 4.5}


@pytest.mark.parametrize(
    ("penalty", "expected"),
    [(0.3, 1), (0.2, 0)],  # 2 x 0.3 = 0.6 > 0.5 flips; 2 x 0.2 = 0.4 does not
    ids=["flips", "holds"],
)
def test_frequency_penalty_scales_with_count(penalty: float, expected: int) -> None:
    request = make_request(SamplingParams(temperature=0.0, frequency_penalty=penalty), output=[0, 0])
    assert greedy(crafted(PENALTY_LOGITS), request) == expected


@pytest.mark.parametrize(
    ("penalty", "expected"),
    [(0.6, 1), (0.4, 0)],  # once, whatever the count: 0.4 < 0.5 holds even though 2 x 0.4 would flip
    ids=["flips", "holds"],
)
def test_presence_penalty_applies_once(penalty: float, expected: int) -> None:
    request = make_request(SamplingParams(temperature=0.0, presence_penalty=penalty), output=[0, 0])
    assert greedy(crafted(PENALTY_LOGITS), request) == expected


def test_presence_and_frequency_penalties_add() -> None:
    # 0.2 + 2 x 0.2 = 0.6 > 0.5: neither alone flips (0.2, 0.4), together they do.
    params = SamplingParams(temperature=0.0, presence_penalty=0.2, frequency_penalty=0.2)
    assert greedy(crafted(PENALTY_LOGITS), make_request(params, output=[0, 0])) == 1


def test_presence_and_frequency_penalties_ignore_prompt_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    request = make_request(params, prompt=[0, 0, 0], output=[7])
    assert greedy(crafted(PENALTY_LOGITS), request) == 0


def test_negative_presence_penalty_boosts_seen_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=-0.6)
    assert greedy(crafted(PENALTY_LOGITS), make_request(params, output=[1])) == 1


@pytest.mark.parametrize(
    ("penalty", "expected"),
    [(1.5, 1), (1.2, 0)],  # 4 / 1.5 = 2.67 < 3 flips; 4 / 1.2 = 3.33 > 3 holds
    ids=["flips", "holds"],
)
@pytest.mark.parametrize("seen_in", ["prompt", "output"])
def test_repetition_penalty_divides_positive_logits(penalty: float, expected: int, seen_in: str) -> None:
    logits = crafted({0: 4.0, 1: 3.0})
    seen = {"prompt": [0], "output": []} if seen_in == "prompt" else {"prompt": [9], "output": [0]}
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert greedy(logits, make_request(params, **seen)) == expected


@pytest.mark.parametrize(
    ("penalty", "expected"),
    [(1.5, 1), (1.3, 0)],  # -1 x 1.5 = -1.5 < -1.4 flips; -1 x 1.3 = -1.3 > -1.4 holds
    ids=["flips", "holds"],
)
def test_repetition_penalty_multiplies_negative_logits(penalty: float, expected: int) -> None:
    logits = crafted({0: -1.0, 1: -1.4}, fill=-10.0)
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    assert greedy(logits, make_request(params, prompt=[0])) == expected


# --- min_tokens -----------------------------------------------------------------------


def test_min_tokens_masks_eos_until_reached() -> None:
    logits = crafted({EOS: 10.0, 5: 1.0})
    params = SamplingParams(temperature=0.0, min_tokens=2)
    assert greedy(logits, make_request(params, output=[])) == 5
    assert greedy(logits, make_request(params, output=[5])) == 5
    assert greedy(logits, make_request(params, output=[5, 5])) == EOS


def test_min_tokens_masks_stop_token_ids() -> None:
    logits = crafted({EOS: 10.0, 11: 9.0, 12: 8.0, 5: 1.0})
    params = SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[11, 12])
    assert greedy(logits, make_request(params)) == 5
    assert greedy(logits, make_request(params, output=[5])) == EOS


def test_min_tokens_under_random_sampling_never_draws_eos() -> None:
    row = crafted({EOS: 3.0, 11: 3.0})
    params = SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=[11])
    counts = draw_many(row, params, n=2000)
    assert EOS not in counts and 11 not in counts


def test_min_tokens_with_ignore_eos_leaves_eos() -> None:
    logits = crafted({EOS: 10.0, 11: 9.0, 5: 1.0})
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[11], ignore_eos=True)
    assert greedy(logits, make_request(params)) == EOS


# --- logprobs -------------------------------------------------------------------------


def test_logprobs_describe_the_raw_distribution() -> None:
    logits = random_logits(3, seed=9)
    raw = torch.log_softmax(logits.double(), dim=-1)
    forced = int(torch.topk(logits[0], 6).indices[-1])  # sixth best: rank 6
    requests = [
        # The bias forces a token; its logprob and rank are still those of the raw logits.
        make_request(SamplingParams(temperature=0.0, logprobs=3, logit_bias={forced: 100.0}), request_id="a"),
        make_request(SamplingParams(temperature=0.7, logprobs=0, presence_penalty=1.5), output=[1, 2], request_id="b"),
        make_request(SamplingParams(temperature=1.0), request_id="c"),
    ]
    out = Sampler(0)(logits, requests)
    assert out.token_ids[0] == forced
    assert out.logprobs[2] is None

    first = out.logprobs[0]
    assert first.token_ids[0] == forced
    assert first.ranks[0] == 6
    assert first.logprobs[0] == pytest.approx(float(raw[0, forced]), abs=1e-5)
    top = torch.topk(raw[0], 3)
    assert first.token_ids[1:] == top.indices.tolist()
    assert first.ranks[1:] == [1, 2, 3]
    torch.testing.assert_close(torch.tensor(first.logprobs[1:], dtype=torch.float64), top.values, atol=1e-5, rtol=0)
    assert first.logprobs[1:] == sorted(first.logprobs[1:], reverse=True)

    second = out.logprobs[1]
    token = out.token_ids[1]
    assert second.token_ids == [token]
    assert second.logprobs[0] == pytest.approx(float(raw[1, token]), abs=1e-5)
    assert second.ranks == [int((raw[1] > raw[1, token]).sum()) + 1]


@pytest.mark.parametrize("k", [1, 5, VOCAB], ids=lambda k: f"top{k}")
def test_logprob_alternatives_equal_topk_of_log_softmax(k: int) -> None:
    logits = random_logits(2, seed=10)
    params = SamplingParams(temperature=1.0, seed=3, logprobs=k)
    out = Sampler(0)(logits, [make_request(params, request_id="a"), make_request(params, request_id="b")])
    raw = torch.log_softmax(logits.double(), dim=-1)
    for row, lp in enumerate(out.logprobs):
        top = torch.topk(raw[row], k)
        assert lp.token_ids[1:] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.logprobs[1:], dtype=torch.float64), top.values, atol=1e-5, rtol=0)
        sampled = out.token_ids[row]
        assert lp.ranks[0] == int((raw[row] > raw[row, sampled]).sum()) + 1
        assert math.isclose(lp.logprobs[0], float(raw[row, sampled]), abs_tol=1e-5)


@pytest.mark.parametrize("params, suffices", [
    (SamplingParams(temperature=0.0), True),
    (SamplingParams(temperature=0.0, top_k=5, top_p=0.5, seed=3), True),  # filters do not move a greedy argmax
    (SamplingParams(temperature=0.7), False),
    (SamplingParams(temperature=0.0, logprobs=0), False),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1), False),
    (SamplingParams(temperature=0.0, presence_penalty=0.5), False),
    (SamplingParams(temperature=0.0, logit_bias={5: 1.0}), False),
    (SamplingParams(temperature=0.0, min_tokens=4), False),  # end-of-sequence masked until then
])
def test_argmax_suffices_only_where_the_sampler_reads_nothing_else(params, suffices) -> None:
    """Which rows may take the LM head's argmax route (`AttentionMetadata.argmax_only`)."""
    assert argmax_suffices(make_request(params)) is suffices
