"""The Triton extend-attention and merge kernels (kernels/attention.py) against the naive float64
references of test_kernels_torch and against their own PyTorch paths.

On CPU these run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before
any kernel is defined), which costs milliseconds per program instance: grids stay small, and block
boundaries are reached by shrinking the blocks rather than growing the inputs.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.attention import extend_attention, extend_attention_triton, merge_attn_states
from tests.kernel_testing import DTYPE_ID, DTYPES, assert_close, one_thread  # noqa: F401 (fixture)
from tests.test_kernels_torch import D_QK, D_V, attend_subset, extend_naive, gen


def extend_inputs(n: int, ctx: int, heads: int, d_qk: int, d_v: int, dtype: torch.dtype, seed: int = 11):
    """-> q [n, H, Dqk], k [ctx, H, Dqk], v [ctx, H, Dv], rounded to dtype."""
    g = gen(seed)
    q = torch.randn(n, heads, d_qk, generator=g).to(dtype)
    k = torch.randn(ctx, heads, d_qk, generator=g).to(dtype)
    v = torch.randn(ctx, heads, d_v, generator=g).to(dtype)
    return q, k, v


# --- extend attention with the default (GPU) block sizes -------------------------------------------

# (n, ctx, H, Dqk, Dv). Default blocks are 64 queries x 64 keys (32 keys when Dqk > 128).
EXTEND_CASES = [
    (0, 0, 3, D_QK, D_V),  # an empty chunk
    (0, 5, 3, D_QK, D_V),  # no new tokens over a cached prefix
    (1, 1, 3, D_QK, D_V),
    (1, 40, 3, D_QK, D_V),  # one new token: decode-like
    (17, 17, 3, D_QK, D_V),  # no prefix: plain causal
    (17, 40, 3, D_QK, D_V),  # cached prefix of 23
    (64, 64, 1, D_QK, D_V),  # exactly one query block and one key block
    (65, 130, 2, D_QK, D_V),  # one query past a block; the context spans three key blocks
    (5, 9, 2, 192, 128),  # DeepSeek's widths: nope 128 + rope 64, v 128
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize(
    "n,ctx,heads,d_qk,d_v", EXTEND_CASES, ids=[f"n{n}-ctx{c}-H{h}-D{a}x{b}" for n, c, h, a, b in EXTEND_CASES]
)
def test_extend_attention_triton(n, ctx, heads, d_qk, d_v, dtype):
    q, k, v = extend_inputs(n, ctx, heads, d_qk, d_v, dtype)
    scale = d_qk**-0.5
    o_want, lse_want = extend_naive(q, k, v, scale)

    o, lse = extend_attention(q, k, v, scale, impl="triton", return_lse=True)
    assert o.shape == (n, heads, d_v) and lse.shape == (n, heads)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert_close(o, o_want, dtype)
    assert_close(lse, lse_want, dtype)

    o_torch, lse_torch = extend_attention(q, k, v, scale, impl="torch", return_lse=True)
    assert_close(o, o_torch, dtype)
    assert_close(lse, lse_torch, dtype)

    o_no_lse, no_lse = extend_attention(q, k, v, scale, impl="triton", return_lse=False)
    assert no_lse is None
    torch.testing.assert_close(o_no_lse, o, atol=0, rtol=0)  # the same kernel, lse dropped


# --- block boundaries, reached with small blocks ---------------------------------------------------

BLOCK_SHAPES = [(16, 16), (17, 33), (33, 50)]  # (n, ctx): exact multiple, one past, ragged
BLOCKS = [(16, 16), (16, 32), (32, 16)]  # (BLOCK_M, BLOCK_N): the diagonal need not align


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("block_m,block_n", BLOCKS, ids=[f"bm{m}-bn{n}" for m, n in BLOCKS])
@pytest.mark.parametrize(
    "n,ctx", BLOCK_SHAPES, ids=[f"n{n}-ctx{c}-H2-D{D_QK}x{D_V}" for n, c in BLOCK_SHAPES]
)
def test_extend_attention_block_boundaries(n, ctx, block_m, block_n, dtype):
    q, k, v = extend_inputs(n, ctx, 2, D_QK, D_V, dtype, seed=13)
    scale = D_QK**-0.5
    o_want, lse_want = extend_naive(q, k, v, scale)
    o, lse = extend_attention_triton(q, k, v, scale, block_m=block_m, block_n=block_n)
    assert_close(o, o_want, dtype)
    assert_close(lse, lse_want, dtype)


def test_extend_attention_any_strides():
    """The model hands v as a slice of the up-projection [ctx, H, nope + v]; k and q may be views
    too. Strides are arguments: results match the contiguous inputs bit for bit."""
    n, ctx, heads, nope = 17, 40, 3, 16
    q, k, v = extend_inputs(n, ctx, heads, D_QK, D_V, torch.bfloat16, seed=17)
    kv = torch.cat((torch.randn(ctx, heads, nope, generator=gen(1)).to(torch.bfloat16), v), dim=-1)
    v_view = kv[..., nope:]  # [ctx, H, Dv], row stride H * (nope + Dv)
    k_view = k.transpose(0, 1).contiguous().transpose(0, 1)  # [ctx, H, Dqk], heads outermost
    q_view = torch.cat((torch.zeros(n, heads, 3, dtype=torch.bfloat16), q), dim=-1)[..., 3:]  # odd offset
    assert not (v_view.is_contiguous() or k_view.is_contiguous() or q_view.is_contiguous())

    scale = D_QK**-0.5
    o, lse = extend_attention(q, k, v, scale, impl="triton")
    o_view, lse_view = extend_attention(q_view, k_view, v_view, scale, impl="triton")
    torch.testing.assert_close(o_view, o, atol=0, rtol=0)
    torch.testing.assert_close(lse_view, lse, atol=0, rtol=0)
    o_want, _ = extend_naive(q, k, v, scale)
    assert_close(o_view, o_want, torch.bfloat16)


def test_extend_attention_dispatch_and_checks():
    q, k, v = extend_inputs(3, 5, 2, D_QK, D_V, torch.float32)
    auto, _ = extend_attention(q, k, v, 0.5, impl="auto")
    torch.testing.assert_close(auto, extend_attention(q, k, v, 0.5, impl="torch")[0], atol=0, rtol=0)
    with pytest.raises(ValueError, match="impl must be one of"):
        extend_attention(q, k, v, 0.5, impl="cuda")
    with pytest.raises(ValueError, match="must be >= n"):
        extend_attention(q, k[:2], v[:2], 0.5, impl="triton")
    with pytest.raises(ValueError, match="k must be"):
        extend_attention(q, k[:, :1], v, 0.5, impl="triton")
    with pytest.raises(ValueError, match="v must be"):
        extend_attention(q, k, v[:4], 0.5, impl="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        extend_attention(q, k, v.double(), 0.5, impl="triton")


# --- merging partial results -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("split", [0, 1, 4, 11], ids=lambda m: f"split{m}")  # 0 and 11: one side empty
def test_merge_attn_states_triton(split, dtype):
    g = gen(5)
    q = torch.randn(5, 3, 8, generator=g).to(dtype)
    k = torch.randn(11, 3, 8, generator=g).to(dtype)
    v = torch.randn(11, 3, D_V, generator=g).to(dtype)
    o_want, lse_want = attend_subset(q, k, v, torch.float64)
    part1 = attend_subset(q, k[:split], v[:split], dtype)
    part2 = attend_subset(q, k[split:], v[split:], dtype)
    for o1, lse1, o2, lse2 in (part1 + part2, part2 + part1):  # order does not matter
        o, lse = merge_attn_states(o1, lse1, o2, lse2, impl="triton")
        assert o.shape == o1.shape and o.dtype == dtype and lse.dtype == torch.float32
        assert_close(o, o_want, dtype)
        assert_close(lse, lse_want, torch.float32)
        o_torch, lse_torch = merge_attn_states(o1, lse1, o2, lse2, impl="torch")
        assert_close(o, o_torch, dtype)
        assert_close(lse, lse_torch, torch.float32)


def test_merge_attn_states_empty_sides():
    """Rows with one side empty take the other side as is; rows with both empty give 0 and -inf.
    An empty side's o is ignored whatever it holds (here: finite garbage), and nothing is NaN."""
    g = gen(7)
    o1 = torch.randn(4, 3, D_V, generator=g).to(torch.bfloat16)
    o2 = torch.randn(4, 3, D_V, generator=g).to(torch.bfloat16)
    lse1, lse2 = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    lse1[0], lse2[0] = -math.inf, -math.inf  # row 0: both sides empty
    lse1[1, 0] = -math.inf  # row 1 head 0: only side 2 has keys
    lse2[2, 2] = -math.inf  # row 2 head 2: only side 1 has keys

    o, lse = merge_attn_states(o1, lse1, o2, lse2, impl="triton")
    assert not o.isnan().any() and not lse.isnan().any()
    assert (o[0] == 0).all() and (lse[0] == -math.inf).all()
    torch.testing.assert_close(o[1, 0], o2[1, 0], atol=0, rtol=0)
    torch.testing.assert_close(o[2, 2], o1[2, 2], atol=0, rtol=0)
    assert lse[1, 0] == lse2[1, 0] and lse[2, 2] == lse1[2, 2]
    o_torch, lse_torch = merge_attn_states(o1, lse1, o2, lse2, impl="torch")
    assert_close(o, o_torch, torch.bfloat16)
    assert_close(lse, lse_torch, torch.float32)


MERGE_SHAPES = [(7, D_V), (2, 3, 4, 12), (0, 4, 12)]  # [T, D]; [B, s_q, H, L] as split-K decode; empty


@pytest.mark.parametrize("shape", MERGE_SHAPES, ids=["x".join(map(str, s)) for s in MERGE_SHAPES])
def test_merge_attn_states_shapes_and_strides(shape):
    g = gen(9)
    wide = torch.randn(*shape[:-1], shape[-1] + 5, generator=g)
    o1 = wide[..., 5:]  # a strided view
    o2 = torch.randn(shape, generator=g)
    lse1, lse2 = torch.randn(shape[:-1], generator=g), torch.randn(shape[:-1], generator=g)
    o, lse = merge_attn_states(o1, lse1, o2, lse2, impl="triton")
    o_torch, lse_torch = merge_attn_states(o1, lse1, o2, lse2, impl="torch")
    assert o.shape == o1.shape and lse.shape == lse1.shape
    assert_close(o, o_torch, torch.float32)
    assert_close(lse, lse_torch, torch.float32)
