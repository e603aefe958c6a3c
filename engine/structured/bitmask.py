"""Token bitmasks: which tokens the constrained rows of a step may take, filled by the grammar
library for the whole step at once and applied to the logits in one pass.

Layout (llguidance's and xgrammar's): one int32 word per 32 tokens, bit b of word w allows token
32 w + b; a row is [W] words, W = ceil(V / 32). Only constrained rows have one: the others are
never touched.

A speculating request has 1 + k rows: the logits after its last known token and after each of
its k drafts. The library fills them by advancing the request's matcher over the drafts and
rolling it back, stopping at the first draft the constraint refuses; the rows after that one
stay all-ones, and verification never reads them (it stops at that draft, whose probability is
0 under its masked row).

Legend: M logits rows in the step, V' their width (>= V, the vocabulary), R constrained rows,
W words per row.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import torch


def words_per_row(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def unpack(bits: torch.Tensor, width: int) -> torch.Tensor:
    """bits [R, W] int32 -> allowed [R, width] bool; False past 32 W (a padded lm_head's columns)."""
    rows, words = bits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)  # [32]
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().reshape(rows, words * 32)  # [R, 32 W]
    if width <= words * 32:
        return allowed[:, :width]
    pad = torch.zeros(rows, width - words * 32, dtype=torch.bool, device=bits.device)
    return torch.cat([allowed, pad], dim=1)


@functools.cache
def _byte_penalty(device: torch.device) -> torch.Tensor:
    """[256, 8] float32 on device: row b holds, for each bit of the byte b, 0 where it is set and
    -inf where not."""
    set_bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1  # [256, 8]
    return torch.zeros(256, 8).masked_fill_(set_bits == 0, float("-inf")).to(device)


def penalty(bits: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
    """bits [R, W] int32 -> [R, width] float32 on device: 0 where allowed, -inf elsewhere (and past
    32 W). Added to the logits, it masks them without a branch per token: a masked fill with the
    unpacked bits mispredicts on the scattered tokens a JSON string refuses (quotes, backslashes,
    control bytes), and cost 4 ms per step at batch 32 against ~1 ms for the gather and the add.
    Each int32 word's bytes are little-endian, so byte k of row r covers tokens 8 k .. 8 k + 7."""
    table = _byte_penalty(device)
    rows, words = bits.shape
    as_bytes = bits.to(device, non_blocking=True).contiguous().view(torch.uint8).view(-1).int()  # [R 4W]
    out = table.index_select(0, as_bytes).view(rows, words * 32)  # [R, 32 W]
    if width <= words * 32:
        return out[:, :width]
    pad = torch.full((rows, width - words * 32), float("-inf"), device=device)
    return torch.cat([out, pad], dim=1)


def _word_bit(token: int) -> tuple[int, int]:
    """(word, that bit's value as an int32) for a token: bit 31 is the sign bit."""
    bit = 1 << (token % 32)
    return token // 32, bit - (1 << 32) if bit >= 1 << 31 else bit


@dataclass
class TokenBitmask:
    """The allowed tokens of some rows of a step's logits."""

    rows: list[int]
    """[R] the logits rows constrained, in the order of bits' rows."""
    bits: torch.Tensor
    """[R, W] int32 on the CPU (where the library writes it)."""

    def apply(self, logits: torch.Tensor) -> None:
        """In place on logits [M, V'] (float32): -inf at every token its row does not allow. One
        gather of the penalty and one add over the R rows together."""
        if not self.rows:
            return
        masked = penalty(self.bits, logits.shape[1], logits.device)  # [R, V']
        if self.rows == list(range(logits.shape[0])):
            logits.add_(masked)
        else:
            index = torch.tensor(self.rows, dtype=torch.long, device=logits.device)  # [R]
            logits.index_add_(0, index, masked)

    def select(self, rows: Sequence[int]) -> TokenBitmask | None:
        """The part for these logits rows, renumbered by their position in `rows` (the rows a
        sampler call takes, in its order); None when none of them is constrained."""
        position = {row: i for i, row in enumerate(rows)}
        mine = [k for k, row in enumerate(self.rows) if row in position]
        if not mine:
            return None
        return TokenBitmask([position[self.rows[k]] for k in mine], self.bits[mine])

    def without(self, rows: Sequence[int]) -> TokenBitmask:
        """The part for every constrained row not in `rows`, numbering kept."""
        drop = set(rows)
        keep = [k for k, row in enumerate(self.rows) if row not in drop]
        return TokenBitmask([self.rows[k] for k in keep], self.bits[keep])


def fill_bitmask(
    executor: llguidance.LLExecutor,
    entries: Sequence[tuple[llguidance.LLMatcher, int, Sequence[int]]],
    vocab_size: int,
    eos_token_ids: Sequence[int],
) -> TokenBitmask:
    """entries: (matcher, logits row after the last known token, drafts) per constrained request;
    its drafts' rows follow that row. The library fills every row at once (in parallel on the
    executor's threads, the GIL released); each matcher ends where it started.

    A row the library leaves empty (a matcher past EOS, or in an error state) allows the EOS
    tokens: its request then ends instead of sampling from all -inf."""
    words = words_per_row(vocab_size)
    total = sum(1 + len(drafts) for _, _, drafts in entries)
    bits = torch.full((total, words), -1, dtype=torch.int32)  # [R, W]; all-ones: rows left unfilled
    plain, drafting, rows = [], [], []
    for matcher, row, drafts in entries:
        if drafts:
            drafting.append((matcher, len(rows), list(drafts)))
        else:
            plain.append((matcher, len(rows)))
        rows.extend(range(row, row + 1 + len(drafts)))
    # The library takes requests with drafts and without in separate calls.
    if plain:
        executor.unsafe_compute_mask_ptr(plain, bits.data_ptr(), words * 4, total)
    if drafting:
        executor.unsafe_compute_mask_ptr_with_draft_token(drafting, bits.data_ptr(), words * 4, total)
    empty = (bits == 0).all(dim=1)  # [R]
    if bool(empty.any()):
        for token in eos_token_ids:
            word, bit = _word_bit(token)
            bits[empty, word] |= bit
    return TokenBitmask(rows, bits)
