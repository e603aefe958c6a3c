"""Choose between a Triton kernel and its PyTorch reference.

Every public kernel function takes `impl: "auto" | "triton" | "torch"`. "auto" picks Triton for
CUDA tensors when a Triton kernel exists and the PyTorch reference everywhere else; both honour
the same contract, so the engine never needs to know which one ran.
"""

from __future__ import annotations

import torch

IMPLS = ("auto", "triton", "torch")


def resolve_impl(impl: str, tensor: torch.Tensor, *, has_triton: bool) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if has_triton and tensor.is_cuda else "torch"
    if impl == "triton" and not has_triton:
        raise NotImplementedError("no Triton kernel for this op yet; use impl='torch'")
    return impl


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launch grids (triton.cdiv without importing triton)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (>= 1), for the kernels' block sizes (triton.next_power_of_2)."""
    return 1 << max(0, n - 1).bit_length()


def check_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int]:
    """An extend attention's operands: q [n, H, Dqk], k [ctx, H, Dqk], v [ctx, H, Dv] with ctx >= n
    (ValueError naming the one that is not) -> (n, H, Dqk, ctx, Dv)."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [n, H, D], [ctx, H, D], [ctx, H, Dv]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, heads, d_qk = q.shape
    ctx, d_v = k.shape[0], v.shape[-1]
    if k.shape != (ctx, heads, d_qk):
        raise ValueError(f"k must be [ctx, H={heads}, Dqk={d_qk}], got {tuple(k.shape)}")
    if v.shape[:2] != (ctx, heads):
        raise ValueError(f"v must be [ctx={ctx}, H={heads}, Dv], got {tuple(v.shape)}")
    if ctx < n:
        raise ValueError(f"ctx (k.shape[0] = {ctx}) must be >= n (q.shape[0] = {n})")
    return n, heads, d_qk, ctx, d_v
