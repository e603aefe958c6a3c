"""The Triton kernels of kernels/v4.py (see kernels/jit/__init__.py): DeepSeek-V4's hyper-connections,
its compressors' gated pooling and its attention over window rows and compressed entries.

Every sum here is float32, over tiles loaded whole or in chunks; 16-bit inputs are widened on load
(no tl.dot: the products are vector-by-matrix, and the interpreter's 16-bit dot is wrong).
"""

import triton
import triton.language as tl


@triton.jit
def hc_pre_kernel(
    x_ptr,  # [N, HC, H]: each token's streams contiguous
    fn_ptr,  # [(2 + HC) HC, HC H] float32
    base_ptr,  # [(2 + HC) HC] float32
    scale_ptr,  # [3] float32
    post_ptr,  # [N, HC] float32
    comb_ptr,  # [N, HC, HC] float32
    u_ptr,  # [N, H]
    stride_x,
    stride_u,
    eps,
    norm_eps,
    HC: tl.constexpr,
    H: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    W = HC * H
    row = x_ptr + n * stride_x
    squares = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, W, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        v = tl.load(row + offs, mask=offs < W, other=0.0).to(tl.float32)
        squares += v * v
    r = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / W + norm_eps)
    i = tl.arange(0, BLOCK_HC)
    j = tl.arange(0, BLOCK_HC)
    im, jm = i < HC, j < HC
    pair = im[:, None] & jm[None, :]
    pre_acc = tl.zeros([BLOCK_HC], dtype=tl.float32)
    post_acc = tl.zeros([BLOCK_HC], dtype=tl.float32)
    comb_acc = tl.zeros([BLOCK_HC, BLOCK_HC], dtype=tl.float32)
    for c0 in range(0, W, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        cm = offs < W
        v = tl.load(row + offs, mask=cm, other=0.0).to(tl.float32) * r
        f_pre = tl.load(fn_ptr + i[:, None] * W + offs[None, :], mask=im[:, None] & cm[None, :], other=0.0)
        pre_acc += tl.sum(f_pre * v[None, :], axis=1)
        f_post = tl.load(
            fn_ptr + (HC + i[:, None]) * W + offs[None, :], mask=im[:, None] & cm[None, :], other=0.0
        )
        post_acc += tl.sum(f_post * v[None, :], axis=1)
        k = 2 * HC + i[:, None] * HC + j[None, :]  # [BLOCK_HC, BLOCK_HC]
        f_comb = tl.load(
            fn_ptr + k[:, :, None] * W + offs[None, None, :],
            mask=pair[:, :, None] & cm[None, None, :],
            other=0.0,
        )
        comb_acc += tl.sum(f_comb * v[None, None, :], axis=2)
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(pre_acc * s0 + tl.load(base_ptr + i, mask=im, other=0.0)) + eps
    post = 2.0 * tl.sigmoid(post_acc * s1 + tl.load(base_ptr + HC + i, mask=im, other=0.0))
    logits = comb_acc * s2 + tl.load(base_ptr + 2 * HC + i[:, None] * HC + j[None, :], mask=pair, other=0.0)
    logits = tl.where(pair, logits, -1e30)  # finite: a padded row's max minus itself stays 0
    e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb = tl.where(pair, e / tl.sum(e, axis=1)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(post_ptr + n * HC + i, post, mask=im)
    tl.store(comb_ptr + n * HC * HC + i[:, None] * HC + j[None, :], comb, mask=pair)
    pre = tl.where(im, pre, 0.0)
    for d0 in range(0, H, BLOCK_H):
        d = d0 + tl.arange(0, BLOCK_H)
        dm = d < H
        x = tl.load(row + i[:, None] * H + d[None, :], mask=im[:, None] & dm[None, :], other=0.0).to(
            tl.float32
        )
        u = tl.sum(pre[:, None] * x, axis=0)
        tl.store(u_ptr + n * stride_u + d, u.to(u_ptr.dtype.element_ty), mask=dm)


@triton.jit
def hc_merge_kernel(
    x_ptr,  # [N, HC, H]
    post_ptr,  # [N, HC] float32
    comb_ptr,  # [N, HC, HC] float32
    out_ptr,  # [N, H]
    y_ptr,  # [N, HC, H]
    stride_x,
    stride_o,
    stride_y,
    HC: tl.constexpr,
    H: tl.constexpr,
    BLOCK_HC: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """y[j] = round(round(round(post_j) out) + round(sum_i round(comb[i, j]) x[i])), the roundings
    to the streams' dtype of HyperConnection.merge (a no-op in float32)."""
    n = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HC)
    im, dm = i < HC, d < H
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + n * stride_x + i[:, None] * H + d[None, :], mask=im[:, None] & dm[None, :], other=0.0)
    x = x.to(tl.float32)
    comb = tl.load(
        comb_ptr + n * HC * HC + i[:, None] * HC + i[None, :], mask=im[:, None] & im[None, :], other=0.0
    )
    comb = comb.to(dt).to(tl.float32)  # [i, j]
    post = tl.load(post_ptr + n * HC + i, mask=im, other=0.0).to(dt).to(tl.float32)  # [j]
    out = tl.load(out_ptr + n * stride_o + d, mask=dm, other=0.0).to(tl.float32)
    mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0).to(dt).to(tl.float32)  # [j, d]
    spread = (post[:, None] * out[None, :]).to(dt).to(tl.float32)
    tl.store(
        y_ptr + n * stride_y + i[:, None] * H + d[None, :],
        (spread + mixed).to(dt),
        mask=im[:, None] & dm[None, :],
    )


