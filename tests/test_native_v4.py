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


def _attention64(q, window, wslots, entries, eslots, sinks, scale) -> torch.Tensor:
    """Each token over its slots' rows (K = V) with a sink logit per head, in float64."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    win = window.reshape(-1, q.shape[-1]).double()
    ent = entries.reshape(-1, q.shape[-1]).double() if entries is not None else None
    for t in range(q.shape[0]):
        rows = [win[s] for s in wslots[t].tolist() if s >= 0]
        if ent is not None:
            rows += [ent[s] for s in eslots[t].tolist() if s >= 0]
        keys = torch.stack(rows)  # [L, D]
        logits = q[t].double() @ keys.t() * scale  # [H, L]
        full = torch.cat((logits, sinks.double()[:, None]), dim=1).softmax(dim=-1)[:, :-1]
        out[t] = full @ keys
    return out


@pytest.mark.parametrize(
    ("tokens", "heads", "dim", "entries"), [(1, 8, 512, True), (7, 3, 48, True), (5, 16, 64, False)]
)
def test_v4_attention_equals_the_float64_reference(loaded, tokens, heads, dim, entries):
    """Random window and entry slots (-1 among them, out of order, shared between tokens), sinks
    of both signs; the entries cache holds NaN wherever no token reads."""
    if not loaded:
        return
    gen = torch.Generator().manual_seed(tokens * 10 + heads)
    window = torch.randn(6, 16, dim, generator=gen).bfloat16()
    ent = torch.full((4, 8, dim), float("nan")).bfloat16()
    q = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    wslots = torch.randint(-1, 96, (tokens, 20), generator=gen)
    wslots[:, 0] = torch.randint(0, 96, (tokens,), generator=gen)  # every token sees a row
    eslots = torch.randint(-1, 32, (tokens, 9), generator=gen) if entries else None
    if entries:
        for s in eslots.flatten().tolist():
            if s >= 0:
                ent.view(-1, dim)[s] = torch.randn(dim, generator=gen).bfloat16()
    sinks = 2 * torch.randn(heads, generator=gen)
    scale = dim**-0.5
    got = native.v4_attention(q, window, wslots, ent if entries else None, eslots, sinks, scale)
    want = _attention64(q, window, wslots, ent if entries else None, eslots, sinks, scale)
    assert torch.isfinite(got.float()).all()
    # bf16 scores, probabilities and output: within a few bf16 roundings of the float64 result.
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="slots lie outside their cache"):
        native.v4_attention(q, window, wslots + 96, None, None, sinks, scale)


@pytest.mark.parametrize(("entries", "slots", "width"), [(3, 8, 512), (2, 128, 40), (1, 5, 17)])
def test_compress_pool_equals_the_float64_reference(loaded, entries, slots, width):
    """The gated pooling and its RMSNorm, an entry's first half of slots empty (-inf gates: CSA's
    entry 0), against float64."""
    if not loaded:
        return
    from kernels.v4 import compress_pool_ref

    gen = torch.Generator().manual_seed(entries * 100 + slots)
    kv = torch.randn(entries, slots, width, generator=gen)
    gate = 3 * torch.randn(entries, slots, width, generator=gen)
    gate[0, : slots // 2] = float("-inf")
    weight = 1 + 0.1 * torch.randn(width, generator=gen)
    got = native.compress_pool(kv, gate, weight, 1e-6)
    want = compress_pool_ref(kv.double(), gate.double(), weight.double(), 1e-6)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
