"""The logits of a step in chunks of rows, and prompt logprobs reduced chunk by chunk.

A step's logits rows are the sampling rows, then one row per prompt position whose
logprob a request asked for (`prompt_logprobs`, echo with logprobs). A prefill chunk can
hold up to `max_num_batched_tokens` such rows: materialised at once, 8192 rows x a 128k
vocabulary are 2 GB of bf16 logits and 4 GB more per float32 copy, none of it in the
memory profile. Here the LM head runs on at most `LOGITS_CHUNK_ROWS` hidden rows at a
time; a chunk's prompt rows are reduced at once, on the device, to what the API returns
(the target token's logprob and rank, the top k) and the chunk's logits are dropped. The
results of all chunks go to the host in one transfer after the step (`to_host`), instead
of one sync per row.

Every rank of a tensor-parallel group runs the same chunks (the LM head gathers the
vocabulary shards per call), decided by the number of rows alone; only rank 0, which
gets logits, reduces. `engine/memory.py` profiles one full chunk of prompt rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.sampler import TokenLogprobs

LOGITS_CHUNK_ROWS = 256
"""Most logits rows the LM head computes at once (128 MiB of float32 at a 128k vocabulary)."""
PROFILE_TOP_K = 20
"""Top-k the memory profile reduces with (the API's largest logprobs)."""


@dataclass(slots=True)
class PromptLogprobRows:
    """The step's prompt-logprob rows: the token each scores and its top-k; after the
    forward pass `result` holds them reduced, on the device."""

    targets: torch.Tensor  # [P] int64 on the device
    ks: list[int]
    target_ids: list[int] | None = None  # the same on the host (None: read from `targets`)
    result: torch.Tensor | None = None
    """[P, 2 + 2 * max(ks)] float64: logprob of the target, its rank, the top-k logprobs, their token ids."""

    @classmethod
    def of(cls, targets: list[int], ks: list[int], device: torch.device) -> "PromptLogprobRows":
        return cls(torch.tensor(targets, dtype=torch.int64).to(device, non_blocking=True), ks, list(targets))

    @property
    def max_k(self) -> int:
        return max(self.ks, default=0)

    def to_host(self) -> list[TokenLogprobs]:
        """Each row's `TokenLogprobs` (the target first, then the top k): one transfer."""
        if self.result is None:
            raise RuntimeError("the forward pass has not filled these prompt-logprob rows")
        rows, k_max = self.result.tolist(), self.max_k
        targets = self.target_ids if self.target_ids is not None else self.targets.tolist()
        out = []
        for (target, row), k in zip(zip(targets, rows), self.ks):
            lp = TokenLogprobs([target], [row[0]], [int(row[1])])
            lp.token_ids += [int(t) for t in row[2 + k_max: 2 + k_max + k]]
            lp.logprobs += row[2: 2 + k]
            lp.ranks += list(range(1, k + 1))
            out.append(lp)
        return out


def reduce_prompt_rows(logits: torch.Tensor, targets: torch.Tensor, max_k: int) -> torch.Tensor:
    """[rows, vocab] logits -> [rows, 2 + 2 max_k] float64 (see `PromptLogprobRows.result`),
    in float32 as the sampler's logprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets[:, None])
    ranks = (logprobs > chosen).sum(dim=1, keepdim=True) + 1
    parts = [chosen.double(), ranks.double()]
    if max_k > 0:
        top = torch.topk(logprobs, max_k, dim=-1)
        parts += [top.values.double(), top.indices.double()]
    return torch.cat(parts, dim=1)


def chunked_logits(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,  # [rows, hidden]: the sampling rows, then the prompt rows
    prompt: PromptLogprobRows | None,
    chunk_rows: int | None = None,
) -> torch.Tensor | None:
    """Logits of the sampling rows (the rows before `prompt`'s); `prompt.result` filled.
    None where `compute_logits` gives None (tensor-parallel ranks other than 0).
    `chunk_rows`: none = LOGITS_CHUNK_ROWS."""
    chunk_rows = chunk_rows or LOGITS_CHUNK_ROWS
    rows = hidden.shape[0]
    if rows <= chunk_rows and prompt is None:
        return compute_logits(hidden)
    num_prompt = 0 if prompt is None else prompt.targets.shape[0]
    num_sampling = rows - num_prompt
    sampling, reduced = [], []
    empty = None  # [0, vocab]: the sampling logits of a step without sampling rows
    for start in range(0, rows, chunk_rows):
        end = min(start + chunk_rows, rows)
        logits = compute_logits(hidden[start:end])
        if logits is None:
            continue
        if empty is None:
            empty = logits.new_empty((0, logits.shape[1]))
        if start < num_sampling:
            part = logits[: num_sampling - start]
            # A slice would keep the whole chunk alive: copy it when the chunk holds prompt rows too.
            sampling.append(part if part.shape[0] == logits.shape[0] else part.clone())
        if end > num_sampling:
            first = max(start, num_sampling)
            targets = prompt.targets[first - num_sampling: end - num_sampling]
            reduced.append(reduce_prompt_rows(logits[first - start:], targets, prompt.max_k))
        del logits
    if prompt is not None and reduced:
        prompt.result = torch.cat(reduced) if len(reduced) > 1 else reduced[0]
    if not sampling:
        return empty  # None: no logits on this rank
    return torch.cat(sampling) if len(sampling) > 1 else sampling[0]
