"""DeepSeek-V3.2's sparse attention (kernels/sparse_mla.py): the PyTorch paths against the float64
references, then the Triton paths (under TRITON_INTERPRET=1 on CPU) against both (STYLE 8).

Shapes are odd on purpose: T = 1, 3, 7 query tokens (7 spans two indexer token groups), H = 1, 5,
17 heads (17 spans two head blocks), L+R = 24+8 and 40+16, top-k and slot counts that are no
power of two (K = 45 spans two tiles), block sizes 4 and 16, shuffled block ids. Every cache row
the request does not own holds NaN: no result may change. Top-k is compared tie-aware
(`assert_topk`): with ReLU and few heads exact-zero scores are common, so the chosen set only has
to hold every key scoring clearly above the k-th best and nothing clearly below it.
"""

from __future__ import annotations

import math

import pytest
import torch

from kernels.sparse_mla import (
    indexer_scores,
    indexer_scores_triton,
    indexer_topk,
    indexer_topk_ref,
    indexer_topk_triton,
    positions_to_slots,
    sparse_mla,
    sparse_mla_ref,
    sparse_mla_triton,
)
from tests.kernel_testing import DTYPE_ID, TOL, gen, one_thread  # noqa: F401 (fixture)

NAN = float("nan")
SCORE_TOL = 1e-5
"""Top-k boundary tolerance, relative to a row's largest |score|: float32 against float64."""


