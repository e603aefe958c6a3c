"""The Triton fused MoE (kernels/moe.py) on CPU tensors under the Triton interpreter.

moe_align_block_size is checked exactly on hand-worked routings and by its invariants on random
ones; the grouped-GEMM path is held to the naive per-token float64 loop of test_kernels_torch and
to the PyTorch path, over odd shapes (H=40, I=20, E=6), top-k 1 and 3, experts without tokens and
pairs routed to -1. Grids stay small: the interpreter pays milliseconds per program instance.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe import fused_moe, fused_moe_triton, moe_align_block_size
from tests.kernel_testing import DTYPE_ID, DTYPES, assert_close, one_thread  # noqa: F401 (fixture)
from tests.test_kernels_torch import INTER, gen, moe_naive

HIDDEN = 40  # with moe_naive's INTER = 20: neither a power of two nor a multiple of any block
# float16 rounds inputs, gate_up, activations and the weighted rows to 11 mantissa bits.


# --- moe_align_block_size ----------------------------------------------------------------------------

S = -1  # stands for the sentinel T*K in the expectations below
# name -> (topk_ids [T, K], E, block size, sorted_token_ids up to num_tokens_post_padded,
#          expert_ids of those blocks, full length T*K + E*(bs-1)). Worked by hand.
ALIGN_CASES = {
    # flat ids [2, 0, 2, -1, 0, 3]: expert 1 has nothing, pair 3 is off-rank.
    "T3-K2-E4-bs4-empty-expert-minus1": (
        [[2, 0], [2, -1], [0, 3]],
        4,
        4,
        [1, 4, S, S, 0, 2, S, S, 5, S, S, S],
        [0, 2, 3],
        18,
    ),
    "T3-K2-E4-bs16-empty-expert-minus1": (
        [[2, 0], [2, -1], [0, 3]],
        4,
        16,
        [1, 4] + [S] * 14 + [0, 2] + [S] * 14 + [5] + [S] * 15,
        [0, 2, 3],
        66,
    ),
    # flat [5,1,0, 1,5,-1, 0,1,2, 1,3,5]: expert 1 fills its block exactly, expert 4 is empty.
    "T4-K3-E6-bs4-exact-block": (
        [[5, 1, 0], [1, 5, -1], [0, 1, 2], [1, 3, 5]],
        6,
        4,
        [2, 6, S, S, 1, 3, 7, 9, 8, S, S, S, 10, S, S, S, 0, 4, 11, S],
        [0, 1, 2, 3, 5],
        30,
    ),
    "T8-K1-E2-bs4-no-padding": (
        [[1], [1], [1], [1], [0], [0], [0], [0]],
        2,
        4,
        [4, 5, 6, 7, 0, 1, 2, 3],
        [0, 1],
        14,
    ),
    "T1-K2-E3-bs4-all-minus1": ([[-1, -1]], 3, 4, [], [], 11),
    "T0-K2-E3-bs4": (torch.zeros(0, 2), 3, 4, [], [], 9),
}


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("name", ALIGN_CASES)
def test_moe_align_block_size_examples(name, ids_dtype):
    ids, num_experts, bs, used, used_experts, length = ALIGN_CASES[name]
    topk_ids = torch.as_tensor(ids).to(ids_dtype)
    sentinel = topk_ids.numel()
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, bs, num_experts)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    assert num_post.tolist() == [len(used)]
    want_sorted = [sentinel if p == S else p for p in used] + [sentinel] * (length - len(used))
    assert sorted_ids.tolist() == want_sorted
    num_blocks = -(-length // bs)
    assert expert_ids.tolist() == used_experts + [-1] * (num_blocks - len(used_experts))


def check_alignment(topk_ids, num_experts, bs, sorted_ids, expert_ids, num_post) -> None:
    flat = topk_ids.reshape(-1).tolist()
    sentinel = len(flat)
    counts = [flat.count(e) for e in range(num_experts)]
    used = int(num_post)
    assert used == sum(-(-c // bs) * bs for c in counts)
    length = sentinel + num_experts * (bs - 1)
    assert sorted_ids.shape == (length,) and expert_ids.shape == (-(-length // bs),)
    pairs, experts = sorted_ids.tolist(), expert_ids.tolist()
    assert set(pairs[used:]) <= {sentinel} and set(experts[used // bs :]) <= {-1}
    # Every routed pair exactly once; -1 pairs nowhere.
    assert sorted(p for p in pairs[:used] if p != sentinel) == [p for p, e in enumerate(flat) if e >= 0]
    for b in range(used // bs):
        block = pairs[b * bs : (b + 1) * bs]
        real = [p for p in block if p != sentinel]
        assert real and block[: len(real)] == real, f"block {b}: padding only at a segment's end"
        assert {flat[p] for p in real} == {experts[b]}, f"block {b} mixes experts"
    # Segments in expert order, each exactly as many blocks as its pairs need.
    assert experts[: used // bs] == sorted(experts[: used // bs])
    for e, c in enumerate(counts):
        assert experts.count(e) == -(-c // bs)


ALIGN_RANDOM = [(33, 3, 6, 4), (33, 3, 6, 16), (64, 8, 16, 16), (5, 1, 6, 4), (50, 2, 3, 16), (7, 2, 40, 4)]


@pytest.mark.parametrize(
    "tokens,top_k,num_experts,bs", ALIGN_RANDOM, ids=["T{}-K{}-E{}-bs{}".format(*c) for c in ALIGN_RANDOM]
)
def test_moe_align_block_size_invariants(tokens, top_k, num_experts, bs):
    g = gen(tokens * 100 + bs)
    # Experts drawn from the first two thirds only (the rest get nothing); about 1 pair in 4 off-rank.
    topk_ids = torch.randint(0, max(1, 2 * num_experts // 3), (tokens, top_k), generator=g)
    topk_ids[torch.rand(tokens, top_k, generator=g) < 0.25] = -1
    check_alignment(topk_ids, num_experts, bs, *moe_align_block_size(topk_ids, bs, num_experts))


# --- fused MoE through the Triton grouped GEMM --------------------------------------------------------


def routing(name: str, tokens: int, num_experts: int, top_k: int, g: torch.Generator) -> torch.Tensor:
    """-> topk_ids [T, K] int64, distinct experts per token, for a named load pattern."""
    distinct = torch.rand(tokens, num_experts, generator=g).argsort(dim=-1)[:, :top_k]
    if name == "random":
        return distinct
    if name == "sparse":  # only experts 0, 2 and 5 get tokens
        return torch.tensor([0, 2, 5])[torch.rand(tokens, 3, generator=g).argsort(dim=-1)[:, :top_k]]
    if name == "minus1":  # about a third of the pairs off-rank, token 1 entirely
        ids = distinct.clone()
        ids[torch.rand(tokens, top_k, generator=g) < 0.33] = -1
        ids[1:2] = -1
        return ids
    if name == "all-minus1":
        return torch.full((tokens, top_k), -1, dtype=torch.long)
    raise AssertionError(name)


def moe_inputs(tokens, num_experts, top_k, route, dtype, seed=13, hidden=HIDDEN, inter=INTER):
    g = gen(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    topk_weights = torch.rand(tokens, top_k, generator=g) + 0.1
    return x, w13, w2, topk_weights, routing(route, tokens, num_experts, top_k, g)


MOE_CASES = [
    pytest.param(
        tokens,
        num_experts,
        top_k,
        route,
        dtype,
        id=f"T{tokens}-E{num_experts}-K{top_k}-H{HIDDEN}-I{INTER}-{route}-{DTYPE_ID[dtype]}",
    )
    for dtype in DTYPES
    for tokens in (0, 1, 5, 33)
    for num_experts, top_k in ((6, 3), (6, 1))
    for route in ("random", "sparse", "minus1")
] + [
    pytest.param(5, 6, 3, "all-minus1", dtype, id=f"T5-E6-K3-H{HIDDEN}-I{INTER}-all-minus1-{DTYPE_ID[dtype]}")
    for dtype in DTYPES
]


@pytest.mark.parametrize("tokens,num_experts,top_k,route,dtype", MOE_CASES)
def test_fused_moe_triton(tokens, num_experts, top_k, route, dtype):
    x, w13, w2, topk_weights, topk_ids = moe_inputs(tokens, num_experts, top_k, route, dtype)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, impl="triton")
    assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
    assert_close(out, moe_naive(x, w13, w2, topk_weights, topk_ids), dtype)
    assert_close(out, fused_moe(x, w13, w2, topk_weights, topk_ids, impl="torch"), dtype)
    assert (out[(topk_ids < 0).all(dim=1)] == 0).all()  # tokens routed entirely off-rank get zeros


BLOCKS = [(16, 16, 16), (16, 32, 64), (32, 16, 32)]  # (64, 64, 32), the T > E default, runs above


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
@pytest.mark.parametrize("blocks", BLOCKS, ids=lambda b: "BM{}-BN{}-BK{}".format(*b))
def test_fused_moe_block_sizes(blocks, dtype):
    """Several N tiles and K steps with ragged last ones (2I=40, H=40, I=20 against 16/32-wide blocks)."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(33, 6, 3, "minus1", dtype, seed=3)
    out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, block_sizes=blocks)
    assert_close(out, moe_naive(x, w13, w2, topk_weights, topk_ids), dtype)


