"""The native prefill ("extend") attention (kernels/native/extend.h) against a float64 reference of
the same causal attention: odd head sizes, prefixes, contexts across its 256-key chunks, a
strided v (MLA's, a view of kv_b's output); a prompt's rows bit for bit the same in any chunking;
the AVX2 build's own loops the same bits as the AVX-512 form on its emulation; and the engine's
prefill path taking it."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.attention import extend_attention


@pytest.fixture(scope="module")
def loaded() -> bool:
    from engine.platform import load_native

    return load_native()


def _operands(n: int, ctx: int, heads: int, d_qk: int, d_v: int, seed: int):
    """bf16 q [n, H, Dqk], k [ctx, H, Dqk] and v [ctx, H, Dv], v a strided view (as MLA's is)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d_qk, generator=gen).bfloat16()
    k = torch.randn(ctx, heads, d_qk, generator=gen).bfloat16()
    kv = torch.randn(ctx, heads, 24 + d_v, generator=gen).bfloat16()
    return q, k, kv[..., 24:]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Float64 causal attention, queries at the context's last n positions."""
    n, ctx = q.shape[0], k.shape[0]
    s = torch.einsum("ihd,jhd->hij", q.double(), k.double()) * scale
    visible = torch.arange(ctx)[None, :] <= (ctx - n + torch.arange(n))[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("hij,jhd->ihd", p, v.double())


@pytest.mark.parametrize(
    ("n", "ctx", "heads", "d_qk", "d_v"),
    [
        (1, 1, 1, 16, 16),  # one query, one key
        (7, 7, 3, 20, 16),  # a head size past whole 8s (the transpose's tail)
        (37, 100, 2, 192, 128),  # V3's head sizes, a prefix of 63 keys
        (300, 300, 8, 128, 64),  # the bench model's, over two chunks of keys
        (5, 600, 1, 128, 64),  # a short chunk after a long prefix: three chunks, one head split
        (70, 513, 4, 72, 32),
    ],
)
def test_extend_attention_matches_float64(loaded, n, ctx, heads, d_qk, d_v):
    """Each output within half a bf16 step of the float64 attention (its rounding), every query
    seeing exactly its own keys."""
    if not loaded:
        assert not native.loaded()
        return
    q, k, v = _operands(n, ctx, heads, d_qk, d_v, seed=n * 1000 + ctx)
    scale = d_qk**-0.5
    got = native.extend_attention(q, k, v, scale)
    want = _reference(q, k, v, scale)
    assert got.shape == (n, heads, d_v) and got.dtype == torch.bfloat16
    err = (got.double() - want).abs()
    assert (err <= want.abs() * 2**-8 + 1e-5).all(), f"max error {err.max().item():.3g}"


def test_a_prompts_rows_are_the_same_in_any_chunking(loaded):
    """A prompt prefilled in one chunk and in three (each chunk's queries over the keys so far)
    gives the same bits for every row: batch_invariant's prefill chunks."""
    if not loaded:
        return
    q, k, v = _operands(300, 300, 3, 128, 64, seed=7)
    whole = native.extend_attention(q, k, v, 0.1)
    parts = [native.extend_attention(q[a:b], k[:b], v[:b], 0.1) for a, b in ((0, 97), (97, 261), (261, 300))]
    assert torch.equal(torch.cat(parts), whole)
    one = native.extend_attention(q[299:], k, v, 0.1)  # the last row alone
    assert torch.equal(one, whole[299:])


def test_the_avx2_builds_own_loops_give_the_emulated_forms_bits(loaded):
    """On the AVX2 build its own loops against the AVX-512 form on avx2.h's emulation
    (use_attend_generic); the AVX-512 builds have the one form, and the two calls agree there
    too."""
    if not loaded:
        return
    for n, ctx, heads, d_qk, d_v in ((37, 100, 2, 192, 128), (300, 300, 8, 128, 64), (3, 260, 5, 20, 16)):
        q, k, v = _operands(n, ctx, heads, d_qk, d_v, seed=ctx)
        own = native.extend_attention(q, k, v, 0.125)
        before = native.use_attend_generic(True)
        try:
            emulated = native.extend_attention(q, k, v, 0.125)
        finally:
            native.use_attend_generic(before)
        assert torch.equal(own, emulated), (n, ctx, heads, d_qk, d_v)


def test_bad_operands_are_refused(loaded):
    if not loaded:
        return
    q, k, v = _operands(8, 8, 2, 32, 16, seed=1)
    with pytest.raises(ValueError, match="ctx \\(k.shape\\[0\\] = 4\\) must be >= n"):
        native.extend_attention(q, k[:4], v[:4], 0.1)
    with pytest.raises(ValueError, match="must be \\[n, H, D\\]"):
        native.extend_attention(q[0], k, v, 0.1)
    with pytest.raises(ValueError, match="k must be"):
        native.extend_attention(q, k[:, :1], v, 0.1)
    with pytest.raises(ValueError, match="Dv a multiple of 16"):
        native.extend_attention(q, k, v[..., :8], 0.1)
    with pytest.raises(ValueError, match="bf16"):
        native.extend_attention(q.float(), k.float(), v.float(), 0.1)


def test_the_prefill_path_takes_it_where_it_can(loaded):
    """kernels/attention.py's CPU path without the LSE: the native kernel for bf16 operands it
    takes, torch's SDPA otherwise (float32, or a Dv not a multiple of 16), the same attention."""
    q, k, v = _operands(40, 90, 2, 48, 32, seed=3)
    o, lse = extend_attention(q, k, v, 0.15, return_lse=False)
    assert lse is None
    if loaded:
        assert torch.equal(o, native.extend_attention(q, k, v, 0.15))
    o32, _ = extend_attention(q.float(), k.float(), v.float(), 0.15, return_lse=False)
    want = _reference(q, k, v, 0.15)
    assert (o32.double() - want).abs().max() < 1e-5
    assert (o.double() - want).abs().max() < 2e-2
