"""Turn each request's last-position logits into its next token.

Order of processing (as vLLM): logprobs of the raw model distribution are taken first;
then penalties, logit bias and the min_tokens mask; then greedy rows take the argmax and
random rows are tempered, filtered (top-k, top-p, min-p) and sampled. Sampling uses the
exponential-race trick (argmax of p / q with q ~ Exp(1)) so a seeded request draws its
noise from its own generator, one row at a time: same seed, same tokens, whatever else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Request


@dataclass(slots=True)
class TokenLogprobs:
    token_ids: list[int]
    """The sampled token first, then the top-k alternatives."""
    logprobs: list[float]
    ranks: list[int]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        logits = logits.float()
        # Logprobs describe the model's own distribution, before any processing.
        want_logprobs = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[want_logprobs], dim=-1) if want_logprobs else None

        if any(_needs_processing(r) for r in requests):
            logits = logits.clone()
            for row, request in enumerate(requests):
                if _needs_processing(request):
                    _apply_penalties_and_bias(logits[row], request)

        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            temps = torch.tensor([requests[i].sampling_params.temperature for i in random_rows])
            sub = _filter(logits[rows] / temps[:, None], [requests[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            q = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                q[j].exponential_(generator=requests[i].generator or self.generator)
            token_ids[rows] = probs.div_(q).argmax(dim=-1)

        sampled = token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            for j, i in enumerate(want_logprobs):
                logprobs[i] = token_logprobs(raw_logprobs[j], sampled[i], requests[i].sampling_params.logprobs)
        return SamplerOutput(sampled, logprobs)


def token_logprobs(row: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    value = row[token_id]
    rank = int((row > value).sum()) + 1
    ids, values, ranks = [token_id], [float(value)], [rank]
    if k > 0:
        top = torch.topk(row, k)
        ids += top.indices.tolist()
        values += top.values.tolist()
        ranks += list(range(1, k + 1))
    return TokenLogprobs(ids, values, ranks)


def _needs_processing(request: Request) -> bool:
    p = request.sampling_params
    return (
        p.has_penalties
        or bool(p.logit_bias)
        or (p.min_tokens > 0 and request.num_output_tokens < p.min_tokens)
    )


def _apply_penalties_and_bias(row: torch.Tensor, request: Request) -> None:
    p = request.sampling_params
    vocab = row.shape[0]
    if p.has_penalties:
        output = torch.tensor(request.output_token_ids, dtype=torch.long)
        output = output[output < vocab]
        if p.repetition_penalty != 1.0:
            # HF/vLLM semantics: every token seen in prompt or output is penalised.
            seen = torch.zeros(vocab, dtype=torch.bool)
            prompt = torch.tensor(request.prompt_token_ids, dtype=torch.long)
            seen[prompt[prompt < vocab]] = True
            seen[output] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            counts = torch.bincount(output, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
        if ids.numel():
            row[ids] += torch.tensor([p.logit_bias[int(t)] for t in ids.tolist()], dtype=row.dtype)
    if p.min_tokens > 0 and request.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids)
        if request.eos_token_id is not None and not p.ignore_eos:
            banned.append(request.eos_token_id)
        banned = [t for t in banned if 0 <= t < vocab]
        if banned:
            row[torch.tensor(banned, dtype=torch.long)] = float("-inf")


def _filter(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Top-k, then top-p over what is left, then min-p; masked entries become -inf."""
    top_ks = [r.sampling_params.top_k for r in requests]
    top_ps = [r.sampling_params.top_p for r in requests]
    min_ps = [r.sampling_params.min_p for r in requests]
    vocab = logits.shape[-1]
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks])
        ranks = torch.arange(vocab)
        sorted_logits.masked_fill_(ranks[None, :] >= ks[:, None], float("-inf"))
        # Rows without top-p get an unreachable threshold: float cumsum can exceed 1.0.
        ps = torch.tensor([p if p < 1.0 else float("inf") for p in top_ps], dtype=logits.dtype)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before >= ps[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        threshold = torch.tensor(min_ps, dtype=logits.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits
