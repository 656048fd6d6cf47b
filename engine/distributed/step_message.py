"""The per-step message rank 0 broadcasts to the tensor-parallel workers: flat int64, no pickle.

A step is described by integers only (the scheduler's decisions already flattened by
`ModelRunner.prepare`), so it travels as two tensors: a fixed-size header (what follows
and how long each part is) and one payload holding every part back to back. The header
goes over the CPU control group, so an idle worker can wait for it without a deadline;
the payload goes over the model's group and stays on the device (NCCL on GPU, no host
copy of the batch).

    header  = [kind, num_tokens, num_seqs, max_blocks_per_seq, num_logits, num_copies, argmax_only, 0]
    payload = input_ids[T] | positions[T] | slot_mapping[T] | block_tables[S * B] |
              seq_lens[S] | query_start_loc[S + 1] | logits_indices[L] | blocks_to_copy[C * 2]
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from engine.attention import AttentionMetadata

HEADER_LEN = 8


class MessageKind(IntEnum):
    STEP = 1
    SHUTDOWN = 2


@dataclass(slots=True)
class StepInputs:
    """One step's forward inputs: what every rank needs to run the same forward pass."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    blocks_to_copy: torch.Tensor | None  # [num_copies, 2] int64 (src, dst), copied before the forward


def encode_header(kind: MessageKind, step: StepInputs | None = None) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = int(kind)
    if step is not None:
        num_seqs, max_blocks = step.meta.block_tables.shape
        num_copies = 0 if step.blocks_to_copy is None else step.blocks_to_copy.shape[0]
        header[1:7] = torch.tensor(
            [step.input_ids.shape[0], num_seqs, max_blocks, step.meta.logits_indices.shape[0], num_copies,
             int(step.meta.argmax_only)]
        )
    return header


def encode_payload(step: StepInputs) -> torch.Tensor:
    meta = step.meta
    parts = [
        step.input_ids,
        step.positions,
        meta.slot_mapping,
        meta.block_tables.flatten(),
        meta.seq_lens,
        meta.query_start_loc,
        meta.logits_indices,
    ]
    if step.blocks_to_copy is not None:
        parts.append(step.blocks_to_copy.flatten())
    return torch.cat([p.to(torch.int64) for p in parts])


def payload_len(header: torch.Tensor) -> int:
    num_tokens, num_seqs, max_blocks, num_logits, num_copies = header[1:6].tolist()
    return 3 * num_tokens + num_seqs * max_blocks + num_seqs + (num_seqs + 1) + num_logits + 2 * num_copies


def decode(header: torch.Tensor, payload: torch.Tensor) -> StepInputs:
    """The inverse of encode_header + encode_payload (views into `payload`, dtypes restored)."""
    num_tokens, num_seqs, max_blocks, num_logits, num_copies = header[1:6].tolist()
    sizes = [num_tokens, num_tokens, num_tokens, num_seqs * max_blocks, num_seqs, num_seqs + 1, num_logits, 2 * num_copies]
    ids, pos, slots, tables, seq_lens, qsl, logits_idx, copies = payload.split(sizes)
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_tables=tables.view(num_seqs, max_blocks).to(torch.int32),
        seq_lens=seq_lens.to(torch.int32),
        query_start_loc=qsl.to(torch.int32),
        logits_indices=logits_idx,
        argmax_only=bool(header[6]),
    )
    return StepInputs(ids, pos, meta, copies.view(num_copies, 2) if num_copies else None)
