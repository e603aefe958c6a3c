"""Verifying drafted tokens against the target model, exactly.

The drafts are the MTP layer's argmax, i.e. drawn from a point mass q = one-hot(d). Position i of
the target forward gives p_i (the request's own sampling distribution: temperature, min_p,
top_k, top_p; engine.sampler.target_probs). Standard speculative sampling then:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i)) = p_i(d_i)
    on the first rejection, sample from the residual norm(max(p_i - q_i, 0)) = p_i without d_i
    if every draft is accepted, sample a bonus token from p_k

so every emitted token has exactly the target distribution. Under greedy sampling (p one-hot at
the argmax) this reduces to: accept while d_i equals the target's argmax, then emit the argmax.
"""

from __future__ import annotations

import torch

from engine.sampler import target_probs
from engine.sampling_params import SamplingParams


def verify_greedy(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """target_tokens: the target's argmax at the last known token and after each draft (k+1)
    -> the tokens to emit (1..k+1)."""
    out = []
    for i, d in enumerate(drafts):
        if d != target_tokens[i]:
            return out + [target_tokens[i]]
        out.append(d)
    return out + [target_tokens[len(drafts)]]


def verify_sampled(
    target_logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None
) -> list[int]:
    """The same under temperature / top-k / top-p / min-p sampling (rejection sampling)."""
    probs = target_probs(target_logits.clone(), [params] * target_logits.shape[0])  # [k+1, V]
    return accept_from_probs(probs, drafts, generator)


def accept_from_probs(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """probs [k+1, V] target distributions; drafts drawn from one-hot q -> emitted tokens."""
    uniforms = torch.rand(len(drafts) + 1, generator=generator, dtype=torch.float64)  # fixed draws per step
    out = []
    for i, d in enumerate(drafts):
        if uniforms[i] < probs[i, d]:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        return out + [_draw(residual, generator)]
    return out + [_draw(probs[len(drafts)], generator)]


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    total = weights.sum()
    if total <= 0:  # all mass on the rejected draft cannot happen (it would have been accepted)
        return int(weights.argmax())
    return int(torch.multinomial(weights / total, 1, generator=generator))
