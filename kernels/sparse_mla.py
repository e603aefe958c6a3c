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

Here: the PyTorch paths (float32 arithmetic, bounded memory: queries go in chunks), the Triton
paths (GPU; `*_triton`, kernels in kernels/jit/sparse_mla.py) and the float64 naive references
the tests hold them to (`indexer_topk_ref`, `sparse_mla_ref`). The CPU's native kernels are
kernels/native/sparse.h.
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
    -> positions [T, min(topk, S)] int64, -1 where fewer are visible: the best first where a
    token sees more than topk keys, else all it sees in order."""
    num_keys = keys.shape[0]
    k = min(topk, num_keys)
    lens = lens.to(device=keys.device, dtype=torch.long)
    if lens.numel() == 0:
        return torch.empty(0, k, dtype=torch.long, device=keys.device)
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
        kv.masked_fill_((chosen < 0)[..., None], 0.0)  # what -1 read (row 0) may be NaN: 0 * NaN is NaN
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


# --- Triton paths ----------------------------------------------------------------------------------
#
# The GPU paths (kernels in kernels/jit/sparse_mla.py), each (1) checking, (2) allocating and (3)
# launching. Both read their caches in place: the indexer's keys through the request's block ids
# (no gather), MLA's latent rows through the chosen slots. `triton` and the helpers are imported
# inside the functions, so that importing this module never loads the compiler.

SCORE_BLOCK_N = 32
"""Keys per indexer program; each key is looked up through its own block-table entry."""
SCORE_TOKENS = 4
"""Query tokens per indexer program: each reuses the program's key tile, read once."""
SPARSE_BLOCK_H = 16
"""Heads per sparse MLA program; 16 is the smallest tl.dot tile."""
SPARSE_BLOCK_N = 32
"""Chosen rows per step of sparse MLA's online softmax."""
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INTEGER_DTYPES = (torch.int32, torch.int64)


def _dot_modes(*tensors: torch.Tensor) -> tuple[bool, str]:
    """-> (WIDEN, INPUT_PRECISION). Tiles are widened to float32 off a GPU (the interpreter's
    16-bit tl.dot is wrong) and where the inputs' dtypes differ (tl.dot takes one); "ieee" where
    an input is float32, else tf32, which holds 16-bit values exactly."""
    dtypes = {t.dtype for t in tensors}
    widen = not tensors[0].is_cuda or len(dtypes) > 1
    return widen, "ieee" if torch.float32 in dtypes else "tf32"


def _check_indexer(q, weights, key_cache, block_ids, lens, topk) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, nI, dI], got shape {tuple(q.shape)}")
    tokens, heads, dim = q.shape
    if weights.shape != (tokens, heads):
        raise ValueError(f"weights must be [{tokens}, {heads}], got {tuple(weights.shape)}")
    if key_cache.dim() != 3 or key_cache.shape[-1] != dim:
        raise ValueError(f"key_cache must be [num_blocks, block_size, {dim}], got {tuple(key_cache.shape)}")
    if block_ids.dim() != 1 or block_ids.dtype not in INTEGER_DTYPES:
        raise ValueError(
            f"block_ids must be int32 or int64 [blocks], got {block_ids.dtype} {tuple(block_ids.shape)}"
        )
    if lens.shape != (tokens,) or lens.dtype not in INTEGER_DTYPES:
        raise ValueError(f"lens must be int32 or int64 [{tokens}], got {lens.dtype} {tuple(lens.shape)}")
    if (
        q.dtype not in TRITON_DTYPES
        or key_cache.dtype not in TRITON_DTYPES
        or weights.dtype not in TRITON_DTYPES
    ):
        raise ValueError(
            f"q, weights and key_cache must be one of {TRITON_DTYPES}, got {q.dtype}, {weights.dtype} and {key_cache.dtype}"
        )
    if q.stride(-1) != 1 or weights.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("q, weights and key_cache must be contiguous in their last dimension")
    if len({t.device for t in (q, weights, key_cache)}) != 1:
        raise ValueError("q, weights and key_cache must be on one device")
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")


