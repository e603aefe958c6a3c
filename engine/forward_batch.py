"""The flat batch one model forward consumes, built by the runner from the scheduler's output.

Legend: N = tokens in the step, D = requests in a decode group, s = query tokens per request of
a group (1 for a plain decode, 1 + k when k speculative drafts are verified), P = prefill (or
chunked-prefill) requests, after the decode groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.mla import per_token_tables


@dataclass
class DecodeGroup:
    """D requests that each run s tokens after their cached context through the absorbed MLA
    path (one batched attention call per group). Their D * s rows are contiguous, request-major."""

    start: int
    """Offset of the group's first token in the flat batch."""
    num_seqs: int
    """D."""
    query_len: int
    """s: the request's last known token, then its drafts; each attends causally."""
    block_table: torch.Tensor
    """[D, max_blocks] int32 cache blocks of each request, zero-padded."""
    seq_lens: torch.Tensor
    """[D] int32 context length of each request, including its s new tokens."""

    @classmethod
    def of(
        cls, start: int, query_len: int, tables: list[list[int]], seq_lens: list[int], device
    ) -> DecodeGroup:
        """From each request's block ids and context length."""
        d = len(tables)
        if query_len == 1:
            return cls(
                start,
                d,
                1,
                block_table(tables, device),
                torch.tensor(seq_lens, dtype=torch.int32, device=device),
            )
        # `per_token` from the lists, each table and length tensor made together with the group's
        # own (views of one tensor): two tensors, not five ops on them.
        rows = [n - query_len + 1 + i for n in seq_lens for i in range(query_len)]
        tables_both = block_table(tables + [t for t in tables for _ in range(query_len)], device)
        lens_both = torch.tensor(seq_lens + rows, dtype=torch.int32, device=device)
        group = cls(start, d, query_len, tables_both[:d], lens_both[:d])
        group.per_token = (tables_both[d:], lens_both[d:])
        return group

    @property
    def end(self) -> int:
        return self.start + self.num_seqs * self.query_len

    @cached_property
    def per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table [D*s, max_blocks], seq_lens [D*s]): one row per query token, as
        kernels.mla.per_token_tables builds them (`of` sets them from its lists); built once
        for all the layers of a step."""
        return per_token_tables(self.block_table, self.seq_lens, self.query_len)


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
class TableInputs:
    """The step seen through one more block table of a hybrid spec (a sliding-window or compressed
    table beside the attention one, engine/kv_cache/spec.py `tables`): where each token's entry
    goes there and each request's blocks there, in the batch's order."""

    table: int
    """Which of the spec's tables."""
    slot_mapping: torch.Tensor
    """[N] int64: each token's entry in the table's caches (single_type.table_slots); -1: none."""
    decode_tables: list[torch.Tensor]
    """Per decode group, [D, max_blocks] int32 (a window's null block where its blocks fell behind)."""
    prefill_blocks: list[torch.Tensor]
    """Per prefill chunk, [ceil(ctx_len / block_size)] int64."""


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor
    """[N] int64 token ids; decode groups first, then prefill chunks."""
    positions: torch.Tensor
    """[N] int64 position of each token in its sequence."""
    slot_mapping: torch.Tensor
    """[N] int64 cache slot (block_id * block_size + offset) each token's KV is written to."""
    decodes: list[DecodeGroup]
    """Decode groups at the head of the batch, each attending with the absorbed MLA form."""
    prefills: list[PrefillSeq]
    """Prefill chunks after the decodes, each attending with the non-absorbed MLA form."""
    logits_indices: torch.Tensor
    """[M] int64 rows of the hidden states the LM head is applied to."""
    tables: tuple[TableInputs, ...] = ()
    """The spec's other block tables (none for DeepSeek-V2/V3/V3.2: one table)."""
    state_rows: torch.Tensor | None = None
    """[R] int64: each request's row in the state tensors, in the batch's order (decode groups'
    requests, then the prefills); None where the spec has no per-request state."""
    states: dict[str, torch.Tensor] | None = None
    """The state pool's tensors by name, [rows, layers, *shape] (engine/kv_cache/state.py)."""
    snapshots: list[list[tuple[int, int]]] | None = None
    """Per request, in the batch's order: (b, row) for each block boundary b its chunk crosses
    (start < b <= end): the model writes the state after token b - 1 into row (a prefix
    snapshot the state pool reserved, StatePool.reserve_snapshot)."""

    @cached_property
    def max_context(self) -> int:
        """The longest context any of the step's tokens attends to (found once a step, not per layer)."""
        longest = max((seq.ctx_len for seq in self.prefills), default=0)
        return max([longest, *(int(g.seq_lens.max()) for g in self.decodes if g.num_seqs)])

    @cached_property
    def token_contexts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block_table [N, max_blocks] int32, lens [N] int32): each token's cache blocks and how
        many of their rows it attends to (its own included), decode groups' rows first; for
        kernels that take every token of the step in one call (DeepSeek-V3.2's indexer)."""
        tables, lens = [], []
        for g in self.decodes:
            t, n = g.per_token
            tables.append(t)
            lens.append(n)
        for seq in self.prefills:
            tables.append(seq.block_ids.to(torch.int32)[None].expand(seq.q_len, -1))
            start = seq.ctx_len - seq.q_len + 1
            lens.append(
                torch.arange(start, start + seq.q_len, dtype=torch.int32, device=seq.block_ids.device)
            )
        width = max((t.shape[1] for t in tables), default=0)
        table = torch.zeros(
            sum(t.shape[0] for t in tables), width, dtype=torch.int32, device=self.input_ids.device
        )
        row = 0
        for t in tables:
            table[row : row + t.shape[0], : t.shape[1]] = t
            row += t.shape[0]
        return table, torch.cat(lens) if lens else torch.zeros(0, dtype=torch.int32)


def block_table(tables: list[list[int]], device) -> torch.Tensor:
    """Block-id lists of D requests -> [D, max_blocks] int32, zero-padded."""
    width = max((len(t) for t in tables), default=0)
    out = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return out.view(len(tables), width).to(device)  # keeps the shape when there are none


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows]: a view when the rows are consecutive (batch 1's, or every row), else a gather."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return t[rows[0] : rows[-1] + 1]
    return t[torch.tensor(rows, dtype=torch.long, device=t.device)]


def token_tensors(
    input_ids: list[int], positions: list[int], slots: list[int], device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's ids, positions and cache slots ([N] int64 each): the rows of one tensor, made once."""
    rows = torch.tensor((input_ids, positions, slots), dtype=torch.long, device=device)
    return rows[0], rows[1], rows[2]
