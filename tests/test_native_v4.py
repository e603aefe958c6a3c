"""DeepSeek-V4's native CPU kernels (kernels/native/hyper.h): the hyper-connections' weights, block
input and merge, against the model's torch path (HyperConnection, exact against transformers in
tests/test_parity_v4.py) and a float64 reference of the weights, over odd widths, several stream
counts and batches, and a whole bf16 model whose decode takes them."""

from __future__ import annotations

import pytest
import torch

from engine.models.deepseek_v4 import HyperConnection
from kernels import native


@pytest.fixture(scope="module")
def loaded() -> bool:
    from engine.platform import load_native

    return load_native()


def _hc(hc: int, hidden: int, gen: torch.Generator) -> HyperConnection:
    h = HyperConnection(hc, hidden, 20, 1e-6, 1e-6)
    with torch.no_grad():
        h.fn.copy_(torch.randn(h.fn.shape, generator=gen) / (hc * hidden) ** 0.5)
        h.base.copy_(0.5 * torch.randn(h.base.shape, generator=gen))
        h.scale.copy_(1 + 0.3 * torch.randn(3, generator=gen))
    return h


def _weights64(h: HyperConnection, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, post, comb in float64, written out from the equations."""
    hc = h.hc
    x = streams.double().flatten(1)
    x = x / torch.sqrt((x * x).mean(-1, keepdim=True) + h.norm_eps)
    mixes = x @ h.fn.double().t()
    base, scale = h.base.double(), h.scale.double()
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + h.eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = torch.softmax((mixes[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc), dim=-1) + h.eps
    comb = comb / (comb.sum(-2, keepdim=True) + h.eps)
    for _ in range(h.iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + h.eps)
        comb = comb / (comb.sum(-2, keepdim=True) + h.eps)
    return pre, post, comb


@pytest.mark.parametrize(("tokens", "hc", "hidden"), [(1, 4, 512), (5, 4, 72), (33, 2, 100), (3, 8, 16)])
def test_hyper_connection_kernels_equal_the_torch_path(loaded, monkeypatch, tokens, hc, hidden):
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(tokens * 100 + hidden)
    h = _hc(hc, hidden, gen)
    streams = torch.randn(tokens, hc, hidden, generator=gen).bfloat16()
    out = torch.randn(tokens, hidden, generator=gen).bfloat16()
    post, comb, u = native.hc_pre(streams, h.fn, h.base, h.scale, h.iters, h.eps, h.norm_eps)
    merged = native.hc_merge(streams, post, comb, out)
    with monkeypatch.context() as m:
        m.setattr(native, "loaded", lambda: False)
        want_post, want_comb, want_u = h(streams)
        want_merged = HyperConnection.merge(streams, want_post, want_comb, out)
    pre64, post64, comb64 = _weights64(h, streams)
    torch.testing.assert_close(post.double(), post64, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb.double(), comb64, atol=2e-6, rtol=0)
    torch.testing.assert_close(post, want_post, atol=1e-6, rtol=0)
    torch.testing.assert_close(comb, want_comb, atol=1e-6, rtol=0)
    assert abs(comb64.sum(-2) - 1).max() < 1e-5  # columns sum to one after the last normalisation
    u64 = (pre64[..., None] * streams.double()).sum(1)
    assert ((u.double() - u64).abs() <= u64.abs() * 2**-8 + 1e-30).all()  # one bf16 rounding
    assert ((u.float() - want_u.float()).abs() <= want_u.float().abs() * 2**-7).all()
    # The merge: the same roundings as the torch path's; its float32 sums may differ in order only.
    diff = (merged.float() - want_merged.float()).abs()
    assert (diff <= want_merged.float().abs() * 2**-7).all(), diff.max()
    assert (diff == 0).float().mean() > 0.95


def test_bad_operands_name_the_shape(loaded):
    if not loaded:
        return
    h = _hc(4, 32, torch.Generator().manual_seed(0))
    streams = torch.zeros(2, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fn must be \[24, 128\]"):
        native.hc_pre(streams, h.fn[:, :64], h.base, h.scale, 20, 1e-6, 1e-6)
    with pytest.raises(ValueError, match=r"and out \[2, 32\], got .* and \(2, 31\)"):
        native.hc_merge(
            streams, torch.zeros(2, 4), torch.zeros(2, 4, 4), torch.zeros(2, 31, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match="CPU bfloat16"):
        native.hc_pre(streams.float(), h.fn, h.base, h.scale, 20, 1e-6, 1e-6)
