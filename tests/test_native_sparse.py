"""DeepSeek-V3.2's native CPU kernels (kernels/native/sparse.h): the indexer's top-k over a paged
key cache and MLA decode over the chosen slots, against float64 naive references
(kernels/sparse_mla.py) over odd shapes, shuffled block tables, NaN in every cache row no token
may read, -1 slots, and contexts within and beyond topk."""

from __future__ import annotations

import pytest
import torch

from kernels import native
from kernels.sparse_mla import indexer_topk_ref, sparse_mla_ref


@pytest.fixture(scope="module")
def loaded() -> bool:
    from engine.platform import load_native

    return load_native()


def _paged(num_blocks: int, block_size: int, width: int, lens: list[int], gen: torch.Generator):
    """A bf16 cache of NaN with one shuffled block table per token: token t's first lens[t] rows
    random, every other row NaN."""
    cache = torch.full((num_blocks, block_size, width), float("nan"), dtype=torch.bfloat16)
    blocks_per = -(-max(lens) // block_size)
    table = torch.randperm(num_blocks, generator=gen)[:blocks_per].to(torch.int32)
    for j in range(max(lens)):
        cache[table[j // block_size], j % block_size] = torch.randn(width, generator=gen).bfloat16()
    tables = table[None].expand(len(lens), -1).contiguous()
    return cache, tables


def _slot_rows(cache: torch.Tensor, table: torch.Tensor, n: int) -> torch.Tensor:
    bs = cache.shape[1]
    return torch.stack([cache[table[j // bs], j % bs] for j in range(n)])


@pytest.mark.parametrize(
    ("heads", "dim", "block_size", "lens", "topk"),
    [
        (16, 64, 16, [1, 20, 37, 38, 300], 37),
        (5, 48, 4, [7, 90, 91], 11),  # a 48-wide key: a 32-element step and a tail
        (20, 32, 16, [200, 3, 64], 64),  # more than 16 heads: two groups
    ],
)
def test_indexer_topk_chooses_the_best_keys(loaded, heads, dim, block_size, lens, topk):
    """The chosen slots are the keys whose float64 scores are best (tie-aware: a key scoring
    within 1e-4 of the k-th best may or may not be chosen); a token seeing at most topk keys
    chooses every one, then -1; NaN rows outside the tokens' contexts change nothing."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(heads * 1000 + dim)
    cache, tables = _paged(40 if block_size == 16 else 100, block_size, dim, lens, gen)
    q = torch.randn(len(lens), heads, dim, generator=gen).bfloat16()
    w = torch.randn(len(lens), heads, generator=gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    scale = dim**-0.5
    got = native.indexer_topk(q, w, cache, tables, lens_t, topk, scale)
    assert got.shape == (len(lens), topk) and got.dtype == torch.long
    keys = _slot_rows(cache, tables[0], max(lens))
    ref = indexer_topk_ref(q, w, keys, lens_t, topk, scale)
    bs = block_size
    slot_of = {int(tables[0, j // bs]) * bs + j % bs: j for j in range(max(lens))}
    for t, n in enumerate(lens):
        chosen = [int(s) for s in got[t] if int(s) >= 0]
        assert all(int(s) == -1 for s in got[t, len(chosen) :]), "-1 only after the chosen slots"
        positions = sorted(slot_of[s] for s in chosen)
        if n <= topk:
            assert positions == list(range(n)), f"token {t}: a context within topk is chosen whole"
            continue
        assert len(set(positions)) == topk, f"token {t}: {len(set(positions))} distinct keys, want {topk}"
        scores = torch.tensor(ref[t], dtype=torch.float64)
        kth = scores.topk(topk).values[-1].item()
        must = set((scores > kth + 1e-4).nonzero().flatten().tolist())
        may = set((scores >= kth - 1e-4).nonzero().flatten().tolist())
        assert must <= set(positions) <= may, (
            f"token {t}: chose {sorted(set(positions) - may)} outside the best"
        )


def test_sparse_mla_decode_attends_over_the_chosen_rows(loaded):
    """Against the float64 reference within bf16 roundings, at odd widths and head counts, rows
    chosen in any order and with -1 among them; NaN rows never chosen change nothing; a token
    with no row gets zeros."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(5)
    heads, L, R, bs, nb = 11, 72, 24, 16, 30
    cache = torch.full((nb, bs, L + R), float("nan"), dtype=torch.bfloat16)
    live = torch.randperm(nb * bs, generator=gen)[:200]
    cache.view(-1, L + R)[live] = torch.randn(200, L + R, generator=gen).bfloat16()
    T, K = 6, 45
    slots = live[torch.randint(0, 200, (T, K), generator=gen)]
    slots[1, ::3] = -1
    slots[2] = -1  # no row at all
    slots[3, :40] = -1
    q = (torch.randn(T, heads, L + R, generator=gen) * 0.3).bfloat16()
    got = native.sparse_mla_decode(q, cache, slots, 0.125, L)
    assert got.shape == (T, heads, L) and got.dtype == torch.bfloat16
    assert not got.isnan().any()
    assert (got[2] == 0).all()
    rows = [t for t in range(T) if t != 2]
    want = sparse_mla_ref(q[rows], cache, slots[rows], 0.125, L)
    torch.testing.assert_close(got[rows].double(), want, atol=3e-2, rtol=3e-2)


def test_bad_operands_are_refused_by_name(loaded):
    if not loaded:
        assert not native.loaded()
        return
    cache = torch.zeros(4, 16, 80, dtype=torch.bfloat16)
    q = torch.zeros(2, 3, 80, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="outside the cache's 64 slots"):
        native.sparse_mla_decode(q, cache, torch.tensor([[0, 64], [1, -1]]), 0.1, 64)
    with pytest.raises(ValueError, match="slots must be int64"):
        native.sparse_mla_decode(q, cache, torch.zeros(2, 4, dtype=torch.int32), 0.1, 64)
    keys = torch.zeros(4, 16, 32, dtype=torch.bfloat16)
    qi, w = torch.zeros(2, 4, 32, dtype=torch.bfloat16), torch.zeros(2, 4)
    table = torch.tensor([[0, 9], [0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="1 block ids outside"):
        native.indexer_topk(qi, w, keys, table, torch.tensor([20, 20], dtype=torch.int32), 8, 0.1)
    with pytest.raises(ValueError, match="weights \\[T, nI\\] float32"):
        native.indexer_topk(qi, w.bfloat16(), keys, table, torch.tensor([2, 2], dtype=torch.int32), 8, 0.1)
