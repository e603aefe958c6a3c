"""Expert routing for DeepSeek MoE layers: scores, group-limited top-k, routing weights.

    scores  = sigmoid(logits)  (V3)   or  softmax(logits)  (V2)
    choice  = scores + bias           (V3's e_score_correction_bias steers choice only)
    groups  = experts split into n_group equal groups; a group's score is the sum of its top-2
              choice scores when a bias is given (V3 "noaux_tc") and its max otherwise (V2)
    keep the best topk_group groups, then the top_k experts among them by choice score
    weights = scores (unbiased) of the chosen experts, normalised to sum 1 when norm_topk_prob,
              times routed_scaling_factor

Ties are broken by `torch.topk`, as the HF reference does, so both choose the same experts.
"""

from __future__ import annotations

import torch

from kernels.dispatch import resolve_impl


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
    resolve_impl(impl, scores_logits, has_triton=False)
    return grouped_topk_ref(
        scores_logits, bias, n_group, topk_group, top_k, norm_topk_prob, routed_scaling_factor, scoring
    )


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
    choice = scores if bias is None else scores + bias.float()
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        if bias is not None:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
        # -inf keeps masked experts out even when every kept score is negative (biased V3 choice).
        choice = choice.masked_fill(~score_mask.bool(), float("-inf") if bias is not None else 0.0)
    topk_ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_ids
