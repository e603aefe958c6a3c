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

from kernels import native
from kernels.dispatch import cdiv, next_power_of_2, resolve_impl


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
    from kernels.jit import gate as jit

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
    block_g, block_s = next_power_of_2(groups), next_power_of_2(group_size)
    block_t = max(1, min(next_power_of_2(num_tokens), 16, 4096 // (block_g * block_s)))
    bias_arg = bias.contiguous() if bias is not None else scores_logits
    jit.grouped_topk_kernel[(cdiv(num_tokens, block_t),)](
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
        BLOCK_K=next_power_of_2(top_k),
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
