"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer's top-k, and MLA over the cache
slots it chose.

The indexer scores every earlier token s of a query token t with one shared key per token k_s and
n_I query heads q_{t,h} with per-head weights w_{t,h} (the model folds n_I^-1/2 into w):

    I[t, s] = sum_h w_{t,h} * ReLU(scale * q_{t,h} . k_s),  s < len_t   (scale = d_I^-1/2)

and MLA (the absorbed form, as DeepSeek's sparse kernels run it for prefill and decode alike)
attends only to the `topk` best s. A token whose context holds at most `topk` tokens sees all of
it, exactly dense MLA's result.

Cache slots, not positions, leave the indexer: `slots[t, j]` is block * block_size + offset of
the j-th chosen token, -1 where a query has fewer than topk; the attention reads them in any
order (the softmax does not care), so the same kernel serves any block table.

These are the PyTorch paths (float32 arithmetic, bounded memory: queries go in chunks); the
float64 naive references the tests hold them to are `indexer_topk_ref` and `sparse_mla_ref`.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 24
"""Scores (or gathered rows) one chunk of queries may hold at once: 64 MiB of float32."""


def _rows_per_chunk(per_row: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(per_row, 1))


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, nI, dI], weights [T, nI], keys [S, dI] -> I [T, S] float32 (no mask). The reference's
    order: the scaled dot products, ReLU, then the weighted sum over heads."""
    scores = torch.matmul(q.float(), keys.float().t()) * scale  # [T, nI, S]
    return torch.matmul(weights.float().unsqueeze(1), scores.relu_()).squeeze(1)


def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """One request's query tokens against its keys: q [T, nI, dI], weights [T, nI], keys [S, dI]
    (its first S cached keys, in order), lens [T] (token t sees keys 0 .. lens[t] - 1, each <= S)
    -> positions [T, min(topk, S)] int64, the best first, -1 where fewer are visible."""
    num_keys = keys.shape[0]
    k = min(topk, num_keys)
    lens = lens.to(torch.long)
    key_pos = torch.arange(num_keys, device=keys.device)
    if int(lens.max()) <= topk:  # every visible key is chosen: no scores needed
        pos = key_pos[:k].expand(lens.shape[0], k)
        return torch.where(pos < lens[:, None], pos, -1)
    out = torch.empty(lens.shape[0], k, dtype=torch.long, device=keys.device)
    step = _rows_per_chunk(q.shape[1] * num_keys)
    for s in range(0, lens.shape[0], step):
        e = min(s + step, lens.shape[0])
        index = indexer_scores(q[s:e], weights[s:e], keys, scale)
        index.masked_fill_(key_pos[None, :] >= lens[s:e, None], float("-inf"))
        values, pos = index.topk(k, dim=-1)
        out[s:e] = pos.masked_fill_(values == float("-inf"), -1)
    return out


def positions_to_slots(positions: torch.Tensor, block_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Token positions of one request ([T, K] int64, -1 = none) -> its cache slots (-1 kept)."""
    valid = positions >= 0
    p = positions.clamp(min=0)
    slots = block_ids.long()[p // block_size] * block_size + p % block_size
    return torch.where(valid, slots, -1)


def sparse_mla(
    q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """Absorbed MLA over chosen cache rows: q [T, H, L+R] (the latent query then the rotary one),
    kv_cache [blocks, block_size, L+R], slots [T, K] int64 (-1 = none; each query has one at least)
    -> [T, H, L] in q's dtype: softmax(scale * q . row) over the query's rows, times their c_kv."""
    width = kv_cache.shape[-1]
    rows = kv_cache.view(-1, width)
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    step = _rows_per_chunk(slots.shape[1] * width)
    for s in range(0, q.shape[0], step):
        e = min(s + step, q.shape[0])
        chosen = slots[s:e]
        kv = rows[chosen.clamp(min=0)].float()  # [t, K, L+R]
        scores = torch.matmul(q[s:e].float(), kv.transpose(1, 2)) * scale  # [t, H, K]
        scores.masked_fill_((chosen < 0)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.matmul(probs, kv[..., :kv_lora_rank]).to(q.dtype)
    return out


# --- float64 naive references ----------------------------------------------------------------------


def indexer_topk_ref(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor, topk: int, scale: float
) -> list[list[float]]:
    """Each query token's scores over its visible keys in float64, one key at a time: the sets a
    top-k must choose from (ties compared by the caller)."""
    out = []
    for t in range(q.shape[0]):
        row = []
        for s in range(int(lens[t])):
            dots = (q[t].double() @ keys[s].double()) * scale  # [nI]
            row.append(float((weights[t].double() * dots.clamp(min=0)).sum()))
        out.append(row)
    return out


def sparse_mla_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """sparse_mla in float64, one query and head at a time -> [T, H, L] float64."""
    rows = kv_cache.reshape(-1, kv_cache.shape[-1]).double()
    out = torch.zeros(q.shape[0], q.shape[1], kv_lora_rank, dtype=torch.float64)
    for t in range(q.shape[0]):
        chosen = [int(s) for s in slots[t] if int(s) >= 0]
        kv = rows[chosen]  # [K, L+R]
        for h in range(q.shape[1]):
            logits = (kv @ q[t, h].double()) * scale
            probs = torch.exp(logits - logits.max())
            out[t, h] = (probs / probs.sum()) @ kv[:, :kv_lora_rank]
    return out
