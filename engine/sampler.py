"""Turn each request's last-position logits into its next token.

Order of processing (as vLLM): logprobs of the raw model distribution are taken first;
then penalties, logit bias and the min_tokens mask; then the grammar's token bitmask
(structured outputs); then greedy rows take the argmax and random rows are tempered,
filtered (top-k, top-p, min-p) and sampled, so both obey the grammar. Sampling uses the
exponential-race trick (argmax of p / q with q ~ Exp(1)). A seeded request's noise is a
function of (seed, output position, token id) alone - a counter-based integer hash
computed on the logits' device for all seeded rows at once (`seeded_exponential`) - so
the same seed gives the same tokens whatever else is in the batch, with no per-row draw
on the CPU and no copy to the device (and the same integers on CPU and CUDA).

Everything stays on the logits' device until one transfer of the results at the end of
the step: per-request values (temperatures, top-k, penalty ids) go to the device as small
tensors, never the other way, so on a GPU the host waits for the step once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.request import Request
from kernels import cpu_kernels


@dataclass(slots=True)
class TokenLogprobs:
    token_ids: list[int]
    """The sampled token first, then the top-k alternatives."""
    logprobs: list[float]
    ranks: list[int]


class GrammarConstraint(Protocol):
    """The step's grammar-constrained rows, as the sampler sees them (built by EngineCore)."""

    rows: list[int]
    """Sampler rows (indices into the step's sampling requests) under a grammar."""

    def allows(self, row: int, token_id: int) -> bool:
        """Whether row `row`'s grammar allows `token_id` next (cheap: no full mask)."""

    def bitmask(self, rows: list[int]) -> torch.Tensor:
        """The allowed-token bitmask of `rows`: int32 CPU `[len(rows), ceil(vocab / 32)]`,
        bit t % 32 of word t // 32 set = token t allowed."""


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
        self, logits: torch.Tensor, requests: list[Request], grammar: GrammarConstraint | None = None,
        forced: dict[int, int] | None = None,
    ) -> SamplerOutput:
        """`forced`: row -> the token it takes whatever the logits say (a thinking budget's
        end tag, engine/thinking.py); its logprobs are still the model's own."""
        logits = logits.float()
        device = logits.device
        # Logprobs describe the model's own distribution, before any processing.
        want_logprobs = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        raw_logprobs = torch.log_softmax(logits[_on(device, want_logprobs)], dim=-1) if want_logprobs else None

        raw_logits = logits
        if any(_needs_processing(r) for r in requests):
            logits = logits.clone()
            for row, request in enumerate(requests):
                if _needs_processing(request):
                    _apply_penalties_and_bias(logits[row], request)

        token_ids = cpu_kernels.argmax(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        noise: dict[int, torch.Tensor] = {}
        if random_rows:
            rows = _on(device, random_rows)
            temps = _on(device, [requests[i].sampling_params.temperature for i in random_rows], logits.dtype)
            sub = _filter(logits[rows] / temps[:, None], [requests[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            q = self._exponential_noise(probs, [requests[i] for i in random_rows])
            token_ids[rows] = probs.div_(q).argmax(dim=-1)
            if grammar is not None:
                noise = {row: q[j] for j, row in enumerate(random_rows)}
        if grammar is not None:
            self._constrain(token_ids, logits, raw_logits, requests, grammar, noise)
        if forced:
            token_ids[_on(device, list(forced))] = _on(device, list(forced.values()))

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

    def _constrain(
        self, token_ids: torch.Tensor, logits: torch.Tensor, raw_logits: torch.Tensor, requests: list[Request],
        grammar: GrammarConstraint, noise: dict[int, torch.Tensor],
    ) -> None:
        """Resample the grammar-constrained rows whose token the grammar forbids, in place.

        Masking can only remove candidates, so when the unmasked winner is allowed it is
        also the masked winner: exactly for greedy rows, and for sampled rows without
        top-k/top-p/min-p, whose exponential race with the same noise picks the same token
        (renormalising the allowed probabilities scales them all alike). Only the other rows
        - most steps of a JSON schema, ~10% - pay for a full bitmask (vLLM and llguidance
        call this checking the argmax first). Filtered rows always mask first, since the
        filters must see the masked distribution.
        """
        sampled = token_ids[_on(token_ids.device, grammar.rows)].tolist()
        need = [
            row for row, token in zip(grammar.rows, sampled)
            if _has_filters(requests[row]) or not grammar.allows(row, token)
        ]
        if not need:
            return
        device = logits.device
        rows = _on(device, need)
        masked = apply_grammar_bitmask(logits[rows], grammar.bitmask(need))
        reprocessed = [j for j, row in enumerate(need) if _needs_processing(requests[row])]
        if reprocessed:
            # min_tokens (or a -inf bias) may forbid the only token the grammar allows
            # (end-of-sequence): then the grammar wins, over the unprocessed logits.
            js = _on(device, reprocessed)
            sub = masked[js]
            fallback = apply_grammar_bitmask(raw_logits[rows[js]], grammar.bitmask([need[j] for j in reprocessed]))
            masked[js] = torch.where(torch.isneginf(sub).all(dim=-1, keepdim=True), fallback, sub)
        new_ids = masked.argmax(dim=-1)
        random_js = [j for j, row in enumerate(need) if row in noise]
        if random_js:
            js = _on(device, random_js)
            reqs = [requests[need[j]] for j in random_js]
            temps = _on(device, [r.sampling_params.temperature for r in reqs], masked.dtype)
            probs = torch.softmax(_filter(masked[js] / temps[:, None], reqs), dim=-1)
            q = torch.stack([noise[need[j]] for j in random_js])
            new_ids[js] = probs.div_(q).argmax(dim=-1)
        token_ids[rows] = new_ids

    def _exponential_noise(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Exp(1) noise, a row per request: unseeded rows in one draw from this device's
        sampler generator, seeded rows from `seeded_exponential` of (seed, the output
        position being sampled), all on the device."""
        device, vocab = probs.device, probs.shape[-1]
        unseeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is None]
        seeded = [j for j, r in enumerate(requests) if r.sampling_params.seed is not None]
        q = torch.empty_like(probs)
        if unseeded:
            noise = torch.empty((len(unseeded), vocab), dtype=probs.dtype, device=device)
            noise.exponential_(generator=self._generator(device))
            if not seeded:
                return noise
            q[_on(device, unseeded)] = noise
        if seeded:
            noise = seeded_exponential(
                [requests[j].sampling_params.seed for j in seeded],
                [requests[j].num_output_tokens for j in seeded], vocab, device, probs.dtype,
            )
            if not unseeded:
                return noise
            q[_on(device, seeded)] = noise
        return q

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cpu":
            return self.generator
        if device not in self._device_generators:
            self._device_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._device_generators[device]


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32), without int64 overflow: c in 16-bit halves."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_keys(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys of (seed, position), mixed on the host (blake2b: any seed, no
    correlation between neighbouring seeds or positions)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def seeded_exponential(
    seeds: list[int], positions: list[int], vocab: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] where row j depends on (seeds[j], positions[j]) and the
    token id only: counter-based, so a seeded request's draw for an output position is the
    same whatever rows sit beside it, in whatever order, and however often it is drawn.

    Per row two 32-bit keys (`_row_keys`, host: 2 x 8 bytes go to the device); per token,
    on the device, u = (top 24 bits of mix(mix(token ^ k0) ^ k1) + 0.5) / 2^24, strictly
    inside (0, 1), and q = -log(u). Integer ops only up to the one float conversion, exact
    in float32; so CPU and CUDA compute the same u (and q up to log's last bit)."""
    keys = torch.tensor([_row_keys(s, p) for s, p in zip(seeds, positions)], dtype=torch.int64)
    keys = keys.to(device, non_blocking=True)
    tokens = torch.arange(vocab, dtype=torch.int64, device=device)
    h = _mix32(_mix32(tokens[None, :] ^ keys[:, :1]) ^ keys[:, 1:])
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
    return torch.log(u).neg_().to(dtype)


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


def argmax_suffices(request: Request) -> bool:
    """Whether the sampler reads nothing of this request's logits but their argmax: a greedy
    row with no logprobs, penalties, bias, min_tokens mask, grammar or beam search. A step
    whose rows are all such may take the LM head's argmax route (`AttentionMetadata.argmax_only`),
    whose logits are exact only where a token can be the argmax (-inf elsewhere)."""
    p = request.sampling_params
    return (p.is_greedy and p.logprobs is None and not _needs_processing(request)
            and request.grammar is None and request.beam_search is None)


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


def _has_filters(request: Request) -> bool:
    p = request.sampling_params
    return not p.is_greedy and (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0)


# _BYTE_PENALTY[b, j]: 0 where bit j of byte b is set, -inf where not. A little-endian int32
# bitmask viewed as bytes has token t at byte t // 8, bit t % 8, so one gather turns the
# bitmask into an additive mask, one value per token.
_BYTE_PENALTY = torch.where(
    ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool(), 0.0, float("-inf")
)
_device_penalties: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, vocab] with the tokens `bitmask` forbids at -inf (a new tensor).

    Tokens past the bitmask (a model vocabulary padded beyond the tokenizer's) are forbidden.
    """
    device, vocab = logits.device, logits.shape[-1]
    key = (device, logits.dtype)
    if key not in _device_penalties:
        _device_penalties[key] = _BYTE_PENALTY.to(device=device, dtype=logits.dtype)
    bitmask = bitmask.to(device, non_blocking=True)
    penalty = _device_penalties[key][bitmask.view(torch.uint8).long()].view(bitmask.shape[0], -1)
    if penalty.shape[1] < vocab:
        penalty = torch.nn.functional.pad(penalty, (0, vocab - penalty.shape[1]), value=float("-inf"))
    return logits + penalty[:, :vocab]
