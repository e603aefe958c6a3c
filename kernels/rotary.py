"""Rotary position embedding with optional YaRN context extension, as DeepSeek uses it.

Each pair of rotary dimensions (x_a, x_b) at position p is rotated by the angle p * inv_freq[i]:

    (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin) * attention_factor

DeepSeek pairs adjacent dimensions (x0, x1), (x2, x3), ... ("interleaved"); the other layout pairs
dimension i with i + R/2. The output is always written with all first members, then all second
members (the fast float32 path keeps pairs interleaved instead). q and k go through the same permutation, so their dot product -- the only thing
attention reads -- is unchanged, and the cache stores k_pe in this layout.

YaRN (arXiv 2309.00071) blends interpolated (divided by `factor`) and original frequencies with
a linear ramp between the correction dimensions of beta_fast and beta_slow rotations, and scales
cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim).
"""

from __future__ import annotations

import math

import torch

from engine.config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dim/2] float32, attention_factor)."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin_cache(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (cos, sin), each [max_positions, dim/2] float32, attention factor folded in."""
    inv_freq, attention_factor = rope_inv_freq(rope, dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x [N, ..., R], cos/sin [N, R/2] (already gathered at each token's position) -> [N, ..., R]."""
    if interleaved and x.dtype == torch.float32:
        # One complex multiply per pair; the output keeps pairs interleaved (a fixed permutation of
        # the layout below, which q.k does not see). A slice that cannot be viewed as complex (odd
        # offset or stride, e.g. q[..., nope:] with an odd nope width) is copied rather than sent to
        # the reference: the layout must not depend on strides, or q and k could disagree.
        if not _complex_viewable(x):
            x = x.clone(memory_format=torch.contiguous_format)
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        rot = torch.complex(cos, sin).view(shape)
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)
    return apply_rotary_ref(x, cos, sin, interleaved)


def _complex_viewable(x: torch.Tensor) -> bool:
    return x.stride(-1) == 1 and x.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in x.stride()[:-1])


def apply_rotary_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    cos = cos.view(shape).to(x.dtype)
    sin = sin.view(shape).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
