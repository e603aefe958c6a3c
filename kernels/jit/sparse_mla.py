"""The Triton kernels of kernels/sparse_mla.py (see kernels/jit/__init__.py).

Both read the paged caches in place: the indexer's keys through the request's block ids, MLA's
latent rows through the cache slots the indexer chose. Masked lanes load nothing, so cache rows
no query may see (stale, or NaN in the tests) never enter a result.

WIDEN (the interpreter, where 16-bit tl.dot is wrong, and mixed input dtypes) converts every
tile to float32 before the dots; with 16-bit inputs the tf32 dot is then exact products with
float32 accumulation. On a GPU, same-dtype 16-bit tiles go to tl.dot as they are (exact products,
float32 accumulation; MLA's probabilities are rounded to that dtype for p @ v, as FlashAttention
does).
"""

import triton
import triton.language as tl


@triton.jit
def _indexer_scores_kernel(
    q_ptr,  # [T, nI, dI]
    w_ptr,  # [T, nI]
    k_ptr,  # [num_blocks, block_size, dI]: the paged key cache
    block_ids_ptr,  # [blocks] int32: the request's cache blocks, in order
    lens_ptr,  # [T] int32: token t sees keys 0 .. lens[t] - 1
    out_ptr,  # [T, S] float32: the scores, -inf where s >= lens[t]
    scale,
    num_tokens,
    num_keys,  # S = max(lens): keys past it are never read
    block_size,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_k_block,
    stride_k_row,
    stride_ot,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    TOKENS: tl.constexpr,  # query tokens per program: each reuses the program's key tile
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head_mask = offs_h < HEADS
    dim_mask = offs_d < DIM

    # The key tile, loaded once for TOKENS queries; each key through its own table entry.
    keys = start_n + offs_n  # [BLOCK_N]
    key_mask = keys < num_keys
    page = tl.load(block_ids_ptr + keys // block_size, mask=key_mask, other=0).to(tl.int64)
    k_rows = k_ptr + page * stride_k_block + (keys % block_size) * stride_k_row
    k = tl.load(k_rows[:, None] + offs_d[None, :], mask=key_mask[:, None] & dim_mask[None, :], other=0.0)
    if WIDEN:
        k = k.to(tl.float32)  # [BLOCK_N, BLOCK_D]

    t_start = pid_t * TOKENS
    t_end = tl.minimum(t_start + TOKENS, num_tokens)
    for t in range(t_start, t_end):
        seen = tl.load(lens_ptr + t).to(tl.int64)
        scores = tl.full([BLOCK_N], float("-inf"), tl.float32)
        if start_n < seen:  # a tile wholly past this token's context is -inf, no dot needed
            q_rows = q_ptr + t * stride_qt + offs_h * stride_qh
            q = tl.load(
                q_rows[:, None] + offs_d[None, :], mask=head_mask[:, None] & dim_mask[None, :], other=0.0
            )
            if WIDEN:
                q = q.to(tl.float32)  # [BLOCK_H, BLOCK_D]
            w = tl.load(w_ptr + t * stride_wt + offs_h, mask=head_mask, other=0.0).to(tl.float32)  # [BLOCK_H]
            dots = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * scale  # [BLOCK_H, BLOCK_N]
            total = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)  # [BLOCK_N]
            # where, not an additive mask: a key in [lens[t], S) may be anything, NaN included.
            scores = tl.where(offs_n < seen - start_n, total, float("-inf"))
        tl.store(out_ptr + t * stride_ot + keys, scores, mask=key_mask)


@triton.jit
def _sparse_mla_kernel(
    q_ptr,  # [T, H, L+R]
    kv_ptr,  # [num_blocks, block_size, L+R]: the latent cache
    slots_ptr,  # [T, K] int64: block * block_size + offset, -1 = none
    o_ptr,  # [T, H, L]
    scale_log2,  # scale * log2(e): the softmax runs in base 2
    num_heads,
    num_slots,
    block_size,
    stride_qt,
    stride_qh,
    stride_kv_block,
    stride_kv_row,
    stride_st,
    stride_ot,
    stride_oh,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    WIDEN: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1).to(tl.int64)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    head_mask = offs_h < num_heads
    lat_mask = offs_l < LAT
    rope_mask = offs_r < ROPE

    q_rows = q_ptr + pid_t * stride_qt + offs_h * stride_qh
    q_lat = tl.load(q_rows[:, None] + offs_l[None, :], mask=head_mask[:, None] & lat_mask[None, :], other=0.0)
    q_pe = tl.load(
        q_rows[:, None] + LAT + offs_r[None, :], mask=head_mask[:, None] & rope_mask[None, :], other=0.0
    )
    if WIDEN:
        q_lat = q_lat.to(tl.float32)  # [BLOCK_H, BLOCK_L]
        q_pe = q_pe.to(tl.float32)  # [BLOCK_H, BLOCK_R]

    slot_row = slots_ptr + pid_t * stride_st
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.full([BLOCK_H, BLOCK_L], 0.0, tl.float32)
    for start_n in range(0, num_slots, BLOCK_N):
        slot = tl.load(slot_row + start_n + offs_n, mask=offs_n < num_slots - start_n, other=-1).to(tl.int64)
        chosen = slot >= 0  # [BLOCK_N]: -1 slots and lanes past K load nothing
        slot = tl.where(chosen, slot, 0)
        kv_rows = kv_ptr + (slot // block_size) * stride_kv_block + (slot % block_size) * stride_kv_row
        k_lat = tl.load(
            kv_rows[:, None] + offs_l[None, :], mask=chosen[:, None] & lat_mask[None, :], other=0.0
        )
        k_pe = tl.load(
            kv_rows[:, None] + LAT + offs_r[None, :], mask=chosen[:, None] & rope_mask[None, :], other=0.0
        )
        if WIDEN:
            k_lat = k_lat.to(tl.float32)  # [BLOCK_N, BLOCK_L]: the key's latent part and the value
            k_pe = k_pe.to(tl.float32)  # [BLOCK_N, BLOCK_R]

        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=INPUT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=INPUT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(chosen[None, :], s * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Before the first chosen row m stays -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc=acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # a query with no chosen row: zeros
    o_rows = o_ptr + pid_t * stride_ot + offs_h * stride_oh
    tl.store(
        o_rows[:, None] + offs_l[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=head_mask[:, None] & lat_mask[None, :],
    )