def paged_rows(n: int, bs: int, width: int, dtype: torch.dtype, g: torch.Generator, block0: str = "any"):
    """One request's n cache rows in shuffled blocks -> (cache [blocks, bs, width], NaN in every row
    it does not own (two spare blocks, its last block's tail); block_ids [ceil(n / bs)] int64; the
    rows [n, width] in order). block0 "owned" makes cache row 0 the request's first (finite),
    "spare" keeps block 0 out of the request (row 0 NaN), "any" leaves it to the shuffle."""
    used = math.ceil(n / bs)
    perm = torch.randperm(used + 2, generator=g)
    if block0 != "any":
        first, rest = perm[perm == 0], perm[perm != 0]
        perm = torch.cat([first, rest]) if block0 == "owned" else torch.cat([rest, first])
    block_ids = perm[:used]
    rows = torch.randn(n, width, generator=g).to(dtype)
    cache = torch.full((used + 2, bs, width), NAN, dtype=dtype)
    pos = torch.arange(n)
    cache.view(-1, width)[block_ids[pos // bs] * bs + pos % bs] = rows
    return cache, block_ids, rows


# --- top-k: tie-aware comparison -------------------------------------------------------------------


def assert_topk(pos: torch.Tensor, ref: list[list[float]], topk: int, width: int) -> None:
    """pos [T, width] against the float64 scores of each row's visible keys: row t chooses
    min(topk, lens[t]) distinct visible keys first, then -1s; every key scoring above the k-th best
    by more than the tolerance is chosen, and none below it by more."""
    assert pos.dtype == torch.int64 and pos.shape == (len(ref), width)
    for t, scores in enumerate(ref):
        n, row = len(scores), pos[t].tolist()
        k = min(topk, n)
        chosen = row[:k]
        assert row[k:] == [-1] * (width - k), f"row {t}: {row} past its {k} choices"
        assert len(set(chosen)) == k and all(0 <= p < n for p in chosen), f"row {t}: {chosen} of {n} keys"
        if k == n:
            continue  # the whole context: the set is fixed
        tol = SCORE_TOL * max(1.0, max(abs(s) for s in scores))
        kth = sorted(scores, reverse=True)[k - 1]
        must = {s for s in range(n) if scores[s] > kth + tol}
        assert must <= set(chosen), f"row {t}: missed {sorted(must - set(chosen))} (k-th best {kth})"
        worst = min(scores[p] for p in chosen)
        assert worst >= kth - tol, f"row {t}: chose a key scoring {worst} below the k-th best {kth}"


def test_assert_topk_rejects_wrong_choices():
    """The comparison itself can fail: a clearly worse key, a duplicate, a -1 too early."""
    ref = [[0.0, 3.0, 1.0, 0.0, 2.0]]
    assert_topk(torch.tensor([[1, 4]]), ref, 2, 2)
    assert_topk(torch.tensor([[1, 4, 2, 0]]), ref, 4, 4)  # 0 and 3 tie at 0.0: either will do
    assert_topk(torch.tensor([[1, 4, 2, 3]]), ref, 4, 4)
    for wrong in ([[1, 2]], [[1, 1]], [[1, -1]], [[4, 0]]):
        with pytest.raises(AssertionError):
            assert_topk(torch.tensor(wrong), ref, 2, 2)
    with pytest.raises(AssertionError):  # a row that sees everything must choose everything
        assert_topk(torch.tensor([[1, 4, 2, 0, -1]]), ref, 5, 5)


# --- indexer top-k: the PyTorch path ------------------------------------------------------------------

INDEXER_LENS = {  # name -> (lens [T], topk)
    "decode": ([37], 11),
    "prefill": ([39 + i for i in range(7)], 11),  # causal: 7 queries at the end of 45 tokens
    "short-rows": ([0, 3, 9, 11, 12, 20, 29], 11),  # rows that see nothing, fewer, exactly topk
    "within-topk": ([4, 5, 6], 11),  # every row chooses its whole context
}
INDEXER_HEADS = [(1, 24), (5, 40)]  # (nI, dI)


def indexer_case(
    lens: list[int], heads: int, dim: int, bs: int, dtype: torch.dtype, ties: bool, seed: int = 3
):
    """-> (q [T, nI, dI], weights [T, nI] float32 of both signs, key_cache, block_ids, keys [S, dI]
    as the model gathers them (whole blocks: NaN past the last key), lens [T] int64). ties: values
    in {-1, 0, 1} and power-of-two weights, so many scores are exactly equal, not only at zero."""
    g = gen(seed)
    n = max(max(lens), 1)
    key_cache, block_ids, _ = paged_rows(n, bs, dim, dtype, g)
    q = torch.randn(len(lens), heads, dim, generator=g)
    weights = torch.randn(len(lens), heads, generator=g)
    if ties:
        q = q.round().clamp(-1, 1)
        key_cache = key_cache.round().clamp(-1, 1)  # NaN stays NaN
        weights = weights.sign() * 2.0 ** torch.randint(-2, 2, weights.shape, generator=g)
    keys = key_cache[block_ids].reshape(-1, dim)  # [S, dI], S a whole number of blocks
    return q.to(dtype), weights, key_cache, block_ids, keys, torch.tensor(lens)


INDEXER_CASES = [
    pytest.param(
        name, heads, dim, bs, dtype, ties,
        id=f"T{len(INDEXER_LENS[name][0])}-nI{heads}-dI{dim}-bs{bs}-{name}{'-ties' if ties else ''}-{DTYPE_ID[dtype]}",
    )
    for name in INDEXER_LENS
    for heads, dim in INDEXER_HEADS
    for bs in (4, 16)
    for ties in (False, True)
    for dtype in (torch.float32, torch.bfloat16)
    if dtype == torch.float32 or (bs == 16 and not ties)  # the dtype only changes the inputs' rounding
]  # fmt: skip


@pytest.mark.parametrize("name,heads,dim,bs,dtype,ties", INDEXER_CASES)
def test_indexer_topk_torch(name, heads, dim, bs, dtype, ties):
    lens, topk = INDEXER_LENS[name]
    q, weights, _, _, keys, lens_t = indexer_case(lens, heads, dim, bs, dtype, ties)
    scale = dim**-0.5
    ref = indexer_topk_ref(q, weights, keys, lens_t, topk, scale)
    pos = indexer_topk(q, weights, keys, lens_t, topk, scale)
    assert_topk(pos, ref, topk, min(topk, keys.shape[0]))


def indexer_topk_triton_on(q, weights, keys, lens, topk, bs: int = 4, scale: float = 0.25):
    """indexer_topk_triton over contiguous keys [S, dI] laid into a paged cache of block size bs."""
    blocks = math.ceil(keys.shape[0] / bs)
    cache = torch.full((blocks, bs, keys.shape[1]), NAN, dtype=keys.dtype)
    cache.view(-1, keys.shape[1])[: keys.shape[0]] = keys
    return indexer_topk_triton(q, weights, cache, torch.arange(blocks), lens, topk, scale)


def test_indexer_zero_ties():
    """One head with a negative weight: every score is -w * ReLU(.) <= 0, the best ones exactly 0.
    The choice must come from the zeros while they last, then from the least negative."""
    g = gen(11)
    keys = torch.randn(30, 16, generator=g)
    q = torch.randn(2, 1, 16, generator=g)
    weights = torch.tensor([[-1.0], [-0.5]])
    lens = torch.tensor([30, 30])
    ref = indexer_topk_ref(q, weights, keys, lens, 9, 0.25)
    zeros = [sum(s == 0.0 for s in row) for row in ref]
    assert 0 < zeros[0] < 30 and 0 < zeros[1] < 30  # the premise: exact zeros, but not only
    for pos in (
        indexer_topk(q, weights, keys, lens, 9, 0.25),
        indexer_topk_triton_on(q, weights, keys, lens, 9),
    ):
        assert_topk(pos, ref, 9, 9)
        for t in range(2):
            chosen = [ref[t][p] for p in pos[t].tolist()]
            assert chosen.count(0.0) == min(9, zeros[t])


# --- sparse MLA: the PyTorch path -----------------------------------------------------------------


def choose_slots(num_tokens: int, num_slots: int, context: int, block_ids: torch.Tensor, bs: int, g):
    """-> slots [T, K] int64: each token's K distinct rows of the request in random order, some -1
    (anywhere in the row, at least one chosen), the last token with just one."""
    pos = torch.stack([torch.randperm(context, generator=g)[:num_slots] for _ in range(num_tokens)])
    pos[torch.rand(pos.shape, generator=g) < 0.3] = -1
    pos[:, 0] = pos[:, 0].clamp(min=0)  # keep one
    pos[-1, 1:] = -1
    return positions_to_slots(pos, block_ids, bs)


def sparse_case(tokens, heads, lat, rope, num_slots, bs, dtype, block0: str, seed: int = 5):
    """-> (q [T, H, L+R], kv_cache with NaN in every row not the request's, slots [T, K])."""
    g = gen(seed)
    context = max(num_slots, 37)
    kv_cache, block_ids, _ = paged_rows(context, bs, lat + rope, dtype, g, block0=block0)
    q = torch.randn(tokens, heads, lat + rope, generator=g).to(dtype)
    return q, kv_cache, choose_slots(tokens, num_slots, context, block_ids, bs, g)


SPARSE_TORCH_CASES = [
    pytest.param(
        tokens, heads, lat, rope, num_slots, bs,
        id=f"T{tokens}-H{heads}-L{lat}R{rope}-K{num_slots}-bs{bs}",
    )
    for tokens in (1, 3, 7)
    for heads in (1, 5)
    for lat, rope in ((24, 8), (40, 16))
    for num_slots, bs in ((5, 4), (13, 16), (45, 4))
]  # fmt: skip


@pytest.mark.parametrize("tokens,heads,lat,rope,num_slots,bs", SPARSE_TORCH_CASES)
def test_sparse_mla_torch(tokens, heads, lat, rope, num_slots, bs):
    # Cache row 0 (where a -1 slot's index would point) NaN and owned by no query.
    q, kv_cache, slots = sparse_case(tokens, heads, lat, rope, num_slots, bs, torch.float32, block0="spare")
    scale = (lat + rope) ** -0.5
    out = sparse_mla(q, kv_cache, slots, scale, lat)
    assert out.shape == (tokens, heads, lat) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), sparse_mla_ref(q, kv_cache, slots, scale, lat), **TOL[torch.float32]
    )