def test_fused_moe_exact_block_multiples():
    """H, I and every expert's pair count exact multiples of the blocks: no masked lane anywhere."""
    g = gen(5)
    tokens, num_experts, top_k, hidden, inter = 32, 4, 2, 32, 16
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    topk_ids = (top_k * torch.arange(tokens)[:, None] + torch.arange(top_k)) % num_experts  # 16 pairs each
    topk_weights = torch.rand(tokens, top_k, generator=g)
    _, _, num_post = moe_align_block_size(topk_ids, 16, num_experts)
    assert int(num_post) == tokens * top_k  # no padding
    out = fused_moe_triton(x, w13, w2, topk_weights, topk_ids, block_sizes=(16, 16, 16))
    assert_close(out, fused_moe(x, w13, w2, topk_weights, topk_ids, impl="torch"), torch.float32)


def test_fused_moe_triton_follows_strides():
    """Strided x, weights stored transposed and strided routing tensors give the very same bits."""
    x, w13, w2, topk_weights, topk_ids = moe_inputs(17, 6, 3, "minus1", torch.float32, seed=7)
    want = fused_moe(x, w13, w2, topk_weights, topk_ids, impl="triton")
    x_wide = torch.cat((torch.randn(17, 3), x, torch.randn(17, 2)), dim=1)[:, 3 : 3 + HIDDEN]
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, 2I, H] with stride 1 along 2I
    w2_t = w2.transpose(1, 2).contiguous().transpose(1, 2)
    weights_t, ids_t = topk_weights.T.contiguous().T, topk_ids.T.contiguous().T
    got = fused_moe(x_wide, w13_t, w2_t, weights_t, ids_t, impl="triton")
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("route", ["random", "minus1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_ID.get)
def test_a_long_step_runs_the_torch_path_in_passes(monkeypatch, route, dtype):
    """More tokens than MOE_PASS_TOKENS (a prefill chunk) go through the experts a pass at a time:
    each pass's rows are that pass's own result, bit for bit (the shared expert's too), and the
    whole is the naive reference's."""
    import kernels.moe as moe

    monkeypatch.setattr(moe, "MOE_PASS_TOKENS", 8)
    x, w13, w2, topk_weights, topk_ids = moe_inputs(21, 6, 3, route, dtype)  # two whole passes and a part
    shared = (w13[0], w2[0])
    got = moe.fused_moe_ref(x, w13, w2, topk_weights, topk_ids, shared)
    passes = [
        moe.fused_moe_ref(x[s : s + 8], w13, w2, topk_weights[s : s + 8], topk_ids[s : s + 8], shared)
        for s in (0, 8, 16)
    ]
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, torch.cat(passes))
    assert_close(got, moe_naive(x, w13, w2, topk_weights, topk_ids) + moe.swiglu(x, *shared), dtype)


def test_fused_moe_auto_is_torch_on_cpu():
    x, w13, w2, topk_weights, topk_ids = moe_inputs(5, 6, 3, "random", torch.float32)
    auto = fused_moe(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(
        auto, fused_moe(x, w13, w2, topk_weights, topk_ids, impl="torch"), atol=0, rtol=0
    )


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: {**a, "w2": a["w2"][:, :, :-1]}, "w13"),
        (lambda a: {**a, "w13": a["w13"].to(torch.float16)}, "must share"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:-1]}, "topk_ids"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "integer"),
    ],
    ids=["w2-inter", "w13-dtype", "topk-rows", "float-ids"],
)
def test_fused_moe_triton_rejects_bad_arguments(change, match):
    x, w13, w2, topk_weights, topk_ids = moe_inputs(3, 6, 2, "random", torch.float32)
    args = dict(x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    with pytest.raises(ValueError, match=match):
        fused_moe_triton(**change(args))
