"""DeepSeek-V4's Triton kernels (kernels/jit/v4.py) against their PyTorch references (kernels/v4.py)
and, for the weights, a float64 transcription of the equations.

Under the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1), on a GPU as is.
Shapes are small and not powers of two (hc 3, H 40, D 48, 5 or 7 slots) so every mask is
exercised; slots of -1, a token seeing only its sink, sinks of both signs, empty compressor slots
(-inf gates) and stream counts of 1 to 4.
"""

from __future__ import annotations

import pytest
import torch

from kernels.v4 import (
    compress_pool,
    compress_pool_ref,
    hc_merge,
    hc_merge_ref,
    hc_pre,
    hc_pre_ref,
    v4_attention,
    v4_attention_ref,
)
from tests.kernel_testing import DTYPE_ID, TOL, assert_close, gen, one_thread  # noqa: F401

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _hc_params(hc: int, h: int, g: torch.Generator):
    k = (2 + hc) * hc
    fn = torch.randn(k, hc * h, generator=g) / (hc * h) ** 0.5
    return (
        fn.to(DEVICE),
        (0.5 * torch.randn(k, generator=g)).to(DEVICE),
        (1 + 0.3 * torch.randn(3, generator=g)).to(DEVICE),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_ID[d])
@pytest.mark.parametrize(("n", "hc", "h"), [(3, 4, 40), (2, 3, 17), (1, 1, 8)])
def test_hyper_connection_kernels_match_the_reference(n, hc, h, dtype):
    g = gen(n * 100 + hc * 10 + h)
    fn, base, scale = _hc_params(hc, h, g)
    streams = torch.randn(n, hc, h, generator=g).to(DEVICE, dtype)
    out = torch.randn(n, h, generator=g).to(DEVICE, dtype)
    post, comb, u = hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, impl="triton")
    want_post, want_comb, want_u = hc_pre_ref(streams, fn, base, scale, 20, 1e-6, 1e-6)
    torch.testing.assert_close(post.cpu(), want_post.cpu(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(comb.cpu(), want_comb.cpu(), atol=2e-6, rtol=1e-5)
    assert_close(u, want_u, dtype)
    # Sinkhorn: every column sums to one, every row close to it.
    torch.testing.assert_close(comb.sum(-2).cpu(), torch.ones(n, hc), atol=1e-5, rtol=0)
    merged = hc_merge(streams, post, comb, out, impl="triton")
    assert_close(merged, hc_merge_ref(streams, post, comb, out), dtype)
    # float64, from the equations: the block input is the pre-weighted streams.
    x = streams.double().flatten(1)
    m = (x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)) @ fn.double().t()
    pre = torch.sigmoid(m[:, :hc] * scale[0].double() + base[:hc].double()) + 1e-6
    assert_close(u, (pre[..., None] * streams.double()).sum(1), dtype)


@pytest.mark.parametrize(("entries", "slots", "width"), [(3, 8, 40), (2, 5, 48), (1, 16, 24)])
def test_compressor_pooling_matches_the_reference(entries, slots, width):
    g = gen(entries * 10 + slots)
    kv = torch.randn(entries, slots, width, generator=g).to(DEVICE)
    gate = torch.randn(entries, slots, width, generator=g).to(DEVICE)
    gate[0, : slots // 2] = float("-inf")  # an entry 0's missing previous window
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(DEVICE)
    got = compress_pool(kv, gate, weight, 1e-6, impl="triton")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(
        got.cpu(), compress_pool_ref(kv, gate, weight, 1e-6).cpu(), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: DTYPE_ID[d])
@pytest.mark.parametrize(("tokens", "heads", "dim", "with_entries"), [(3, 2, 48, True), (2, 3, 40, False)])
def test_attention_matches_the_reference(tokens, heads, dim, with_entries, dtype):
    g = gen(tokens * 10 + heads)
    window = torch.randn(5, 4, dim, generator=g).to(DEVICE, dtype)
    entries = torch.randn(3, 2, dim, generator=g).to(DEVICE, dtype) if with_entries else None
    q = torch.randn(tokens, heads, dim, generator=g).to(DEVICE, dtype)
    wslots = torch.randint(-1, 20, (tokens, 7), generator=g)
    wslots[-1] = -1  # the last token sees no window row: only the sink (and any entries)
    eslots = torch.randint(-1, 6, (tokens, 5), generator=g) if with_entries else None
    sinks = 2 * torch.randn(heads, generator=g)
    args = (
        q,
        window,
        wslots.to(DEVICE),
        entries,
        eslots.to(DEVICE) if with_entries else None,
        sinks.to(DEVICE),
        dim**-0.5,
    )
    got = v4_attention(*args, impl="triton")
    want = v4_attention_ref(*args)
    assert_close(got, want, dtype)
    if not with_entries:  # a token with nothing but its sink attends to nothing
        assert got[-1].abs().max() == 0
