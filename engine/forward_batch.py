"""The flat batch one model forward consumes, built by the runner from the scheduler's output.

Legend: N = tokens in the step, D = decode requests (one token each, first in the batch),
P = prefill (or chunked-prefill) requests, after the decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSeq:
    """One request's prefill chunk inside the flat batch."""

    q_start: int
    """Offset of the chunk's first token in the flat batch."""
    q_len: int
    """Tokens in the chunk."""
    ctx_len: int
    """Tokens the chunk attends to: the cached prefix plus the chunk itself."""
    block_ids: torch.Tensor
    """[ceil(ctx_len / block_size)] int64: the request's cache blocks in order."""


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[N] int64 token ids; decodes first, then prefill chunks."""
    positions: torch.Tensor
    """[N] int64 position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[N] int64 cache slot (block_id * block_size + offset) each token's KV is written to."""
    num_decodes: int
    """D: the first D tokens are single-token decodes using the absorbed MLA form."""
    decode_block_table: torch.Tensor
    """[D, max_blocks] int32 block table of the decode requests."""
    decode_seq_lens: torch.Tensor
    """[D] int32 context length of each decode request, including its new token."""
    prefills: list[PrefillSeq]
    """Prefill chunks after the decodes, each attending with the non-absorbed MLA form."""
    logits_indices: torch.Tensor
    """[M] int64 rows of the hidden states the LM head is applied to."""