def test_sparse_mla_torch_within_context_is_dense():
    """A query that chooses its whole context (in any order, -1s between) gets dense attention."""
    g = gen(23)
    kv_cache, block_ids, rows = paged_rows(9, 4, 32, torch.float32, g, block0="owned")
    q = torch.randn(1, 3, 32, generator=g)
    pos = torch.tensor([[8, -1, 3, 0, 1, 2, -1, 7, 6, 5, 4]])
    out = sparse_mla(q, kv_cache, positions_to_slots(pos, block_ids, 4), 0.2, 24)
    dense = torch.softmax(q[0].double() @ rows.double().T * 0.2, dim=-1) @ rows[:, :24].double()  # [H, L]
    torch.testing.assert_close(out[0].double(), dense, **TOL[torch.float32])


def test_sparse_mla_torch_ignores_row0_for_none_slots():
    """A -1 slot reads nothing: a NaN in cache row 0 (where -1 would gather from) stays out."""
    g = gen(29)
    kv_cache = torch.randn(2, 4, 32, generator=g)
    kv_cache[0, 0] = NAN  # slot 0, chosen by no query
    q = torch.randn(1, 2, 32, generator=g)
    slots = torch.tensor([[5, 6, -1]])
    want = sparse_mla_ref(q, kv_cache, slots, 0.2, 24)
    torch.testing.assert_close(sparse_mla(q, kv_cache, slots, 0.2, 24).double(), want, **TOL[torch.float32])


