"""Drafting with the MTP layer after each target forward.

For every speculating request, the MTP layer runs over the positions this step made valid —
a prefill chunk, a decode, or the last known token plus the accepted drafts — with the next
token of each (known now: prompt tokens, accepted drafts, the newly sampled token). That keeps
its own KV cache (the last cache, same block table) complete, and for a request that sampled, the
last position's output gives the first draft. Further drafts reuse the layer one position at a
time: the MTP output g stands in for the target hidden state of the position after it.

Legend: C chunks (requests) in the MTP pass, Q their tokens, H hidden size.
"""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch, PrefillSeq


def _batch(
    chunks: list[tuple[list[int], list[int], int, list[int]]], block_size: int, device
) -> ForwardBatch:
    """chunks of (next token ids, positions, context length, block ids) -> a prefill-style batch."""
    ids, positions, slots, seqs = [], [], [], []
    for next_ids, pos, ctx, blocks in chunks:
        seqs.append(
            PrefillSeq(
                len(ids), len(pos), ctx, torch.tensor(blocks[: -(-ctx // block_size)], dtype=torch.long)
            )
        )
        ids.extend(next_ids)
        positions.extend(pos)
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in pos)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decodes=0,
        decode_block_table=torch.zeros(0, 0, dtype=torch.int32, device=device),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32, device=device),
        prefills=seqs,
        logits_indices=torch.zeros(0, dtype=torch.long, device=device),
    )


@torch.inference_mode()
def draft_with_mtp(runner, items, q_starts: list[int], hidden: torch.Tensor, out) -> None:
    """hidden [N, H]: the target forward's final hidden states, rows in batch order."""
    model, bs, k = runner.model, runner.block_size, runner.spec.num_speculative_tokens
    mtp_cache = runner.kv_caches[-1]
    chunks, rows, drafting = [], [], []
    for it, q_start in zip(items, q_starts, strict=True):
        req = it.request
        if not req.spec_enabled:
            continue
        emitted = out.sampled.get(req.request_id, [])
        start = it.num_computed_tokens
        valid = it.num_new_tokens + (len(emitted) - 1 if it.draft_token_ids else 0)  # target-valid positions
        seq = req.token_ids + emitted
        if start + valid >= len(seq):  # a chunk that does not sample needs its next prompt token
            valid = len(seq) - start - 1
        if valid <= 0:
            continue
        pos = list(range(start, start + valid))
        chunks.append((seq[start + 1 : start + valid + 1], pos, start + valid, req.block_ids))
        rows.append(hidden[q_start : q_start + valid])
        if emitted:
            drafting.append((req, len(chunks) - 1, start + valid, len(seq)))
    if not chunks:
        return
    batch = _batch(chunks, bs, hidden.device)
    g = model.mtp_forward(batch.input_ids, torch.cat(rows), batch, mtp_cache)  # [Q, H]
    if not drafting:
        return
    ends = torch.tensor([s.q_start + s.q_len - 1 for s in batch.prefills], device=hidden.device)
    last = g[ends[[c for _, c, _, _ in drafting]]]  # [D, H] the newest position of each drafting request
    drafts = [[] for _ in drafting]
    for j in range(k):
        tokens = model.compute_logits(last).argmax(dim=-1).tolist()  # [D]
        live = []
        for i, ((req, _, _pos, total), tok) in enumerate(zip(drafting, tokens, strict=True)):
            room = (
                min(req.params.max_tokens - (total - req.num_prompt_tokens), runner.max_model_len - total) - 1
            )
            if len(drafts[i]) < room and len(drafts[i]) == j:
                drafts[i].append(tok)
                live.append(i)
        if j + 1 == k or not live:
            break
        # Reuse the layer at the next position: g stands in for the target's hidden state there.
        step = [
            ([drafts[i][-1]], [drafting[i][2] + j], drafting[i][2] + j + 1, drafting[i][0].block_ids)
            for i in live
        ]
        batch = _batch(step, bs, hidden.device)
        last_live = model.mtp_forward(batch.input_ids, last[live], batch, mtp_cache)
        last = last.clone()
        last[live] = last_live
    for (req, *_), d in zip(drafting, drafts, strict=True):
        if d:
            out.drafts[req.request_id] = d
