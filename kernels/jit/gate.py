"""The Triton kernels of kernels/gate.py (see kernels/jit/__init__.py)."""

import triton
import triton.language as tl


@triton.jit
def grouped_topk_kernel(
    logits_ptr,  # [T, E], any float dtype
    bias_ptr,  # [E] or a dummy when HAS_BIAS is false
    weights_ptr,  # [T, TOP_K] float32 out
    ids_ptr,  # [T, TOP_K] int64 out
    num_tokens,
    stride_lt,
    stride_le,
    stride_wt,
    stride_it,
    routed_scaling_factor,
    NUM_EXPERTS: tl.constexpr,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    SOFTMAX: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_LIMITED: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    BLOCK_E: tl.constexpr = BLOCK_G * BLOCK_S
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)  # padded slot: group offs_e // BLOCK_S, member offs_e % BLOCK_S
    offs_k = tl.arange(0, BLOCK_K)
    group = offs_e // BLOCK_S
    member = offs_e % BLOCK_S
    expert = group * GROUP_SIZE + member  # [BLOCK_E] real expert id (padding slots alias: mask them)
    valid_e = (group < N_GROUP) & (member < GROUP_SIZE)
    mask_t = offs_t < num_tokens
    valid = mask_t[:, None] & valid_e[None, :]  # [BLOCK_T, BLOCK_E]

    logits = tl.load(
        logits_ptr + offs_t[:, None].to(tl.int64) * stride_lt + expert[None, :] * stride_le,
        mask=valid,
        other=0.0,
    ).to(tl.float32)
    if SOFTMAX:
        logits = tl.where(valid_e[None, :], logits, float("-inf"))  # padded tokens stay finite
        num = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        scores = num / tl.sum(num, axis=1)[:, None]
    else:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    if HAS_BIAS:
        choice = scores + tl.load(bias_ptr + expert, mask=valid_e, other=0.0).to(tl.float32)[None, :]
    else:
        choice = scores

    if GROUP_LIMITED:
        grouped = tl.reshape(tl.where(valid, choice, float("-inf")), [BLOCK_T, BLOCK_G, BLOCK_S])
        top1 = tl.max(grouped, axis=2)  # [BLOCK_T, BLOCK_G]
        if HAS_BIAS:  # sum of the two best; a tied best counts twice
            first = tl.argmax(grouped, axis=2, tie_break_left=True)
            offs_s = tl.arange(0, BLOCK_S)
            second = tl.where(offs_s[None, None, :] == first[:, :, None], float("-inf"), grouped)
            group_score = top1 + tl.max(second, axis=2)
        else:
            group_score = top1
        offs_g = tl.arange(0, BLOCK_G)
        free = (offs_g < N_GROUP)[None, :] & mask_t[:, None]  # [BLOCK_T, BLOCK_G] not yet kept
        kept = valid_e[None, :] & (offs_t < 0)[:, None]  # [BLOCK_T, BLOCK_E] all false
        for _g in range(TOPK_GROUP):  # best remaining group, lowest index among equals
            best = tl.max(tl.where(free, group_score, float("-inf")), axis=1)
            pick = tl.min(tl.where(free & (group_score == best[:, None]), offs_g[None, :], BLOCK_G), axis=1)
            free = free & (offs_g[None, :] != pick[:, None])
            kept = kept | (group[None, :] == pick[:, None])
        # The reference fills dropped experts with -inf when biased (scores can be negative) and
        # with 0 otherwise (softmax scores are positive); the same fill keeps the same ties.
        fill = float("-inf") if HAS_BIAS else 0.0
        choice = tl.where(kept, choice, fill)

    out_ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    out_w = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    free = valid
    for i in range(TOP_K):  # best remaining expert, lowest index among equals (values may be -inf)
        best = tl.max(tl.where(free, choice, float("-inf")), axis=1)
        pick = tl.min(tl.where(free & (choice == best[:, None]), expert[None, :], NUM_EXPERTS), axis=1)
        hit = valid & (expert[None, :] == pick[:, None])
        free = free & ~hit
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        out_ids = tl.where(offs_k[None, :] == i, pick.to(tl.int64)[:, None], out_ids)
        out_w = tl.where(offs_k[None, :] == i, w[:, None], out_w)
    if NORM_TOPK_PROB:
        out_w = out_w / (tl.sum(out_w, axis=1)[:, None] + 1e-20)
    out_w = out_w * routed_scaling_factor
    out_mask = mask_t[:, None] & (offs_k < TOP_K)[None, :]
    row = offs_t[:, None].to(tl.int64)
    tl.store(weights_ptr + row * stride_wt + offs_k[None, :], out_w, mask=out_mask)
    tl.store(ids_ptr + row * stride_it + offs_k[None, :], out_ids, mask=out_mask)
