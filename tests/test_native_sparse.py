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


@pytest.mark.parametrize("rows, dim", [(1, 128), (3, 40), (17, 7)], ids=str)
def test_layer_norm_is_within_one_rounding_of_float64(loaded, rows, dim):
    """The indexer keys' LayerNorm (with a bias) in float32: within one bf16 rounding of the float64
    result, and of torch's float32 layer_norm; the engine's LayerNorm takes it for bf16 rows."""
    from engine.models.layers import LayerNorm

    if not loaded:
        return
    gen = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=gen) * 3 + 1).bfloat16()
    weight, bias = (torch.randn(dim, generator=gen).bfloat16() for _ in range(2))
    got = native.layer_norm(x, weight, bias, 1e-6)
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    exact = (xd - mean) / torch.sqrt(
        ((xd - mean) ** 2).mean(-1, keepdim=True) + 1e-6
    ) * weight.double() + bias.double()
    ulp = exact.abs().bfloat16().double() * 2**-7 + 1e-30  # one bf16 rounding, relative
    assert ((got.double() - exact).abs() <= ulp).all()
    torch_ = torch.nn.functional.layer_norm(x.float(), (dim,), weight.float(), bias.float(), 1e-6).bfloat16()
    assert ((got.double() - torch_.double()).abs() <= ulp).all()
    norm = LayerNorm(dim, 1e-6, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight), norm.bias.copy_(bias)
    assert torch.equal(norm(x), got)
    with pytest.raises(ValueError, match=r"weight and bias \[D\]"):
        native.layer_norm(x, weight[:-1], bias, 1e-6)
    with pytest.raises(ValueError, match="CPU bfloat16"):
        native.layer_norm(x.float(), weight, bias, 1e-6)


def test_one_call_with_an_indexer_needs_its_key_cache(loaded):
    """mla_attention and decode_stack refuse a V3.2 layer without its indexer-key cache (or with one
    of another geometry), by name, before anything runs; so does greedy_spec_step, for the layers'
    and for the MTP layer's."""
    from tests.test_native_kernels import _decode_batch, _small_model

    cfg, model = _small_model(False, 1, mtp=1, index_topk=12)
    if not loaded:
        return
    assert all(model.mtp_stack.indexed) and model.mtp_drafter is not None
    layer = model.layers[0]
    spec = type(model).kv_cache_spec(
        cfg, num_mtp_layers=1, block_size=4, dtype=torch.bfloat16, fingerprint="t"
    )
    caches = spec.allocate(8, "cpu")
    batch = _decode_batch(1, 1, 4, 8, cfg.vocab_size, torch.Generator().manual_seed(0))
    tables, lens = batch.decodes[0].per_token
    x = torch.randn(1, cfg.hidden_size).bfloat16()
    cos, sin = model.rope_cos[batch.positions], model.rope_sin[batch.positions]
    latents, keys = model.layer_caches(caches)[0]
    args = (x, layer.self_attn.native_weights, cos, sin, latents, batch.slot_mapping, tables, lens)
    for bad in (None, keys[:4], keys.float()):
        with pytest.raises(ValueError, match="needs its key cache"):
            native.mla_attention(*args, key_cache=bad)
    stack_args = (model.native_stack, batch.input_ids, cos, sin, [c for c, _ in model.layer_caches(caches)])
    with pytest.raises(ValueError, match="needs a key cache per layer"):
        native.decode_stack(*stack_args, batch.slot_mapping, tables, lens)
    mtp_latents, mtp_keys = model.mtp_cache(caches)
    spec_args = (
        model.native_stack,
        model.mtp_drafter,
        batch.input_ids,
        batch.positions,
        stack_args[-1],
        mtp_latents,
    )
    spec_args += (batch.slot_mapping, tables, lens, 1, [4], 1)
    key_caches = model.stack_key_caches(caches)
    with pytest.raises(ValueError, match="needs a key cache per layer"):
        native.greedy_spec_step(*spec_args, mtp_key_cache=mtp_keys)
    with pytest.raises(ValueError, match="needs a key cache per layer"):
        native.greedy_spec_step(*spec_args, key_caches=key_caches)
    tokens, accepted, drafts = native.greedy_spec_step(
        *spec_args, key_caches=key_caches, mtp_key_cache=mtp_keys
    )
    assert accepted.tolist() == [0] and drafts.shape == (1, 1) and mtp_keys.abs().sum() > 0
