"""Rotary position embedding with optional YaRN context extension, as DeepSeek uses it.

Each pair of rotary dimensions (x_a, x_b) at position p is rotated by the angle p * inv_freq[i]:

    (x_a, x_b) -> (x_a cos - x_b sin, x_b cos + x_a sin) * attention_factor

DeepSeek pairs adjacent dimensions (x0, x1), (x2, x3), ... ("interleaved"); the other layout pairs
dimension i with i + R/2. Every implementation here writes the output with all first members, then
all second members (`OUTPUT_LAYOUT`, "halves"). q and k go through the same permutation, so their
dot product -- the only thing attention reads -- is unchanged; but the cache stores k_pe in this
layout, so it must be the same on every path and device (KV moves between CPU and GPU workers),
and the KV cache spec names it (engine/kv_cache/spec.py), so changing it changes the compatibility
hash.

YaRN (arXiv 2309.00071) blends interpolated (divided by `factor`) and original frequencies with
a linear ramp between the correction dimensions of beta_fast and beta_slow rotations, and scales
cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim).

Kernel layout: one program per (token, block of heads) over x viewed as [N, H, R]; it loads the
pairs' two members as two [BLOCK_H, R/2] tiles and writes them back as the two halves.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from kernels import native
from kernels.dispatch import cdiv, next_power_of_2, resolve_impl

OUTPUT_LAYOUT = "halves"
"""The element order of every rotated output: the pairs' first members, then their second members."""


class RopeParams(Protocol):
    """The rotary settings the tables are built from (engine.config.RopeConfig is one)."""

    theta: float
    type: str
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float
    mscale: float | None
    mscale_all_dim: float | None
    attention_factor: float | None
    truncate: bool


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-scale correction for a context extended `scale` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeParams, dim: int) -> tuple[torch.Tensor, float]:
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


def rope_cos_sin_cache(rope: RopeParams, dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (cos, sin), each [max_positions, dim/2] float32, attention factor folded in."""
    inv_freq, attention_factor = rope_inv_freq(rope, dim)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def _apply_rotary_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor | None
) -> torch.Tensor:
    from kernels.jit import rotary as jit

    # (1) check
    if x.dim() < 2:
        raise ValueError(f"x must be [N, ..., R], got shape {tuple(x.shape)}")
    n, r = x.shape[0], x.shape[-1]
    if r % 2:
        raise ValueError(f"the rotary width R must be even, got {r}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, r // 2):
            raise ValueError(f"{name} must be [N={n}, R/2={r // 2}], got shape {tuple(t.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(
            f"out must match x ({tuple(x.shape)}, {x.dtype}), got {tuple(out.shape)}, {out.dtype}"
        )
    # (2) allocate
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out
    x3 = x.reshape(n, -1, r)  # [N, H, R], H = the middle dims flattened (a view when possible)
    try:
        out3 = out.view(n, -1, r)
    except RuntimeError as e:
        raise ValueError(f"out must be viewable as [N, H, R], got strides {out.stride()}") from e
    heads = x3.shape[1]
    block_h = min(next_power_of_2(heads), 16)
    # (3) launch
    jit.rotary_kernel[(n, cdiv(heads, block_h))](
        x3,
        cos,
        sin,
        out3,
        *x3.stride(),
        *cos.stride(),
        *sin.stride(),
        *out3.stride(),
        heads,
        HALF=r // 2,
        INTERLEAVED=interleaved,
        BLOCK_H=block_h,
        BLOCK_HALF=next_power_of_2(r // 2),
    )
    return out


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool,
    out: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """x [N, ..., R], cos/sin [N, R/2] (already gathered at each token's position) -> [N, ..., R]
    in x's dtype, written to `out` (which may be x itself) when given."""
    if resolve_impl(impl, x, has_triton=True) == "triton":
        return _apply_rotary_triton(x, cos, sin, interleaved, out)
    if x.dtype == torch.bfloat16 and x.dim() in (2, 3) and x.stride(-1) == 1 and native.loaded():
        result = native.rotary(x, cos, sin, interleaved)  # one call for the reference's ten ops
    elif interleaved and x.dtype == torch.float32:
        # One complex multiply per pair, written out as OUTPUT_LAYOUT (real parts, then imaginary).
        # A slice that cannot be viewed as complex (odd offset or stride, e.g. q[..., nope:] with
        # an odd nope width) is copied first.
        xc = x if _complex_viewable(x) else x.clone(memory_format=torch.contiguous_format)
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        rot = torch.complex(cos, sin).view(shape)
        pairs = torch.view_as_real(torch.view_as_complex(xc.unflatten(-1, (-1, 2))) * rot)  # [..., R/2, 2]
        result = pairs.transpose(-1, -2).flatten(-2)
    else:
        result = apply_rotary_ref(x, cos, sin, interleaved)
    return result if out is None else out.copy_(result)


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
