"""Drafting with the MTP layer after each target forward.

The MTP layer first runs over the target step's own layout (same positions, cache slots, decode
groups and prefill chunks) with each position's next token as input: prompt tokens, accepted
drafts, the newly sampled token. That keeps its KV cache (the last cache, same block tables)
complete, and for a request that sampled, the output at its newest valid position gives the first
draft. A verification's rows past the accepted drafts have no next token yet: they run with a
padding token and their outputs are dropped; the KV they write lies past the request's valid
length and is overwritten by the next step before any query can see it (attention is causal and
every position is stored before it is read). Further drafts reuse the layer one position at a
time, as one absorbed decode batch: the MTP output g stands in for the target hidden state of
the position after it.

Legend: N rows in the step, H hidden size, D drafting requests.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import torch

from engine.forward_batch import DecodeGroup, ForwardBatch
from engine.request import Request

PAD_TOKEN = 0
"""Input of rows whose next token is not known yet (their outputs are never used)."""


def _one_token_batch(ids: list[int], positions: list[int], blocks: list[list[int]], block_size: int, device):
    """One token per request at the given positions, as a single absorbed decode group."""
    slots = [b[p // block_size] * block_size + p % block_size for b, p in zip(blocks, positions, strict=True)]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        decodes=[DecodeGroup.of(0, 1, blocks, [p + 1 for p in positions], device)],
        prefills=[],
        logits_indices=torch.zeros(0, dtype=torch.long, device=device),
    )


class _Drafting(NamedTuple):
    request: Request
    row: int
    """Row of its newest valid position in the MTP pass."""
    sampled_pos: int
    """Position of the token sampled this step (the row's position + 1): the layer's reuse j runs
    at sampled_pos + j."""
    room: int
    """Drafts it may take: fewer near max_tokens or the model length."""


@torch.inference_mode()
def draft_with_mtp(runner, items, batch: ForwardBatch, hidden: torch.Tensor, out) -> None:
    """items: the step's requests in batch order; hidden [N, H]: the target forward's final hidden
    states. Writes out.drafts."""
    model, k, dev = runner.model, runner.spec.num_speculative_tokens, hidden.device
    mtp_cache = runner.kv_caches[-1]
    spec = [it for it in items if it.request.spec_enabled]
    if not spec:
        return
    if len(spec) == len(items):
        layout, rows = batch, hidden
    else:  # only the speculating requests: the same layout rebuilt without the others
        layout = runner._build_batch(spec)[0]
        starts = list(itertools.accumulate((it.query_len for it in items), initial=0))
        index = [
            starts[i] + j
            for i, it in enumerate(items)
            if it.request.spec_enabled
            for j in range(it.query_len)
        ]
        rows = hidden[torch.tensor(index, dtype=torch.long, device=dev)]

    next_ids: list[int] = []
    drafting: list[_Drafting] = []
    for it in spec:
        req, start, n = it.request, it.num_computed_tokens, it.query_len
        emitted = out.sampled.get(req.request_id, [])
        total = req.num_tokens + len(emitted)
        valid = min(n, total - start - 1)  # rows whose next token is known (and whose target state is)
        next_ids.extend((req.token_ids[start + 1 : start + 1 + valid] + emitted)[:valid])
        next_ids.extend([PAD_TOKEN] * (n - valid))
        if emitted:
            generated = total - req.num_prompt_tokens
            room = min(k, req.params.max_tokens - generated - 1, runner.max_model_len - total - 1)
            drafting.append(_Drafting(req, len(next_ids) - n + valid - 1, start + valid, room))
    layout = dataclasses.replace(layout, input_ids=torch.tensor(next_ids, dtype=torch.long, device=dev))
    g = model.mtp_forward(layout.input_ids, rows, layout, mtp_cache)  # [N', H]
    drafting = [d for d in drafting if d.room > 0]
    if not drafting:
        return

    last = g[torch.tensor([d.row for d in drafting], dtype=torch.long, device=dev)]  # [D, H]
    drafts: list[list[int]] = [[] for _ in drafting]
    for j in range(k):
        tokens = model.compute_logits(last).argmax(dim=-1).tolist()  # [D]
        live = [i for i, d in enumerate(drafting) if d.room > j]
        for i in live:
            drafts[i].append(tokens[i])
        live = [i for i in live if drafting[i].room > j + 1]
        if not live:
            break
        # Reuse the layer at the next position: g stands in for the target's hidden state there.
        live_t = torch.tensor(live, dtype=torch.long, device=dev)
        step = _one_token_batch(
            [drafts[i][-1] for i in live],
            [drafting[i].sampled_pos + j for i in live],
            [drafting[i].request.block_ids for i in live],
            runner.block_size,
            dev,
        )
        g_live = model.mtp_forward(step.input_ids, last[live_t], step, mtp_cache)
        last = g_live if len(live) == len(drafting) else last.index_copy(0, live_t, g_live)
    for d, tokens in zip(drafting, drafts, strict=True):
        out.drafts[d.request.request_id] = tokens