# --- the Triton paths (interpreter) ------------------------------------------------------------------

TRITON_INDEXER_CASES = [
    pytest.param(name, heads, dim, bs, dtype, ties, id=f"T{len(INDEXER_LENS[name][0])}-nI{heads}-dI{dim}-bs{bs}-{name}"
                 f"{'-ties' if ties else ''}-{DTYPE_ID[dtype]}")
    for name, heads, dim, bs, dtype, ties in [
        ("decode", 5, 40, 4, torch.float32, False),  # 37 keys: two key tiles
        ("prefill", 1, 24, 16, torch.float32, False),  # 7 tokens: two token groups
        ("prefill", 5, 40, 4, torch.bfloat16, False),
        ("short-rows", 5, 40, 16, torch.float32, True),
        ("short-rows", 1, 24, 4, torch.float16, False),
        ("within-topk", 5, 24, 4, torch.float32, False),
    ]
]  # fmt: skip


@pytest.mark.parametrize("name,heads,dim,bs,dtype,ties", TRITON_INDEXER_CASES)
def test_indexer_topk_triton(name, heads, dim, bs, dtype, ties):
    lens, topk = INDEXER_LENS[name]
    q, weights, key_cache, block_ids, keys, lens_t = indexer_case(lens, heads, dim, bs, dtype, ties)
    scale = dim**-0.5
    ref = indexer_topk_ref(q, weights, keys, lens_t, topk, scale)
    pos = indexer_topk_triton(q, weights, key_cache, block_ids, lens_t, topk, scale)
    assert_topk(pos, ref, topk, min(topk, max(lens)))
    want = indexer_topk(q, weights, keys, lens_t, topk, scale)  # the PyTorch path, same choices
    assert_topk(want, ref, topk, want.shape[1])
    if max(lens) > topk:  # the kernel ran: its scores are the PyTorch path's
        got = indexer_scores_triton(
            q, weights, key_cache, block_ids.int(), lens_t.int(), scale, max(lens)
        )  # [T, S]
        expect = indexer_scores(q, weights, keys[: max(lens)], scale)
        expect.masked_fill_(torch.arange(max(lens))[None, :] >= lens_t[:, None], float("-inf"))
        torch.testing.assert_close(got, expect, **TOL[torch.float32])


TRITON_SPARSE_CASES = [
    pytest.param(tokens, heads, lat, rope, num_slots, bs, dtype,
                 id=f"T{tokens}-H{heads}-L{lat}R{rope}-K{num_slots}-bs{bs}-{DTYPE_ID[dtype]}")
    for tokens, heads, lat, rope, num_slots, bs, dtype in [
        (1, 1, 24, 8, 5, 4, torch.float32),
        (3, 5, 40, 16, 13, 16, torch.float32),
        (7, 5, 24, 8, 45, 4, torch.float32),  # K = 45: the online softmax crosses tiles
        (3, 17, 40, 16, 45, 16, torch.float32),  # H = 17: two head blocks
        (3, 5, 40, 16, 13, 4, torch.float16),
        (3, 17, 24, 8, 45, 16, torch.bfloat16),
    ]
]  # fmt: skip


