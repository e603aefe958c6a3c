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
