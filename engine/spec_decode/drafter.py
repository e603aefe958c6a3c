"""Drafting with the MTP layer after each target forward.

The MTP layer keeps its own KV cache (the last cache, same block tables), so after every target
step each position whose next token is now known gets its MTP cache row: prompt positions,
accepted drafts, the position before the newly sampled token. A position's row depends only on
its own input (h_i and t_{i+1}), so all of them but the newest of each drafting request are
written without running the layer's attention and MoE (`mtp_store_kv`). The newest one runs the
whole layer as an absorbed decode and gives the first draft; a decoding request's few other
known positions (an accepted draft's) go through the layer with it, as a verification's rows do,
which writes their cache rows in the same forward (one native call for all of them, where the
few-token path is native) instead of a store pass of their own. When every row of the step
is such a row (decodes whose drafts were all accepted: most steps at batch 1), that forward runs
on the target's own batch with the ids one token on. Further drafts reuse the layer
one position at a time, the MTP output g standing in for the target hidden state of the position
after it. Verification rows past the accepted drafts write nothing: their next token is
not known yet. The cache rows that drafts beyond the first write lie past the request's valid
length and are overwritten by the next step before any query can see them (attention is causal
and every position is stored before it is read).

Legend: N rows in the step, H hidden size, D drafting requests.
"""

from __future__ import annotations

import dataclasses
from itertools import accumulate
from typing import NamedTuple

import torch

from engine.forward_batch import DecodeGroup, ForwardBatch, take_rows, token_tensors
from engine.request import Request


