"""Drafting with the MTP layer after each target forward.

The MTP layer keeps its own KV cache (the last cache, same block tables), so after every target
step each position whose next token is now known gets its MTP cache row: prompt positions,
accepted drafts, the position before the newly sampled token. A position's row depends only on
its own input (h_i and t_{i+1}), so all of them but the newest of each drafting request are
written without running the layer's attention and MoE (`mtp_store_kv`). The newest one runs the
whole layer as a one-token absorbed decode and gives the first draft; further drafts reuse the
layer one position at a time, the MTP output g standing in for the target hidden state of the
position after it. Verification rows past the accepted drafts write nothing: their next token is
not known yet. The cache rows that drafts beyond the first write lie past the request's valid
length and are overwritten by the next step before any query can see them (attention is causal
and every position is stored before it is read).

Legend: N rows in the step, H hidden size, D drafting requests.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.forward_batch import DecodeGroup, ForwardBatch
from engine.request import Request


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
    """Row of its newest valid position in the step: the first draft is read there."""
    position: int
    """That position."""
    sampled: int
    """The token sampled this step (that position's next token)."""
    room: int
    """Drafts it may take: fewer near max_tokens or the model length."""


@torch.inference_mode()
def draft_with_mtp(runner, items, batch: ForwardBatch, hidden: torch.Tensor, out) -> None:
    """items: the step's requests in batch order; hidden [N, H]: the target forward's final hidden
    states. Writes out.drafts."""
    model, k, dev = runner.model, runner.spec.num_speculative_tokens, hidden.device
    limit = runner.spec.disable_by_batch_size
    if limit is not None and len(items) >= limit:
        k = 0  # no drafts this step; the cache rows below are still written
    mtp_cache = runner.kv_caches[-1]
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
            generated = total - req.num_prompt_tokens
            room = min(k, req.params.max_tokens - generated - 1, runner.max_model_len - total - 1)
            if emitted and room > 0:  # its newest valid row runs the whole layer
                valid -= 1
                drafting.append(_Drafting(req, row + valid, start + valid, next_ids.pop(), room))
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
    # state) for j = 0 and (the previous draft, the previous g) after that.
    live = list(range(len(drafting)))
    inputs = [d.sampled for d in drafting]
    h = hidden[torch.tensor([d.row for d in drafting], dtype=torch.long, device=dev)]  # [D, H]
    drafts: list[list[int]] = [[] for _ in drafting]
    for j in range(k):
        step = _one_token_batch(
            inputs,
            [drafting[i].position + j for i in live],
            [drafting[i].request.block_ids for i in live],
            runner.block_size,
            dev,
        )
        g = model.mtp_forward(step.input_ids, h, step, mtp_cache)  # [len(live), H]
        tokens = model.compute_logits(g).argmax(dim=-1).tolist()
        for i, token in zip(live, tokens, strict=True):
            drafts[i].append(token)
        keep = [m for m, i in enumerate(live) if drafting[i].room > j + 1]
        if not keep:
            break
        live, inputs = [live[m] for m in keep], [tokens[m] for m in keep]
        h = g if len(keep) == len(g) else g[torch.tensor(keep, dtype=torch.long, device=dev)]
    for d, tokens in zip(drafting, drafts, strict=True):
        out.drafts[d.request.request_id] = tokens
