"""Shared pieces of the kernel tests: one per-dtype tolerance table, dtype ids, seeded generators.

Tolerances are against float64 references. float32 paths differ only by rounding and summation
order; float16 keeps 11 significant bits and bfloat16 8, so 16-bit inputs and the final
rounding of outputs (and, in references, of some intermediates) dominate there.
"""

from __future__ import annotations

import pytest
import torch

TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=3e-3, rtol=3e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_ID = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.cpu().double(), expected.cpu().double(), **TOL[dtype])


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Kernel-test tensors are tiny: intra-op threads only add synchronisation, which on a busy
    2-core machine makes each op tens of times slower. Import it into a test module to use it;
    the thread count is restored for the modules that follow."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