def _draft_batch(
    ids: list[list[int]], last_positions: list[int], blocks: list[list[int]], block_size: int, device
) -> ForwardBatch:
    """Each request's tokens ids[i] at the positions up to last_positions[i], as absorbed decode
    groups of equal query length; the requests must come sorted by len(ids[i])."""
    flat_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    groups: list[tuple[int, int, list[list[int]], list[int]]] = []  # (start, s, tables, seq lens)
    for tokens, last, b in zip(ids, last_positions, blocks, strict=True):
        s = len(tokens)
        if not groups or groups[-1][1] != s:
            groups.append((len(flat_ids), s, [], []))
        groups[-1][2].append(b)
        groups[-1][3].append(last + 1)
        flat_ids.extend(tokens)
        positions.extend(range(last - s + 1, last + 1))
        slots.extend(b[p // block_size] * block_size + p % block_size for p in positions[-s:])
    ids, pos, slot_mapping = token_tensors(flat_ids, positions, slots, device)
    return ForwardBatch(
        input_ids=ids,
        positions=pos,
        slot_mapping=slot_mapping,
        decodes=[DecodeGroup.of(start, s, tables, lens, device) for start, s, tables, lens in groups],
        prefills=[],
        logits_indices=torch.zeros(0, dtype=torch.long, device=device),
    )


def draft_cap(req: Request, max_model_len: int) -> int:
    """The drafts a request may take after this step, plus the tokens this step emits for it: what
    its max_tokens and the model length leave after the tokens it has, less the one token the next
    step samples itself. Its room is min(k, draft_cap - emitted)."""
    generated = req.num_tokens - req.num_prompt_tokens
    return min(req.params.max_tokens - generated, max_model_len - req.num_tokens) - 1


def _every_row_drafts(batch: ForwardBatch, rows: list[int]) -> bool:
    """Whether the first reuse runs on exactly the target's rows: decodes only, each with every
    verified draft accepted, in batch order (the usual step at batch 1). Its batch is then the
    target's (positions, slots, groups and their per-token tables) with the ids one token on,
    what `_draft_batch` would build again."""
    return not batch.prefills and rows == list(range(batch.input_ids.shape[0]))


class _Drafting(NamedTuple):
    request: Request
    row: int
    """Row of its newest valid position in the step: the first draft is read there."""
    position: int
    """That position."""
    sampled: int
    """The token sampled this step (that position's next token)."""
    room: int
    """Drafts it may take: fewer near max_tokens or the model length."""
    known: list[int]
    """The next tokens of the known positions just before it that go through the layer with the
    first draft (a decode's accepted drafts; empty for a prefill, whose rows are stored apart)."""


@torch.inference_mode()
def draft_with_mtp(runner, items, batch: ForwardBatch, hidden: torch.Tensor, out, fold: bool = True) -> None:
    """items: the step's requests in batch order; hidden [N, H]: the target forward's final hidden
    states. Writes out.drafts. fold: a decode's known rows go through the layer with its first
    draft (else they are stored apart, as a prefill's: the same drafts and cache rows, bit for bit
    where the few-token products are native; in torch's float32 path the rows round by the
    number of rows in the product, as they do by the batch's makeup)."""
    model, k, dev = runner.model, runner.spec.num_speculative_tokens, hidden.device
    limit = runner.spec.disable_by_batch_size
    if limit is not None and len(items) >= limit:
        k = 0  # no drafts this step; the cache rows below are still written
    mtp_cache = model.mtp_cache(runner.kv_caches)
    kv_rows: list[int] = []  # rows whose MTP cache row alone is needed, and their next tokens
    kv_ids: list[int] = []
    drafting: list[_Drafting] = []
    row = 0
    for it in items:
        req, start, n = it.request, it.num_computed_tokens, it.query_len
        if req.spec_enabled:
            emitted = out.sampled.get(req.request_id, [])
            total = req.num_tokens + len(emitted)
            valid = min(n, total - start - 1)  # rows whose next token is known (and whose target state is)
            next_ids = (req.token_ids[start + 1 : start + 1 + valid] + emitted)[:valid]
            room = min(k, draft_cap(req, runner.max_model_len) - len(emitted))
            if emitted and room > 0:  # its newest valid row runs the whole layer
                valid -= 1
                sampled = next_ids.pop()
                known = next_ids if fold and it.is_decode else []  # a decode's few rows run with it
                drafting.append(_Drafting(req, row + valid, start + valid, sampled, room, known))
                if known:
                    valid, next_ids = 0, []
            kv_rows.extend(range(row, row + valid))
            kv_ids.extend(next_ids)
        row += n
    if kv_rows:
        index = torch.tensor(kv_rows, dtype=torch.long, device=dev)
        ids = torch.tensor(kv_ids, dtype=torch.long, device=dev)
        model.mtp_store_kv(ids, hidden[index], batch.positions[index], batch.slot_mapping[index], mtp_cache)
    if not drafting:
        return

    # Reuse j runs at the newest valid position + j, from (the sampled token, the target's hidden
    # state) for j = 0, with the known rows before it, and (the previous draft, the previous g)
    # after that.
    drafting.sort(key=lambda d: len(d.known))  # decode groups of equal query length
    live = list(range(len(drafting)))
    inputs = [[*d.known, d.sampled] for d in drafting]
    rows = [r for d in drafting for r in range(d.row - len(d.known), d.row + 1)]
    h = take_rows(hidden, rows)  # [rows, H]
    drafts: list[list[int]] = [[] for _ in drafting]
    for j in range(k):
        if j == 0 and _every_row_drafts(batch, rows):  # the target's batch, each row's next token in
            ids = torch.tensor([t for i in inputs for t in i], dtype=torch.long, device=dev)
            step = dataclasses.replace(batch, input_ids=ids)
        else:
            step = _draft_batch(
                inputs,
                [drafting[i].position + j for i in live],
                [drafting[i].request.block_ids[runner.kv_table] for i in live],
                runner.block_size,
                dev,
            )
        g = model.mtp_forward(step.input_ids, h, step, mtp_cache)  # [rows, H]
        if j == 0 and len(rows) > len(drafting):  # rows were folded: each request's newest row
            newest = [end - 1 for end in accumulate(len(i) for i in inputs)]
            g = take_rows(g, newest)  # [D, H]
        tokens = model.draft_tokens(g, runner.sampler.vocab_size)
        for i, token in zip(live, tokens, strict=True):
            drafts[i].append(token)
        keep = [m for m, i in enumerate(live) if drafting[i].room > j + 1]
        if not keep:
            break
        live, inputs = [live[m] for m in keep], [[tokens[m]] for m in keep]
        h = take_rows(g, keep)
    for d, tokens in zip(drafting, drafts, strict=True):
        out.drafts[d.request.request_id] = tokens