@triton.jit
def compress_pool_kernel(
    kv_ptr,  # [E, S, W] float32: each entry's S slots
    gate_ptr,  # [E, S, W] float32, -inf where a slot is empty
    weight_ptr,  # [W] float32: the norm's
    out_ptr,  # [E, W] float32
    eps,
    S: tl.constexpr,
    W: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """out = weight * RMSNorm(sum_s softmax_s(gate) kv), the softmax per channel over the slots."""
    e = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    sm = s < S
    squares = tl.zeros([BLOCK_W], dtype=tl.float32)
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < W
        at = e * S * W + s[:, None] * W + w[None, :]
        mask = sm[:, None] & wm[None, :]
        g = tl.load(gate_ptr + at, mask=mask, other=-1e30)  # finite: a padded channel stays a number
        kv = tl.load(kv_ptr + at, mask=mask, other=0.0)
        p = tl.exp(g - tl.max(g, axis=0)[None, :])
        pooled = tl.sum(p * kv, axis=0) / tl.sum(p, axis=0)
        pooled = tl.where(wm, pooled, 0.0)
        squares += pooled * pooled
        tl.store(out_ptr + e * W + w, pooled, mask=wm)
    r = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / W + eps)
    for w0 in range(0, W, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        wm = w < W
        pooled = tl.load(out_ptr + e * W + w, mask=wm, other=0.0)
        tl.store(out_ptr + e * W + w, tl.load(weight_ptr + w, mask=wm, other=0.0) * (pooled * r), mask=wm)


@triton.jit
def v4_attention_kernel(
    q_ptr,  # [T, H, D]
    win_ptr,  # the window cache, rows of D
    ent_ptr,  # the entries cache, rows of D (a dummy without one)
    ws_ptr,  # [T, KW] int64 rows of the window cache, -1 none
    es_ptr,  # [T, KC] int64 rows of the entries cache, -1 none
    sinks_ptr,  # [H] float32
    o_ptr,  # [T, H, D]
    scale,
    KW,
    KC,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_et,
    stride_ot,
    stride_oh,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One (token, head): an online softmax over its rows (K = V) that starts from the sink's logit
    (whose term joins the denominator and brings no value)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=dm, other=0.0).to(tl.float32)
    m_i = tl.load(sinks_ptr + h).to(tl.float32)
    l_i = m_i * 0.0 + 1.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for part in tl.static_range(2):
        base = win_ptr if part == 0 else ent_ptr
        slots_ptr = ws_ptr + t * stride_wt if part == 0 else es_ptr + t * stride_et
        count = KW if part == 0 else KC
        for j0 in range(0, count, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            slot = tl.load(slots_ptr + j, mask=j < count, other=-1)
            valid = slot >= 0
            rows = tl.load(
                base + slot[:, None] * D + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0
            )
            rows = rows.to(tl.float32)
            s = tl.where(valid, tl.sum(rows * q[None, :], axis=1) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * rows, axis=0)
            m_i = m_new
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, (acc / l_i).to(o_ptr.dtype.element_ty), mask=dm)
