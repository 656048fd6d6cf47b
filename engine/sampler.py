"""Turn each request's last-position logits into its next token.

Order of processing (as vLLM): logprobs of the raw model distribution are taken first;
then penalties, logit bias and the min_tokens mask; then the grammar's token bitmask
(structured outputs); then greedy rows take the argmax and random rows are tempered,
filtered (top-k, top-p, min-p) and sampled, so both obey the grammar. Sampling uses the
exponential-race trick (argmax of p / q with q ~ Exp(1)) so a seeded request draws its
noise from its own generator, one row at a time: same seed, same tokens, whatever else
is in the batch (and on whatever device: seeded noise is drawn on the CPU).

Everything stays on the logits' device until one transfer of the results at the end of
the step: per-request values (temperatures, top-k, penalty ids) go to the device as small
tensors, never the other way, so on a GPU the host waits for the step once.
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
class GrammarBitmask:
    """The tokens each grammar-constrained row may sample (the others are unconstrained)."""

    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, CPU: bit t%32 of word t//32 = token t allowed
    rows: list[int]
    """The sampler rows (indices into the step's sampling requests) the bitmask rows belong to."""


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._device_generators: dict[torch.device, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, requests: list[Request], grammar_bitmask: GrammarBitmask | None = None
    ) -> SamplerOutput:
        logits = logits.float()
        device = logits.device
        # Logprobs describe the model's own distribution, before any processing.
        want_logprobs = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[_on(device, want_logprobs)], dim=-1) if want_logprobs else None

        if any(_needs_processing(r) for r in requests) or grammar_bitmask is not None:
            raw_logits, logits = logits, logits.clone()
            for row, request in enumerate(requests):
                if _needs_processing(request):
                    _apply_penalties_and_bias(logits[row], request)
            if grammar_bitmask is not None:
                apply_grammar_bitmask(logits, grammar_bitmask, raw_logits)

        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        if random_rows:
            rows = _on(device, random_rows)
            temps = _on(device, [requests[i].sampling_params.temperature for i in random_rows], logits.dtype)
            sub = _filter(logits[rows] / temps[:, None], [requests[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            q = self._exponential_noise(probs, [requests[i] for i in random_rows])
            token_ids[rows] = probs.div_(q).argmax(dim=-1)

        pending = None
        if raw_logprobs is not None:
            ks = [requests[i].sampling_params.logprobs for i in want_logprobs]
            pending = _DeviceLogprobs.of(raw_logprobs, token_ids[_on(device, want_logprobs)], ks)
        sampled = token_ids.tolist()  # the step's one wait for the device; what follows is ready
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if pending is not None:
            for i, lp in zip(want_logprobs, pending.to_host()):
                logprobs[i] = lp
        return SamplerOutput(sampled, logprobs)

    def _exponential_noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exp(1) noise, a row per request: unseeded rows in one draw from this device's
        sampler generator, seeded rows from their own (CPU) generator, row by row."""
        device, vocab = probs.device, probs.shape[-1]
        unseeded = [j for j, r in enumerate(requests) if r.generator is None]
        q = torch.empty_like(probs)
        if unseeded:
            noise = torch.empty((len(unseeded), vocab), dtype=probs.dtype, device=device)
            noise.exponential_(generator=self._generator(device))
            if len(unseeded) == len(requests):
                q = noise
            else:
                q[_on(device, unseeded)] = noise
        for j, request in enumerate(requests):
            if request.generator is not None:
                row = torch.empty(vocab, dtype=probs.dtype).exponential_(generator=request.generator)
                q[j].copy_(row, non_blocking=True)
        return q

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[device]


def _on(device: torch.device, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A small host list as a tensor on `device`; host-to-device only, no wait for the device."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


@dataclass(slots=True)
class _DeviceLogprobs:
    """Per row: the sampled token's logprob and rank and the top-k alternatives, on the device."""

    token_ids: torch.Tensor  # [rows]
    chosen: torch.Tensor  # [rows]
    ranks: torch.Tensor  # [rows]
    top: torch.return_types.topk | None  # [rows, max(ks)]
    ks: list[int]

    @classmethod
    def of(cls, raw: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> "_DeviceLogprobs":
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1)
        ranks = (raw > chosen[:, None]).sum(dim=1) + 1
        top = torch.topk(raw, max(ks), dim=-1) if max(ks) > 0 else None
        return cls(token_ids, chosen, ranks, top, ks)

    def to_host(self) -> list[TokenLogprobs]:
        ids, chosen, ranks = self.token_ids.tolist(), self.chosen.tolist(), self.ranks.tolist()
        top_ids = self.top.indices.tolist() if self.top is not None else None
        top_values = self.top.values.tolist() if self.top is not None else None
        out = []
        for j, k in enumerate(self.ks):
            lp = TokenLogprobs([ids[j]], [chosen[j]], [ranks[j]])
            if k > 0:
                lp.token_ids += top_ids[j][:k]
                lp.logprobs += top_values[j][:k]
                lp.ranks += list(range(1, k + 1))
            out.append(lp)
        return out


def token_logprobs(row: torch.Tensor, token_id: int, k: int) -> TokenLogprobs:
    """The logprob and rank of `token_id` in `row` (log-softmaxed), then its top k."""
    return _DeviceLogprobs.of(row[None], _on(row.device, [token_id]), [k]).to_host()[0]


def _needs_processing(request: Request) -> bool:
    p = request.sampling_params
    return (
        p.has_penalties
        or bool(p.logit_bias)
        or (p.min_tokens > 0 and request.num_output_tokens < p.min_tokens)
    )


def _apply_penalties_and_bias(row: torch.Tensor, request: Request) -> None:
    p = request.sampling_params
    vocab, device = row.shape[0], row.device
    if p.has_penalties:
        output = _on(device, [t for t in request.output_token_ids if t < vocab])
        if p.repetition_penalty != 1.0:
            # HF/vLLM semantics: every token seen in prompt or output is penalised.
            seen = torch.zeros(vocab, dtype=torch.bool, device=device)
            seen[_on(device, [t for t in request.prompt_token_ids if t < vocab])] = True
            seen[output] = True
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
            # index_add_, not bincount: bincount sizes its output on the host (a device sync).
            counts = torch.zeros(vocab, dtype=row.dtype, device=device)
            counts.index_add_(0, output, torch.ones(output.shape[0], dtype=row.dtype, device=device))
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < vocab]
        if ids:
            row[_on(device, ids)] += _on(device, [p.logit_bias[t] for t in ids], row.dtype)
    if p.min_tokens > 0 and request.num_output_tokens < p.min_tokens:
        banned = list(p.stop_token_ids)
        if request.eos_token_id is not None and not p.ignore_eos:
            banned.append(request.eos_token_id)
        banned = [t for t in banned if 0 <= t < vocab]
        if banned:
            row[_on(device, banned)] = float("-inf")


def _filter(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Top-k, then top-p over what is left, then min-p; masked entries become -inf."""
    top_ks = [r.sampling_params.top_k for r in requests]
    top_ps = [r.sampling_params.top_p for r in requests]
    min_ps = [r.sampling_params.min_p for r in requests]
    vocab, device = logits.shape[-1], logits.device
    if any(0 < k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = _on(device, [k if 0 < k < vocab else vocab for k in top_ks])
        ranks = torch.arange(vocab, device=device)
        sorted_logits.masked_fill_(ranks[None, :] >= ks[:, None], float("-inf"))
        # Rows without top-p get an unreachable threshold: float cumsum can exceed 1.0.
        ps = _on(device, [p if p < 1.0 else float("inf") for p in top_ps], logits.dtype)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before >= ps[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter_(-1, order, sorted_logits)
    if any(m > 0.0 for m in min_ps):
        probs = torch.softmax(logits, dim=-1)
        threshold = _on(device, min_ps, logits.dtype)[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# _BYTE_BITS[b, j]: bit j of byte b. A little-endian int32 bitmask viewed as bytes has token
# t at byte t // 8, bit t % 8, so one gather expands the bitmask to a bool per token.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()
_device_byte_bits: dict[torch.device, torch.Tensor] = {}


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarBitmask, raw_logits: torch.Tensor) -> None:
    """Set the logits of tokens a row's grammar forbids to -inf, in place.

    A row left with nothing allowed (the grammar allows only end-of-sequence while
    min_tokens forbids it) falls back to the grammar over `raw_logits` (before penalties
    and bias): the grammar wins, so the output still parses. Tokens past the bitmask (a
    model vocabulary padded beyond the tokenizer's) are forbidden.
    """
    device, vocab = logits.device, logits.shape[-1]
    if device not in _device_byte_bits:
        _device_byte_bits[device] = _BYTE_BITS.to(device)
    bitmask = grammar.bitmask.to(device, non_blocking=True)
    allowed = _device_byte_bits[device][bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab]
    rows = _on(device, grammar.rows)
    sub = logits[rows]
    masked = sub.masked_fill(~allowed, float("-inf"))
    # Decided on the device (no host sync): rows with something left keep `masked`.
    nothing_left = torch.isneginf(masked).all(dim=-1, keepdim=True)
    fallback = raw_logits[rows].masked_fill(~allowed, float("-inf"))
    logits[rows] = torch.where(nothing_left, fallback, masked)