@pytest.mark.parametrize("tokens,heads,lat,rope,num_slots,bs,dtype", TRITON_SPARSE_CASES)
def test_sparse_mla_triton(tokens, heads, lat, rope, num_slots, bs, dtype):
    q, kv_cache, slots = sparse_case(tokens, heads, lat, rope, num_slots, bs, dtype, block0="spare")
    assert kv_cache[0].isnan().all() and (slots == -1).any()  # -1 slots must not read row 0 (NaN)
    scale = (lat + rope) ** -0.5
    out = sparse_mla_triton(q, kv_cache, slots, scale, lat)
    assert out.shape == (tokens, heads, lat) and out.dtype == dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), sparse_mla_ref(q, kv_cache, slots, scale, lat), **TOL[dtype])
    want = sparse_mla(q, kv_cache, slots, scale, lat)
    torch.testing.assert_close(out.double(), want.double(), **TOL[dtype])


def test_sparse_mla_triton_edges():
    """A query with no slot gets zeros; T = 0 launches nothing; a query over its whole context in
    any order is dense attention."""
    g = gen(31)
    kv_cache, block_ids, rows = paged_rows(9, 4, 32, torch.float32, g, block0="spare")
    q = torch.randn(2, 3, 32, generator=g)
    pos = torch.tensor([[8, -1, 3, 0, 1, 2, -1, 7, 6, 5, 4], [-1] * 11])
    out = sparse_mla_triton(q, kv_cache, positions_to_slots(pos, block_ids, 4), 0.2, 24)
    dense = torch.softmax(q[0].double() @ rows.double().T * 0.2, dim=-1) @ rows[:, :24].double()  # [H, L]
    torch.testing.assert_close(out[0].double(), dense, **TOL[torch.float32])
    assert (out[1] == 0).all()
    assert sparse_mla_triton(q[:0], kv_cache, pos[:0], 0.2, 24).shape == (0, 3, 24)


def test_indexer_topk_triton_edges():
    """No query tokens; a table too short for lens; int32 inputs on the same path as int64."""
    q, weights, key_cache, block_ids, _, lens = indexer_case([20, 21], 5, 40, 4, torch.float32, False)
    empty = indexer_topk_triton(q[:0], weights[:0], key_cache, block_ids, lens[:0], 11, 0.1)
    assert empty.shape == (0, 0)
    with pytest.raises(ValueError, match="block_ids"):
        indexer_topk_triton(q, weights, key_cache, block_ids[:4], lens, 11, 0.1)
    a = indexer_topk_triton(q, weights, key_cache, block_ids, lens, 11, 0.1)
    b = indexer_topk_triton(q, weights, key_cache, block_ids.int(), lens.int(), 11, 0.1)
    assert torch.equal(a, b)


def test_checks_name_the_field():
    q, kv_cache, slots = sparse_case(2, 3, 24, 8, 5, 4, torch.float32, block0="spare")
    with pytest.raises(ValueError, match="slots"):
        sparse_mla_triton(q, kv_cache, slots.int(), 0.2, 24)
    with pytest.raises(ValueError, match="kv_cache"):
        sparse_mla_triton(q, kv_cache[..., :-1], slots, 0.2, 24)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        sparse_mla_triton(q, kv_cache, slots, 0.2, 32)
    with pytest.raises(ValueError, match="contiguous"):
        sparse_mla_triton(q.transpose(1, 2).contiguous().transpose(1, 2), kv_cache, slots, 0.2, 24)
    iq, w, key_cache, block_ids, _, lens = indexer_case([20, 21], 5, 40, 4, torch.float32, False)
    with pytest.raises(ValueError, match="weights"):
        indexer_topk_triton(iq, w[:, :4], key_cache, block_ids, lens, 11, 0.1)
    with pytest.raises(ValueError, match="key_cache"):
        indexer_topk_triton(iq, w, key_cache[..., :-1], block_ids, lens, 11, 0.1)
    with pytest.raises(ValueError, match="lens"):
        indexer_topk_triton(iq, w, key_cache, block_ids, lens.float(), 11, 0.1)
    with pytest.raises(ValueError, match="topk"):
        indexer_topk_triton(iq, w, key_cache, block_ids, lens, 0, 0.1)