def indexer_scores_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_ids: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    num_keys: int,
) -> torch.Tensor:
    """The indexer kernel alone: q [T, nI, dI], weights [T, nI], key_cache [num_blocks, block_size,
    dI], block_ids [blocks] and lens [T] (int32 on q's device, each <= num_keys <= blocks *
    block_size) -> I [T, num_keys] float32, -inf where s >= lens[t] (the masked `indexer_scores`)."""
    from kernels.dispatch import cdiv, next_power_of_2
    from kernels.jit import sparse_mla as jit

    tokens, heads, dim = q.shape
    out = torch.empty(tokens, num_keys, dtype=torch.float32, device=q.device)
    if tokens == 0 or num_keys == 0:
        return out
    widen, precision = _dot_modes(q, key_cache)
    grid = (cdiv(num_keys, SCORE_BLOCK_N), cdiv(tokens, SCORE_TOKENS))
    jit._indexer_scores_kernel[grid](
        q, weights, key_cache, block_ids, lens, out, scale, tokens, num_keys, key_cache.shape[1],
        *q.stride()[:2], weights.stride(0), *key_cache.stride()[:2], out.stride(0),
        HEADS=heads, DIM=dim, TOKENS=SCORE_TOKENS, BLOCK_H=max(16, next_power_of_2(heads)),
        BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_N=SCORE_BLOCK_N, WIDEN=widen, INPUT_PRECISION=precision,
        num_warps=4,
    )  # fmt: skip
    return out


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    key_cache: torch.Tensor,
    block_ids: torch.Tensor,
    lens: torch.Tensor,
    topk: int,
    scale: float,
) -> torch.Tensor:
    """indexer_topk with the keys read in place from the paged key cache: q [T, nI, dI], weights
    [T, nI], key_cache [num_blocks, block_size, dI], block_ids [blocks] int32/int64 (the request's
    blocks in order: key s is row s % block_size of block block_ids[s // block_size]), lens [T]
    int32/int64 (token t sees keys 0 .. lens[t] - 1; any device) -> positions [T, min(topk, S)]
    int64 with S = max(lens), -1 where fewer are visible: the best first, or, where every row sees
    at most topk keys (no scores computed), in position order, as the PyTorch path returns them.

    Only the scores I [T, S] (masked, float32) come from the Triton kernel; the selection is
    torch.topk over them in this wrapper, outside the kernel, as the PyTorch path selects, with
    the queries in chunks so the scores stay within CHUNK_ELEMENTS. Reading S back (one sync)
    sizes the scores, as in the PyTorch path. Cache rows past a token's lens (stale, NaN) never
    reach its result, and rows at or past S are never read. Unlike the PyTorch path, the result's
    width depends on max(lens), not on how many keys a gather would have padded them to."""
    _check_indexer(q, weights, key_cache, block_ids, lens, topk)
    tokens = q.shape[0]
    num_keys = int(lens.max()) if tokens else 0
    if num_keys > block_ids.shape[0] * key_cache.shape[1]:
        raise ValueError(
            f"lens reach {num_keys} keys but block_ids hold {block_ids.shape[0]} blocks of {key_cache.shape[1]}"
        )
    k = min(topk, num_keys)
    lens = lens.to(device=q.device, dtype=torch.int32)
    if num_keys <= topk:  # every visible key is chosen: no scores needed
        pos = torch.arange(k, device=q.device).expand(tokens, k)
        return torch.where(pos < lens[:, None], pos, -1)
    block_ids = block_ids.to(device=q.device, dtype=torch.int32)
    out = torch.empty(tokens, k, dtype=torch.long, device=q.device)
    step = _rows_per_chunk(num_keys)
    for s in range(0, tokens, step):
        e = min(s + step, tokens)
        index = indexer_scores_triton(q[s:e], weights[s:e], key_cache, block_ids, lens[s:e], scale, num_keys)
        values, pos = index.topk(k, dim=-1)
        out[s:e] = pos.masked_fill_(values == float("-inf"), -1)
    return out


def _check_sparse(q, kv_cache, slots, kv_lora_rank) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, L+R], got shape {tuple(q.shape)}")
    tokens, _, width = q.shape
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {width}], got {tuple(kv_cache.shape)}")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank must be in (0, {width}), got {kv_lora_rank}")
    if slots.dim() != 2 or slots.shape[0] != tokens or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 [{tokens}, K], got {slots.dtype} {tuple(slots.shape)}")
    if q.dtype not in TRITON_DTYPES or kv_cache.dtype not in TRITON_DTYPES:
        raise ValueError(f"q and kv_cache must be one of {TRITON_DTYPES}, got {q.dtype} and {kv_cache.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or slots.stride(-1) != 1:
        raise ValueError("q, kv_cache and slots must be contiguous in their last dimension")
    if len({t.device for t in (q, kv_cache, slots)}) != 1:
        raise ValueError("q, kv_cache and slots must be on one device")


def sparse_mla_triton(
    q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, scale: float, kv_lora_rank: int
) -> torch.Tensor:
    """sparse_mla's Triton path, the same signature: q [T, H, L+R], kv_cache [num_blocks,
    block_size, L+R] (read in place), slots [T, K] int64 (-1 = none) -> [T, H, L] in q's dtype.
    One program per (token, SPARSE_BLOCK_H heads) runs an online softmax over the token's slots,
    SPARSE_BLOCK_N at a time, in float32. -1 slots load nothing (whatever the cache holds at any
    row); a query with no slot at all gets zeros (the PyTorch path requires one). Slots are not
    range-checked (that would need a sync): each must be -1 or below num_blocks * block_size."""
    from kernels.dispatch import cdiv, next_power_of_2
    from kernels.jit import sparse_mla as jit

    _check_sparse(q, kv_cache, slots, kv_lora_rank)
    tokens, heads, width = q.shape
    lat, rope = kv_lora_rank, width - kv_lora_rank
    out = torch.empty(tokens, heads, lat, dtype=q.dtype, device=q.device)
    if tokens == 0 or heads == 0:
        return out
    widen, precision = _dot_modes(q, kv_cache)
    block_l = max(16, next_power_of_2(lat))
    jit._sparse_mla_kernel[(tokens, cdiv(heads, SPARSE_BLOCK_H))](
        q, kv_cache, slots, out, scale * 1.4426950408889634, heads, slots.shape[1], kv_cache.shape[1],
        *q.stride()[:2], *kv_cache.stride()[:2], slots.stride(0), *out.stride()[:2],
        LAT=lat, ROPE=rope, BLOCK_H=SPARSE_BLOCK_H, BLOCK_N=SPARSE_BLOCK_N, BLOCK_L=block_l,
        BLOCK_R=max(16, next_power_of_2(rope)), WIDEN=widen, INPUT_PRECISION=precision,
        num_warps=4 if block_l <= 256 else 8,
    )  # fmt: skip
    return out
