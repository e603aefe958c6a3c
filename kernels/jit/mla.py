"""The Triton kernels of kernels/mla.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def _mla_decode_split_kernel(
    q_ptr,  # [B, s_q, H, L+R]
    kv_ptr,  # [num_blocks, block_size, L+R]
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    o_ptr,  # [B, s_q*H, num_splits, L]: float32 partials, or the output itself with one split
    lse_ptr,  # [B, s_q*H, num_splits] float32
    scale_log2,  # scale * log2(e): the softmax runs in base 2
    num_splits,
    s_q,
    num_heads,
    block_size,
    stride_qb,
    stride_qs,
    stride_qh,
    stride_kv_block,
    stride_kv_row,
    stride_table_b,
    stride_ob,
    stride_om,
    stride_os,
    stride_lse_b,
    stride_lse_m,
    stride_lse_s,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr,  # BLOCK_N divides block_size: a tile of keys lies in one block
):
    # int64 offsets: a large cache holds more than 2^31 elements.
    pid_b = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + pid_b).to(tl.int64)
    # This split's keys: a BLOCK_N-aligned slice of the sequence.
    keys_per_split = (seq_len + num_splits - 1) // num_splits
    keys_per_split = (keys_per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    split_start = pid_s * keys_per_split
    split_end = tl.minimum(split_start + keys_per_split, seq_len)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query row = query index * H + head
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    row_mask = offs_m < s_q * num_heads
    lat_mask = offs_l < LAT
    rope_mask = offs_r < ROPE
    query = offs_m // num_heads
    # The last key each row sees (causal). Splits are BLOCK_N-aligned, so a tile runs past its
    # split's end only at seq_len, which this already excludes.
    last_key = seq_len - s_q + query  # [BLOCK_M]

    q_rows = q_ptr + pid_b * stride_qb + query * stride_qs + (offs_m % num_heads) * stride_qh
    q_lat = tl.load(q_rows[:, None] + offs_l[None, :], mask=row_mask[:, None] & lat_mask[None, :], other=0.0)
    q_pe = tl.load(
        q_rows[:, None] + LAT + offs_r[None, :], mask=row_mask[:, None] & rope_mask[None, :], other=0.0
    )
    q_lat = q_lat.to(tl.float32)  # [BLOCK_M, BLOCK_L]
    q_pe = q_pe.to(tl.float32)  # [BLOCK_M, BLOCK_R]

    table_row = block_table_ptr + pid_b * stride_table_b
    offs_kv_n = offs_n * stride_kv_row
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 scores)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.full([BLOCK_M, BLOCK_L], 0.0, tl.float32)
    for start_n in range(split_start, split_end, BLOCK_N):
        # Masked lanes load nothing (other=0): cache rows past seq_len (stale, NaN) are never read,
        # and neither are table columns past the last block.
        key_mask = offs_n < split_end - start_n  # [BLOCK_N]
        if TILE_IN_BLOCK:  # one table entry per tile
            page = tl.load(table_row + start_n // block_size).to(tl.int64)
            kv_rows = kv_ptr + page * stride_kv_block + (start_n % block_size) * stride_kv_row + offs_kv_n
        else:  # small or odd block sizes: each key's own entry
            keys = start_n + offs_n
            page = tl.load(table_row + keys // block_size, mask=key_mask, other=0).to(tl.int64)
            kv_rows = kv_ptr + page * stride_kv_block + (keys % block_size) * stride_kv_row
        k_lat = tl.load(
            kv_rows[:, None] + offs_l[None, :], mask=key_mask[:, None] & lat_mask[None, :], other=0.0
        )
        k_pe = tl.load(
            kv_rows[:, None] + LAT + offs_r[None, :], mask=key_mask[:, None] & rope_mask[None, :], other=0.0
        )
        k_lat = k_lat.to(tl.float32)  # [BLOCK_N, BLOCK_L], the key's latent part and the value
        k_pe = k_pe.to(tl.float32)  # [BLOCK_N, BLOCK_R]

        s = tl.dot(q_lat, tl.trans(k_lat), input_precision=INPUT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), acc=s, input_precision=INPUT_PRECISION)  # [BLOCK_M, BLOCK_N]
        visible = offs_n[None, :] <= (last_key - start_n)[:, None]
        s = tl.where(visible, s * scale_log2, float("-inf"))  # masked before exp: never NaN

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 so exp2 gives 0, not NaN.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_shift)
        p = tl.exp2(s - m_shift[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p, k_lat, acc=acc * alpha[:, None], input_precision=INPUT_PRECISION)
        m_i = m_new

    seen = l_i > 0.0
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # * ln 2: base e

    o_rows = o_ptr + pid_b * stride_ob + offs_m * stride_om + pid_s * stride_os
    tl.store(
        o_rows[:, None] + offs_l[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_mask[:, None] & lat_mask[None, :],
    )
    tl.store(
        lse_ptr + pid_b * stride_lse_b + offs_m * stride_lse_m + pid_s * stride_lse_s, lse, mask=row_mask
    )


@triton.jit
def _mla_decode_merge_kernel(
    o_part_ptr,  # [B, s_q*H, num_splits, L] float32
    lse_part_ptr,  # [B, s_q*H, num_splits] float32
    o_ptr,  # [B, s_q*H, L]
    lse_ptr,  # [B, s_q*H] float32
    num_splits,
    num_rows,
    stride_pb,
    stride_pm,
    stride_ps,
    stride_plb,
    stride_plm,
    stride_pls,
    stride_ob,
    stride_om,
    stride_lse_b,
    stride_lse_m,
    LAT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= num_splits
):
    pid_b = tl.program_id(0).to(tl.int64)
    pid_m = tl.program_id(1).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_l = tl.arange(0, BLOCK_L)
    offs_s = tl.arange(0, BLOCK_S)
    row_mask = offs_m < num_rows
    tile_mask = row_mask[:, None] & (offs_l[None, :] < LAT)

    lse_rows = lse_part_ptr + pid_b * stride_plb + offs_m * stride_plm  # [BLOCK_M]
    lse_all = tl.load(
        lse_rows[:, None] + offs_s[None, :] * stride_pls,
        mask=row_mask[:, None] & (offs_s[None, :] < num_splits),
        other=float("-inf"),
    )  # [BLOCK_M, BLOCK_S]
    lse_max = tl.max(lse_all, axis=1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty: weights exp(-inf) = 0
    denom = tl.sum(tl.exp(lse_all - lse_max[:, None]), axis=1)

    o_tiles = o_part_ptr + pid_b * stride_pb + offs_m[:, None] * stride_pm + offs_l[None, :]
    acc = tl.full([BLOCK_M, BLOCK_L], 0.0, tl.float32)
    for _ in range(num_splits):
        weight = tl.exp(tl.load(lse_rows, mask=row_mask, other=float("-inf")) - lse_max)  # [BLOCK_M]
        acc += weight[:, None] * tl.load(o_tiles, mask=tile_mask, other=0.0)  # an empty split holds 0
        lse_rows += stride_pls
        o_tiles += stride_ps

    seen = denom > 0.0
    denom_safe = tl.where(seen, denom, 1.0)
    o = acc / denom_safe[:, None]
    lse = tl.where(seen, lse_max + tl.log(denom_safe), float("-inf"))
    o_tiles = o_ptr + pid_b * stride_ob + offs_m[:, None] * stride_om + offs_l[None, :]
    tl.store(o_tiles, o.to(o_ptr.dtype.element_ty), mask=tile_mask)
    tl.store(lse_ptr + pid_b * stride_lse_b + offs_m * stride_lse_m, lse, mask=row_mask)
