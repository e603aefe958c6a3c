"""MLA decode attention in the absorbed form, over the paged latent cache.

In multi-head latent attention every head's key and value are up-projections of one cached
latent per token: k_h = [W_UK_h c ; k_pe], v_h = W_UV_h c. Folding W_UK into the query
(q_lat_h = W_UK_h^T q_nope_h) turns decode into multi-query attention with a single shared
KV "head" of width L + R (the cache row itself) and a value of width L:

    s[h, j] = scale * <[q_lat_h ; q_pe_h], cache[j]>       j < seq_len
    o[h]    = softmax_j(s[h]) @ cache[:, :L]               (the caller applies W_UV and o_proj)
    lse[h]  = logsumexp_j(s[h])

With s_q > 1 query positions per sequence (MTP verification) the queries are the last s_q
positions, and query i sees keys j <= seq_len - s_q + i (causal).
"""

from __future__ import annotations

import torch

from kernels.dispatch import resolve_impl


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    impl: str = "auto",
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, s_q, H, L+R], kv_cache [num_blocks, block_size, L+R], block_table [B, max_blocks] int32,
    seq_lens [B] int32 (including the s_q new tokens) -> (o [B, s_q, H, L] in q's dtype, lse [B, s_q, H] float32).
    With return_lse=False the lse is None and the PyTorch path skips computing it."""
    resolve_impl(impl, q, has_triton=False)
    if return_lse:
        return mla_decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return _mla_decode_fast(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank), None


def gather_blocks(kv_cache: torch.Tensor, block_table: torch.Tensor, max_len: int) -> torch.Tensor:
    """-> [B, S, L+R]: each row's cache rows in order; S rounds max_len up to whole blocks."""
    batch, block_size = block_table.shape[0], kv_cache.shape[1]
    num_blocks = (max_len + block_size - 1) // block_size
    ids = block_table[:, :num_blocks].reshape(-1).long()
    # Gathering whole blocks as flat rows is a memcpy per block (several times faster than
    # indexing the 3-D cache).
    rows = kv_cache.view(kv_cache.shape[0], -1).index_select(0, ids)
    return rows.view(batch, num_blocks * block_size, kv_cache.shape[-1])


def _visible(seq_lens: torch.Tensor, s_q: int, num_keys: int) -> torch.Tensor:
    """[B, s_q, S] bool: query i of a sequence sees keys j <= seq_len - s_q + i."""
    key_pos = torch.arange(num_keys, device=seq_lens.device)
    last_visible = (
        seq_lens.long()[:, None] - s_q + torch.arange(s_q, device=seq_lens.device)[None, :]
    )  # [B, s_q]
    return key_pos[None, None, :] <= last_visible[:, :, None]


FAST_CHUNK_BYTES = 8 << 20
"""Gathered KV per chunk of sequences in the fast decode path: small enough to stay in the
last-level cache between the two GEMMs that read it (and below glibc's mmap threshold)."""


def _mla_decode_fast(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank) -> torch.Tensor:
    """The same attention without the LSE, in a few large ops: the s_q * H query rows of a
    sequence share its single latent KV head, so scores and output are two batched GEMMs. Long
    batches run in chunks of sequences so the gathered KV is reused from cache, not DRAM."""
    batch, s_q, heads, width = q.shape
    max_len = int(seq_lens.max()) if batch else 0
    row_bytes = max(max_len, 1) * width * kv_cache.element_size()
    chunk = max(1, FAST_CHUNK_BYTES // row_bytes)
    if batch > chunk:
        return torch.cat(
            [
                _mla_decode_fast(
                    q[i : i + chunk],
                    kv_cache,
                    block_table[i : i + chunk],
                    seq_lens[i : i + chunk],
                    scale,
                    kv_lora_rank,
                )
                for i in range(0, batch, chunk)
            ]
        )
    kv = gather_blocks(kv_cache, block_table, max_len).to(q.dtype)  # [B, S, L+R]
    scores = torch.bmm(q.reshape(batch, s_q * heads, width), kv.transpose(1, 2))  # [B, s_q*H, S]
    scores.mul_(scale)
    hidden = ~_visible(seq_lens, s_q, kv.shape[1])
    scores.view(batch, s_q, heads, kv.shape[1]).masked_fill_(hidden[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # an empty sequence gives zeros
    return torch.bmm(probs, kv[:, :, :kv_lora_rank]).view(batch, s_q, heads, kv_lora_rank)


def mla_decode_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, s_q, heads, _ = q.shape
    kv = gather_blocks(kv_cache, block_table, int(seq_lens.max()) if batch else 0).float()  # [B, S, L+R]
    scores = torch.einsum("bqhd,bsd->bqhs", q.float(), kv) * scale  # [B, s_q, H, S]
    visible = _visible(seq_lens, s_q, kv.shape[1])
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, s_q, H]
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)  # empty sequences give zeros
    o = torch.einsum("bqhs,bsl->bqhl", probs, kv[..., :kv_lora_rank])
    return o.to(q.dtype), lse
