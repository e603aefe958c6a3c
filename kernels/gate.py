"""Expert routing for DeepSeek MoE layers: scores, group-limited top-k, routing weights.

    scores  = sigmoid(logits)  (V3)   or  softmax(logits)  (V2)
    choice  = scores + bias           (V3's e_score_correction_bias steers choice only)
    groups  = experts split into n_group equal groups; a group's score is the sum of its top-2
              choice scores when a bias is given (V3 "noaux_tc") and its max otherwise (V2)
    keep the best topk_group groups, then the top_k experts among them by choice score
    weights = scores (unbiased) of the chosen experts, normalised to sum 1 when norm_topk_prob,
              times routed_scaling_factor

Ties. Among exactly equal values the lowest index wins, for groups and experts alike, in the
reference and the kernel: a fixed, device-independent rule. (`torch.topk`, which the HF
reference uses, has no tie order -- on CPU it partitions with std::nth_element and often picks a
higher index -- so the reference takes its top-k with a stable sort instead. Without exact ties,
which router scores from real activations essentially never have, the choice is the same.)
The order of the k chosen experts is unspecified in both.

Kernel layout: one program per BLOCK_T tokens. The logits are loaded as a [BLOCK_T, BLOCK_E]
tile whose columns are the experts laid out group by group, each group padded to BLOCK_S slots
(masked); group scores reduce the [BLOCK_T, BLOCK_G, BLOCK_S] view of it, and each of the top_k
picks is a masked row arg-max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import native
from kernels.dispatch import resolve_impl


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


def _grouped_topk_triton(
    scores_logits: torch.Tensor,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    scoring: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    # (1) check
    if scores_logits.dim() != 2:
        raise ValueError(f"scores_logits must be [T, E], got shape {tuple(scores_logits.shape)}")
    num_tokens, num_experts = scores_logits.shape
    if scoring not in ("sigmoid", "softmax"):
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group must divide the {num_experts} experts, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, n_group={n_group}], got {topk_group}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    group_limited = n_group > 1 and topk_group < n_group
    if group_limited and bias is not None and num_experts // n_group < 2:
        raise ValueError("biased group scores sum each group's top 2: groups need at least 2 experts")
    if bias is not None and bias.shape != (num_experts,):
        raise ValueError(f"bias must be [E={num_experts}], got shape {tuple(bias.shape)}")
    # (2) allocate
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=scores_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=scores_logits.device)
    if num_tokens == 0:
        return weights, ids
    # (3) launch: without group limiting the whole row is one group. A program routes BLOCK_T
    # (at most 16) tokens at once, its tile [BLOCK_T, BLOCK_E] capped at 4096 values.
    groups = n_group if group_limited else 1
    group_size = num_experts // groups
    block_g, block_s = triton.next_power_of_2(groups), triton.next_power_of_2(group_size)
    block_t = max(1, min(triton.next_power_of_2(num_tokens), 16, 4096 // (block_g * block_s)))
    bias_arg = bias.contiguous() if bias is not None else scores_logits
    grouped_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        scores_logits,
        bias_arg,
        weights,
        ids,
        num_tokens,
        scores_logits.stride(0),
        scores_logits.stride(1),
        weights.stride(0),
        ids.stride(0),
        float(routed_scaling_factor),
        NUM_EXPERTS=num_experts,
        N_GROUP=groups,
        GROUP_SIZE=group_size,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        SOFTMAX=scoring == "softmax",
        HAS_BIAS=bias is not None,
        GROUP_LIMITED=group_limited,
        NORM_TOPK_PROB=norm_topk_prob,
        BLOCK_T=block_t,
        BLOCK_G=block_g,
        BLOCK_S=block_s,
        BLOCK_K=triton.next_power_of_2(top_k),
    )
    return weights, ids


def grouped_topk(
    scores_logits: torch.Tensor,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    scoring: str = "sigmoid",
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores_logits [T, E] (any float dtype; computed in float32), bias [E] or None
    -> (topk_weights [T, top_k] float32, topk_ids [T, top_k] int64)."""
    args = (scores_logits, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor, scoring)
    if resolve_impl(impl, scores_logits, has_triton=True) == "triton":
        return _grouped_topk_triton(*args)
    return grouped_topk_ref(*args)


def _top_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest values along the last dim; among equal values the lowest index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def grouped_topk_ref(
    scores_logits: torch.Tensor,
    bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    scoring: str = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = scores_logits.float()
    if scoring == "sigmoid":
        scores = logits.sigmoid()
    elif scoring == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {scoring!r}")
    num_tokens, num_experts = scores.shape
    if num_tokens * num_experts <= HOST_SELECT_MAX and native.loaded() and scores.is_cpu:
        bias32 = None if bias is None else bias.float()
        return native.route(scores, bias32, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor)
    choice = scores if bias is None else scores + bias.float()
    group_scores = None
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        if bias is not None:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
    # -inf keeps masked experts out even when every kept score is negative (biased V3 choice).
    masked = float("-inf") if bias is not None else 0.0
    select = _select_on_host if num_tokens * num_experts <= HOST_SELECT_MAX else _select
    topk_ids = select(choice, group_scores, topk_group, top_k, masked)
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids


HOST_SELECT_MAX = 256
"""Routing batches of at most this many (token, expert) scores pick their experts on the host: in
one native call from the scores on where the native kernels are loaded (native.route, 77 -> 15 us
a batch-1 layer in a decode step), else from one small copy: a decode step's few tokens cost ~20
tiny tensor ops the other way."""


def _select_on_host(
    choice: torch.Tensor, group_scores: torch.Tensor | None, topk_group: int, top_k: int, masked: float
) -> torch.Tensor:
    """The same choice as `_select`, in Python: stable descending order, ties to the lowest index,
    experts outside the kept groups valued `masked`."""
    num_experts = choice.shape[1]
    rows = choice.tolist()
    groups = group_scores.tolist() if group_scores is not None else None
    ids = []
    for t, row in enumerate(rows):
        if groups is not None:
            kept = set(sorted(range(len(groups[t])), key=lambda g: -groups[t][g])[:topk_group])
            size = num_experts // len(groups[t])
            row = [v if e // size in kept else masked for e, v in enumerate(row)]
        ids.append(sorted(range(num_experts), key=lambda e: -row[e])[:top_k])
    return torch.tensor(ids, dtype=torch.long, device=choice.device).view(len(rows), top_k)


def _select(
    choice: torch.Tensor, group_scores: torch.Tensor | None, topk_group: int, top_k: int, masked: float
) -> torch.Tensor:
    """-> topk ids [T, K]: the top_k choices among the experts of the topk_group best groups
    (experts outside them valued `masked`); among equal values the lowest index."""
    num_tokens, num_experts = choice.shape
    if group_scores is not None:
        grouped = choice.view(num_tokens, group_scores.shape[1], -1)
        group_idx = _top_indices(group_scores, topk_group)
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~score_mask.bool(), masked)
    return _top_indices(choice, top_k)
