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

The Triton kernel is split-K ("flash decoding") in two stages. All s_q * H query rows of a
sequence share its one KV head, so a program takes BLOCK_M of them at once and each key tile it
reads feeds a [BLOCK_M, BLOCK_N] GEMM. Decode batches are small, so a sequence's keys are also
cut into num_splits ranges that run as separate programs:

    stage 1, program (b, rows, split):  online softmax over the split's keys, BLOCK_N at a time
        m = max_j s_j,  l = sum_j exp(s_j - m),  o_split = sum_j exp(s_j - m) v_j / l,
        lse_split = m + log l                              (an empty range: o = 0, lse = -inf)
    stage 2, program (b, rows):  o = sum_s exp(lse_s - lse) o_s,  lse = log sum_s exp(lse_s)

Keys are read through the block table: key n of sequence b is row n % block_size of cache
block block_table[b, n // block_size]. The latent part of a key row is also its value, so it
is loaded once and used by both GEMMs.
"""

from __future__ import annotations

import torch

from kernels import native
from kernels.dispatch import cdiv, next_power_of_2, resolve_impl

# --- Triton kernels -------------------------------------------------------------------------------


# --- launch ---------------------------------------------------------------------------------------

BLOCK_M = 16
"""Query rows (s_q * H flattened) per program; 16 is the smallest tl.dot tile."""
BLOCK_N = 32
"""Keys per step of the online softmax: 32, or 16 where that divides the cache block size and 32
does not (a tile within one block needs a single table lookup)."""
MIN_KEYS_PER_SPLIT = 256
"""The default split count gives a table filled to capacity at least this many keys per split."""
MAX_SPLITS = 32
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_num_splits(batch: int, row_blocks: int, max_keys: int, num_sms: int) -> int:
    """Split the keys until the (batch x row-block x split) grid covers every SM about once, but
    keep each split at least MIN_KEYS_PER_SPLIT keys long. max_keys is the block table's capacity,
    an upper bound known without reading seq_lens back from the device."""
    by_occupancy = cdiv(num_sms, max(batch * row_blocks, 1))
    by_length = cdiv(max_keys, MIN_KEYS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def _check(q, kv_cache, block_table, seq_lens, kv_lora_rank, num_splits) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, s_q, H, L+R], got shape {tuple(q.shape)}")
    batch, _, _, width = q.shape
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != width:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, {width}], got {tuple(kv_cache.shape)}")
    if not 0 < kv_lora_rank < width:
        raise ValueError(f"kv_lora_rank must be in (0, {width}), got {kv_lora_rank}")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.dtype != torch.int32:
        raise ValueError(
            f"block_table must be int32 [{batch}, max_blocks], got {block_table.dtype} {tuple(block_table.shape)}"
        )
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if q.dtype not in FLOAT_DTYPES or kv_cache.dtype not in FLOAT_DTYPES:
        raise ValueError(f"q and kv_cache must be one of {FLOAT_DTYPES}, got {q.dtype} and {kv_cache.dtype}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_table.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_table must be contiguous in their last dimension")
    if not seq_lens.is_contiguous():
        raise ValueError("seq_lens must be contiguous")
    if len({t.device for t in (q, kv_cache, block_table, seq_lens)}) != 1:
        raise ValueError("q, kv_cache, block_table and seq_lens must be on one device")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def mla_decode_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of mla_decode: (1) check, (2) allocate, (3) launch stage 1 and, with more
    than one split, the merge."""
    from kernels.jit import mla as jit

    _check(q, kv_cache, block_table, seq_lens, kv_lora_rank, num_splits)
    batch, s_q, heads, width = q.shape
    lat, rope = kv_lora_rank, width - kv_lora_rank
    rows = s_q * heads
    row_blocks = cdiv(rows, BLOCK_M)
    block_size = kv_cache.shape[1]
    if num_splits is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        num_splits = default_num_splits(batch, row_blocks, block_table.shape[1] * block_size, num_sms)

    o = torch.empty(batch, s_q, heads, lat, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, s_q, heads, dtype=torch.float32, device=q.device)
    if batch == 0 or rows == 0:
        return o, lse
    o_rows, lse_rows = o.view(batch, rows, lat), lse.view(batch, rows)  # [B, s_q*H, L], [B, s_q*H]
    if num_splits == 1:  # stage 1 writes the final result (its split index is always 0)
        o_part, lse_part = o_rows[:, :, None, :], lse_rows[:, :, None]
    else:
        o_part = torch.empty(batch, rows, num_splits, lat, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(batch, rows, num_splits, dtype=torch.float32, device=q.device)

    block_n = 16 if block_size % BLOCK_N != 0 and block_size % 16 == 0 else BLOCK_N
    block_l = max(16, next_power_of_2(lat))
    block_r = max(16, next_power_of_2(rope))
    # fp32 inputs get exact fp32 products; bf16/fp16 values are exact in tf32, so their q.k is too
    # (only the probabilities in p @ v are rounded to tf32).
    exact = torch.float32 in (q.dtype, kv_cache.dtype)
    jit._mla_decode_split_kernel[(batch, row_blocks, num_splits)](
        q,
        kv_cache,
        block_table,
        seq_lens,
        o_part,
        lse_part,
        scale * 1.4426950408889634,  # log2(e)
        num_splits,
        s_q,
        heads,
        block_size,
        *q.stride()[:3],
        *kv_cache.stride()[:2],
        block_table.stride(0),
        *o_part.stride()[:3],
        *lse_part.stride(),
        LAT=lat,
        ROPE=rope,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_L=block_l,
        BLOCK_R=block_r,
        INPUT_PRECISION="ieee" if exact else "tf32",
        TILE_IN_BLOCK=block_size % block_n == 0,
        num_warps=4,
        num_stages=2,
    )
    if num_splits > 1:
        jit._mla_decode_merge_kernel[(batch, row_blocks)](
            o_part,
            lse_part,
            o_rows,
            lse_rows,
            num_splits,
            rows,
            *o_part.stride()[:3],
            *lse_part.stride(),
            *o_rows.stride()[:2],
            *lse_rows.stride(),
            LAT=lat,
            BLOCK_M=BLOCK_M,
            BLOCK_L=block_l,
            BLOCK_S=next_power_of_2(num_splits),
            num_warps=4,
        )
    return o, lse


# --- public API -----------------------------------------------------------------------------------


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    impl: str = "auto",
    return_lse: bool = True,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [B, s_q, H, L+R], kv_cache [num_blocks, block_size, L+R], block_table [B, max_blocks] int32,
    seq_lens [B] int32 (including the s_q new tokens) -> (o [B, s_q, H, L] in q's dtype, lse [B, s_q, H] float32).
    With return_lse=False the lse is None and the PyTorch path skips computing it. num_splits
    (Triton only) overrides how many ranges each sequence's keys are cut into."""
    if resolve_impl(impl, q, has_triton=True) == "triton":
        o, lse = mla_decode_triton(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank, num_splits)
        return o, lse if return_lse else None
    if return_lse:
        return mla_decode_ref(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank)
    return _mla_decode_fast(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank), None


# --- PyTorch paths --------------------------------------------------------------------------------


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


NATIVE_MAX_BATCH = 4
"""Decode steps of up to this many tokens (batch 1, a speculative verification, the MTP draft)
run a layer's attention block, its MoE block, or (where every product is native) the whole
stack as one native call each. The decode attention itself (`_mla_decode_fast`) goes native at
every batch where the kernels are loaded: against the batched GEMMs of this file, bench model
(8 heads) at ~290 cached tokens, 2-core AMD EPYC (Zen 4, VDPBF16PS), 9.0 / 2.3 / 1.8 / 3.2 / 2.8x
at 1 / 4 / 8 / 32 / 256 sequences; on the AMX tile unit (2-core Xeon) 1.9 / 1.4 / 2.7 / 2.9 /
2.1x at 8 / 16 / 32 / 64 / 128 sequences of ~200 tokens. A speculative verification's s_q > 1
tokens of a sequence go in as s_q sequences over the same blocks, query i seeing the first
seq_len - s_q + 1 + i keys."""

FAST_CHUNK_BYTES = 8 << 20
"""Gathered KV per chunk of sequences in the fast decode path: small enough to stay in the
last-level cache between the two GEMMs that read it (and below glibc's mmap threshold)."""


def per_token_tables(
    block_table: torch.Tensor, seq_lens: torch.Tensor, s_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group's block_table [D, max_blocks] and seq_lens [D] -> one row per query token
    ([D*s_q, max_blocks], [D*s_q]): with drafts (s_q > 1), query i of a sequence is a sequence of
    its own over the same blocks, seeing its first seq_len - s_q + 1 + i keys."""
    if s_q == 1:
        return block_table, seq_lens
    lens = seq_lens[:, None] - s_q + 1 + torch.arange(s_q, dtype=seq_lens.dtype)  # [D, s_q]
    return block_table.repeat_interleave(s_q, dim=0), lens.view(-1)


def _mla_decode_fast(q, kv_cache, block_table, seq_lens, scale, kv_lora_rank) -> torch.Tensor:
    """The same attention without the LSE, in a few large ops: the s_q * H query rows of a
    sequence share its single latent KV head, so scores and output are two batched GEMMs. Long
    batches run in chunks of sequences so the gathered KV is reused from cache, not DRAM."""
    batch, s_q, heads, width = q.shape
    if native.loaded() and native.takes(q, kv_cache):
        # The cache read in place, no gather; with drafts, each query token is a sequence of its own.
        block_table, seq_lens = per_token_tables(block_table, seq_lens, s_q)
        o = native.mla_decode(
            q.reshape(batch * s_q, heads, width), kv_cache, block_table, seq_lens, scale, kv_lora_rank
        )
        return o.view(batch, s_q, heads, kv_lora_rank)
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
    if batch == 1 and s_q == 1 and max_len > 0:
        # One query of one sequence sees exactly its first max_len keys: cut the block padding
        # off instead of masking it (five fewer ops per layer in a batch-1 decode).
        kv = kv[:, :max_len]
        scores = torch.bmm(q.reshape(1, heads, width), kv.transpose(1, 2)).mul_(scale)
        return torch.bmm(torch.softmax(scores, dim=-1), kv)[..., :kv_lora_rank].view(
            1, 1, heads, kv_lora_rank
        )
    scores = torch.bmm(q.reshape(batch, s_q * heads, width), kv.transpose(1, 2))  # [B, s_q*H, S]
    scores.mul_(scale)
    hidden = ~_visible(seq_lens, s_q, kv.shape[1])
    scores.view(batch, s_q, heads, kv.shape[1]).masked_fill_(hidden[:, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # an empty sequence gives zeros
    # Against all L+R columns, then the L wanted: the latent half kv[..., :L] is strided, and the
    # CPU bmm copied it first (1.75x the product's time at 52 sequences x 140 keys, bf16).
    return torch.bmm(probs, kv)[..., :kv_lora_rank].view(batch, s_q, heads, kv_lora_rank)


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
