"""The kernels' PyTorch paths against independent naive references (STYLE 7-8, DESIGN §4).

Each fast path is held to its reference and both to a naive loop written here -- dense attention
per sequence with a mask built from positions over a contiguous copy of the paged cache, a
per-token per-expert MoE loop, per-token HF-style routing -- or to HF transformers itself, over odd
shapes: non-powers of two, empty, exact multiples of the block size. Naive references run in
float64 on the very values (already rounded to the input dtype) the kernels see.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import kernels.gate as gate_module
import kernels.linear as linear_module
import kernels.moe as moe_module
from engine.config import RopeConfig
from kernels import native
from kernels.attention import extend_attention, merge_attn_states
from kernels.gate import grouped_topk
from kernels.linear import FEW_ROWS, PAD_ONE_ROW_MIN, linear
from kernels.mla import mla_decode
from kernels.moe import fused_moe
from kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref, rope_cos_sin_cache, rope_inv_freq
from tests.bench_testing import REPO, run_benchmark
from tests.kernel_testing import DTYPE_ID, TOL, assert_close, gen, one_thread  # noqa: F401 (fixture)

DTYPES = [torch.float32, torch.bfloat16]  # the references' dtypes (the Triton tests add float16)


# --- dispatch -------------------------------------------------------------------------------------


def _mla_call(impl: str):
    q = torch.randn(1, 1, 2, 6, generator=gen(0))
    cache = torch.randn(2, 4, 6, generator=gen(1))
    return mla_decode(
        q,
        cache,
        torch.tensor([[1, 0]], dtype=torch.int32),
        torch.tensor([5], dtype=torch.int32),
        0.5,
        4,
        impl=impl,
    )[0]


def _extend_call(impl: str):
    q, k, v = (torch.randn(3, 2, 4, generator=gen(i)) for i in range(3))
    return extend_attention(q, k, v, 0.5, impl=impl)[0]


def _moe_call(impl: str):
    x = torch.randn(2, 4, generator=gen(0))
    w13, w2 = torch.randn(3, 6, 4, generator=gen(1)), torch.randn(3, 4, 3, generator=gen(2))
    return fused_moe(x, w13, w2, torch.ones(2, 1), torch.tensor([[0], [2]]), impl=impl)


def _gate_call(impl: str):
    return grouped_topk(torch.randn(2, 8, generator=gen(0)), torch.zeros(8), 2, 1, 2, True, 1.0, impl=impl)[0]


DISPATCHED = {
    "mla_decode": _mla_call,
    "extend_attention": _extend_call,
    "fused_moe": _moe_call,
    "grouped_topk": _gate_call,
}


@pytest.mark.parametrize("op", DISPATCHED)
def test_dispatch(op):
    call = DISPATCHED[op]
    call("triton")  # every op has a kernel (interpreted on CPU); tests/test_triton_*.py check values
    for bad in ("cuda", "Torch", ""):
        with pytest.raises(ValueError, match="impl must be one of"):
            call(bad)
    torch.testing.assert_close(call("auto"), call("torch"), atol=0, rtol=0)  # CPU: auto is torch


# --- MLA decode over the paged latent cache --------------------------------------------------------

LAT, ROPE = 40, 8  # latent width L and rotary width R: L + R = 48, neither a power of two
SEQ_LENS = {  # name -> seq_lens [B] as a function of the block size
    "": lambda bs: [],  # an empty decode batch
    "0": lambda bs: [0],
    "1": lambda bs: [1],
    "17": lambda bs: [17],
    "bs": lambda bs: [bs],
    "0,17,bs": lambda bs: [0, 17, bs],
    "1,2bs,bs+1": lambda bs: [1, 2 * bs, bs + 1],
}
MLA_CASES = [
    pytest.param(
        lens,
        s_q,
        heads,
        bs,
        dtype,
        id=f"B{len(SEQ_LENS[lens](bs))}-S{s_q}-H{heads}-bs{bs}-lens[{lens}]-{DTYPE_ID[dtype]}",
    )
    for lens in SEQ_LENS
    for s_q in (1, 3)
    for heads in (1, 4)
    for bs in (16, 64)
    for dtype in DTYPES
]


def paged_cache(seq_lens: list[int], block_size: int, dtype: torch.dtype, g: torch.Generator):
    """-> (kv_cache [blocks, bs, L+R], block_table [B, max_blocks] int32, per-sequence contiguous rows).
    Blocks are handed out in shuffled order; spare blocks and table padding point at garbage."""
    width = LAT + ROPE
    per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    kv_cache = torch.randn(num_blocks, block_size, width, generator=g).to(dtype)
    # Padding columns hold arbitrary valid ids (maybe another sequence's blocks): they must be masked.
    table = torch.randint(0, num_blocks, (len(seq_lens), max(per_seq, default=0) + 1), generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    rows, used = [], 0
    for b, (n, nb) in enumerate(zip(seq_lens, per_seq, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        table[b, :nb] = ids
        rows.append(kv_cache[ids].reshape(-1, width)[:n].clone())  # [n, L+R], contiguous copy
    return kv_cache, table.to(torch.int32), rows


def mla_naive(q: torch.Tensor, rows: list[torch.Tensor], seq_lens: list[int], scale: float):
    """Dense attention per sequence and query position: query i of a sequence of length n sits at
    position n - s_q + i and sees keys 0..that position. -> (o [B, s_q, H, L], lse [B, s_q, H]) float64."""
    batch, s_q, heads, _ = q.shape
    o = torch.zeros(batch, s_q, heads, LAT, dtype=torch.float64)
    lse = torch.full((batch, s_q, heads), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for i in range(s_q):
            pos = seq_lens[b] - s_q + i
            if pos < 0:
                continue  # nothing visible: zero output, lse -inf
            kv = rows[b][: pos + 1].double()  # [pos+1, L+R]
            s = q[b, i].double() @ kv.T * scale  # [H, pos+1]
            o[b, i] = torch.softmax(s, dim=-1) @ kv[:, :LAT]
            lse[b, i] = torch.logsumexp(s, dim=-1)
    return o, lse


@pytest.mark.parametrize("lens,s_q,heads,bs,dtype", MLA_CASES)
def test_mla_decode(lens, s_q, heads, bs, dtype):
    g = gen(7)
    seq_lens = SEQ_LENS[lens](bs)
    kv_cache, table, rows = paged_cache(seq_lens, bs, dtype, g)
    q = torch.randn(len(seq_lens), s_q, heads, LAT + ROPE, generator=g).to(dtype)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    scale = (LAT + ROPE) ** -0.5
    o_want, lse_want = mla_naive(q, rows, seq_lens, scale)

    o_ref, lse = mla_decode(q, kv_cache, table, lens_t, scale, LAT, impl="torch", return_lse=True)
    o_fast, no_lse = mla_decode(q, kv_cache, table, lens_t, scale, LAT, impl="torch", return_lse=False)
    assert no_lse is None
    assert o_ref.shape == o_fast.shape == (len(seq_lens), s_q, heads, LAT)
    assert o_ref.dtype == o_fast.dtype == dtype and lse.dtype == torch.float32
    assert_close(o_ref, o_want, dtype)
    assert_close(o_fast, o_want, dtype)
    assert_close(lse, lse_want, dtype)  # -inf exactly where nothing is visible
    for o in (o_ref, o_fast):
        assert torch.isfinite(o).all()
        assert (o[lse_want == -math.inf] == 0).all()  # empty sequences and invisible queries give zeros


def test_mla_decode_ignores_garbage_beyond_seq_len():
    """Stale rows past seq_len in a sequence's last block, spare blocks and the table's padding
    columns must not leak into the output."""
    g = gen(3)
    seq_lens, bs = [5, 17], 16
    kv_cache, table, rows = paged_cache(seq_lens, bs, torch.float32, g)
    q = torch.randn(2, 1, 4, LAT + ROPE, generator=g)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    before = [mla_decode(q, kv_cache, table, lens_t, 0.3, LAT, return_lse=r)[0] for r in (True, False)]
    owned = {
        (int(table[b, j]), s)
        for b, n in enumerate(seq_lens)
        for j in range(math.ceil(n / bs))
        for s in range(bs)
        if j * bs + s < n
    }
    for blk in range(kv_cache.shape[0]):
        for s in range(bs):
            if (blk, s) not in owned:
                kv_cache[blk, s] = 1e4  # huge: any leak dominates the softmax
    after = [mla_decode(q, kv_cache, table, lens_t, 0.3, LAT, return_lse=r)[0] for r in (True, False)]
    for b, a in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# --- extend (prefill) attention and merging partial results ------------------------------------------

D_QK, D_V = 24, 20  # MLA's prefill has different query/key and value widths
EXTEND_SHAPES = [(1, 1), (1, 17), (5, 5), (16, 16), (17, 17), (3, 64), (7, 20), (64, 64), (0, 5), (0, 0)]


def extend_naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Query i of n sits at position ctx - n + i and sees keys 0..that position. float64."""
    n, heads, _ = q.shape
    ctx = k.shape[0]
    o = torch.zeros(n, heads, v.shape[-1], dtype=torch.float64)
    lse = torch.zeros(n, heads, dtype=torch.float64)
    for h in range(heads):
        for i in range(n):
            visible = ctx - n + i + 1
            s = k[:visible, h].double() @ q[i, h].double() * scale  # [visible]
            o[i, h] = torch.softmax(s, dim=0) @ v[:visible, h].double()
            lse[i, h] = torch.logsumexp(s, dim=0)
    return o, lse


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("heads", [1, 4], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("n,ctx", EXTEND_SHAPES, ids=[f"N{n}-C{c}" for n, c in EXTEND_SHAPES])
def test_extend_attention(n, ctx, heads, dtype):
    g = gen(11)
    q = torch.randn(n, heads, D_QK, generator=g).to(dtype)
    k = torch.randn(ctx, heads, D_QK, generator=g).to(dtype)
    v = torch.randn(ctx, heads, D_V, generator=g).to(dtype)
    scale = D_QK**-0.5
    o_want, lse_want = extend_naive(q, k, v, scale)
    o_ref, lse = extend_attention(q, k, v, scale, impl="torch", return_lse=True)
    o_fast, no_lse = extend_attention(q, k, v, scale, impl="torch", return_lse=False)
    assert no_lse is None
    assert o_ref.shape == o_fast.shape == (n, heads, D_V) and lse.shape == (n, heads)
    assert o_ref.dtype == o_fast.dtype == dtype and lse.dtype == torch.float32
    assert_close(o_ref, o_want, dtype)
    assert_close(o_fast, o_want, dtype)
    assert_close(lse, lse_want, dtype)


def attend_subset(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
    """Unmasked attention of every query over the given keys -> (o in dtype, lse float32); an empty
    key set gives (0, -inf), as a kernel's partial result does."""
    s = torch.einsum("ihd,jhd->ihj", q.double(), k.double())  # [n, H, keys]
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("ihj,jhd->ihd", torch.exp(s - lse[..., None]).nan_to_num(0.0), v.double())
    return o.to(dtype), lse.float()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("split", [0, 1, 4, 11], ids=lambda m: f"split{m}")
def test_merge_attn_states(split, dtype):
    g = gen(5)
    q = torch.randn(3, 4, 8, generator=g).to(dtype)
    k = torch.randn(11, 4, 8, generator=g).to(dtype)
    v = torch.randn(11, 4, 12, generator=g).to(dtype)
    o_want, lse_want = attend_subset(q, k, v, torch.float64)
    part1 = attend_subset(q, k[:split], v[:split], dtype)
    part2 = attend_subset(q, k[split:], v[split:], dtype)
    for o1, lse1, o2, lse2 in (part1 + part2, part2 + part1):  # order does not matter
        o, lse = merge_attn_states(o1, lse1, o2, lse2)
        assert o.dtype == dtype
        assert_close(o, o_want, dtype)
        assert_close(lse, lse_want, torch.float32)


def test_merge_attn_states_both_empty_gives_zeros():
    o1 = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    lse1 = torch.full((2, 3), -math.inf)
    o, lse = merge_attn_states(o1, lse1, o1.clone(), lse1.clone())
    assert (o == 0).all() and not o.isnan().any()
    assert (lse == -math.inf).all()


# --- fused MoE -------------------------------------------------------------------------------------

EXPERTS, TOPK, HIDDEN, INTER = 7, 2, 24, 20


def draw_distinct(tokens: int, n: int, g: torch.Generator) -> torch.Tensor:
    """-> [T, K] int64: TOPK distinct values in range(n) per token."""
    return torch.rand(tokens, n, generator=g).argsort(dim=-1)[:, :TOPK]


def routing(name: str, tokens: int, g: torch.Generator) -> torch.Tensor:
    """-> topk_ids [T, K] int64 for a named load pattern over EXPERTS experts."""
    t = torch.arange(tokens)[:, None]
    balanced = (TOPK * t + torch.arange(TOPK)[None, :]) % EXPERTS  # round robin: loads differ by <= 1
    if name == "balanced":
        return balanced
    if name == "minus1-token":  # token 0 is routed entirely off-rank
        ids = balanced.clone()
        ids[:1] = -1
        return ids
    if name == "minus1-scattered":  # some pairs off-rank, every expert still loaded
        ids = balanced.clone()
        ids[::3, 1] = -1
        return ids
    if name == "all-minus1":
        return torch.full((tokens, TOPK), -1, dtype=torch.long)
    if name == "skewed":  # every expert has tokens once T >= 6, but expert 0 takes all of them
        return torch.cat((torch.zeros_like(t), 1 + t % (EXPERTS - 1)), dim=1)
    if name == "sparse":  # experts 0, 2, 3, 5 get nothing
        choices = torch.tensor([1, 4, 6])
        return choices[draw_distinct(tokens, len(choices), g)]
    if name == "random":
        return draw_distinct(tokens, EXPERTS, g)
    raise AssertionError(name)


# --- linear ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out_features", [24, PAD_ONE_ROW_MIN // 64], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("rows", [0, 1, 2, 3, FEW_ROWS - 1, FEW_ROWS, 40], ids=lambda m: f"M{m}")
def test_linear(rows, out_features, bias, dtype, monkeypatch):
    """Every row count and weight size against float64; on CPU, 2 to FEW_ROWS - 1 rows (and a single
    row through a large weight, padded to two) are taken as w @ x^T, the rest by F.linear; up to
    native.max_rows() bf16 rows by the native kernel where it is loaded (an AVX512F CPU; see
    test_native_kernels for which weights), by torch's path otherwise."""
    g = gen(5)
    in_features = 64
    # A column slice: linear must not assume a contiguous x.
    x = torch.randn(rows, in_features + 3, generator=g)[:, 1 : in_features + 1].to(dtype)
    w = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    expected = x.double() @ w.double().t() + (b.double() if bias else 0)
    f_linear_calls, native_calls = [], []
    real = linear_module.F.linear
    monkeypatch.setattr(linear_module.F, "linear", lambda *a: f_linear_calls.append(1) or real(*a))
    real_native = native.few_rows_linear

    def counted_native(*a):
        y = real_native(*a)
        if y is not None:  # taken natively
            native_calls.append(1)
        return y

    monkeypatch.setattr(native, "few_rows_linear", counted_native)
    few_rows_path = 1 < rows < FEW_ROWS or (rows == 1 and w.numel() >= PAD_ONE_ROW_MIN)
    for fn in (linear_module.linear_torch, linear):
        f_linear_calls.clear()
        native_calls.clear()
        out = fn(x, w, b)
        native_path = (
            fn is linear and dtype == torch.bfloat16 and native.loaded() and 0 < rows <= native.max_rows()
        )
        assert bool(native_calls) == native_path
        assert bool(f_linear_calls) == (not native_path and not few_rows_path)
        assert out.shape == (rows, out_features) and out.dtype == dtype and out.is_contiguous()
        assert_close(out, expected, dtype)


# Whether the padded batched-GEMM path must run (None: depends on the random draw). Skewed
# loads take it while every expert sees fewer than FEW_ROWS tokens (a decode batch on CPU) and
# not beyond; sparse routing (most experts idle) never does.
EXPECT_PADDED = {
    "balanced": lambda T: T >= 5,
    "minus1-token": lambda T: T >= 5,
    "minus1-scattered": lambda T: T >= 5,
    "all-minus1": lambda T: False,
    "skewed": lambda T: T == 5,
    "sparse": lambda T: False,
    "random": lambda T: None,
}


def moe_naive(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """Token by token, expert by expert, in float64."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            gate_up = w13[e].double() @ x[t].double()  # [2I]
            act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
            out[t] += float(topk_weights[t, k]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("route", list(EXPECT_PADDED))
@pytest.mark.parametrize("tokens", [0, 1, 3, 5, 64], ids=lambda t: f"T{t}")
def test_fused_moe(tokens, route, dtype, monkeypatch):
    g = gen(13)
    x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    w13 = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5).to(dtype)
    topk_ids = routing(route, tokens, g)
    topk_weights = torch.rand(tokens, TOPK, generator=g) + 0.1

    padded_calls = []
    real_padded = moe_module._fused_moe_padded

    def counting_padded(*args, **kwargs):
        padded_calls.append(args[3])  # the per-expert counts
        return real_padded(*args, **kwargs)

    monkeypatch.setattr(moe_module, "_fused_moe_padded", counting_padded)
    few_calls = []
    real_few = moe_module._fused_moe_few
    monkeypatch.setattr(moe_module, "_fused_moe_few", lambda *a: few_calls.append(1) or real_few(*a))
    out = fused_moe(x, w13, w2, topk_weights, topk_ids, impl="torch")
    # Decode-sized batches group on the host, and in bf16 up to NATIVE_PAIRS_PER_EXPERT pairs per
    # expert where the native kernels are loaded.
    native_few = (
        dtype == torch.bfloat16
        and native.loaded()
        and 0 < tokens * TOPK <= moe_module.native_pairs_per_expert() * EXPERTS
    )
    assert bool(few_calls) == (0 < tokens * TOPK < EXPERTS or native_few)
    assert out.shape == (tokens, HIDDEN) and out.dtype == dtype
    assert_close(out, moe_naive(x, w13, w2, topk_weights, topk_ids), dtype)
    assert (out[(topk_ids < 0).all(dim=1)] == 0).all()  # tokens routed entirely off-rank get zeros
    expected = False if native_few else EXPECT_PADDED[route](tokens)
    if expected is not None:
        assert bool(padded_calls) == expected, f"padded path calls: {padded_calls}"


def test_fused_moe_padded_matches_loop(monkeypatch):
    """The same pairs through the padded path at once and through the per-expert loop one expert
    at a time (a single loaded expert never takes the padded path) agree to float32 rounding."""
    g = gen(17)
    x = torch.randn(64, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * INTER**-0.5
    ids, weights = routing("minus1-scattered", 64, g), torch.rand(64, TOPK, generator=g)
    calls = []
    real_padded = moe_module._fused_moe_padded
    monkeypatch.setattr(moe_module, "_fused_moe_padded", lambda *a: calls.append(1) or real_padded(*a))
    padded = fused_moe(x, w13, w2, weights, ids)
    assert len(calls) == 1
    loop_out = torch.zeros_like(x)
    for e in range(EXPERTS):
        loop_out += fused_moe(x, w13, w2, weights, torch.where(ids == e, ids, torch.full_like(ids, -1)))
    assert len(calls) == 1
    torch.testing.assert_close(padded, loop_out, **TOL[torch.float32])


# --- grouped top-k routing -----------------------------------------------------------------------

# name -> (E, n_group, topk_group, top_k, scoring, bias kind, norm_topk_prob, routed_scaling_factor)
GATE_CASES = {
    "v3": (16, 4, 2, 4, "sigmoid", "small", True, 2.5),
    "v3-E12-G3": (12, 3, 2, 3, "sigmoid", "small", True, 1.0),
    "v3-negbias": (12, 4, 1, 2, "sigmoid", "negative", True, 2.5),  # every choice score < 0
    "v3-nogroups": (10, 1, 1, 3, "sigmoid", "small", False, 1.5),
    "v3-allgroups": (16, 4, 4, 5, "sigmoid", "zero", True, 2.5),
    "v2-groups": (12, 4, 2, 3, "softmax", None, False, 16.0),
    "v2-greedy": (10, 1, 1, 4, "softmax", None, False, 1.0),
}


def topk_lowest(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk with a tie rule: among equal values the lowest index (torch.topk has none)."""
    idx = torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]
    return values.gather(-1, idx), idx


def hf_route_one(logits: torch.Tensor, bias, n_group, topk_group, top_k, norm, scaling, scoring):
    """One token [1, E] through HF's DeepseekV3TopkRouter (bias given) or DeepseekV2TopkRouter
    (no bias; group_limited_greedy, or greedy when n_group == 1), transcribed, with the engine's
    lowest-index tie rule in place of torch.topk's unspecified one."""
    num_experts = logits.shape[-1]
    logits = logits.float()
    scores = logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1, dtype=torch.float32)
    if bias is not None:
        choice = scores + bias
        group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = topk_lowest(group_scores, topk_group)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
        )
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = topk_lowest(choice, top_k)[1]
        weights = scores.gather(1, ids)
        if norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * scaling, ids
    if n_group == 1:
        weights, ids = topk_lowest(scores, top_k)
    else:
        group_scores = scores.view(-1, n_group, num_experts // n_group).max(dim=-1).values
        group_idx = topk_lowest(group_scores, topk_group)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = (
            group_mask.unsqueeze(-1).expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
        )
        weights, ids = topk_lowest(scores.masked_fill(~score_mask.bool(), 0.0), top_k)
    return weights * scaling, ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor):
    """Sort each row by expert id (top-k order is unspecified)."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("tokens", [0, 1, 7, 30], ids=lambda t: f"T{t}")  # 30: the tensor selection
@pytest.mark.parametrize("case", GATE_CASES)
def test_grouped_topk(case, tokens, ties, dtype):
    num_experts, n_group, topk_group, top_k, scoring, bias_kind, norm, scaling = GATE_CASES[case]
    g = gen(19)
    if ties:  # few distinct logits and biases: many exactly equal scores, group scores and choices
        logits = torch.randint(-2, 3, (tokens, num_experts), generator=g).float() * 0.5
        bias = torch.randint(-1, 2, (num_experts,), generator=g).float() * 0.125
    else:
        logits = torch.randn(tokens, num_experts, generator=g) * 2
        bias = torch.randn(num_experts, generator=g) * 0.1
    bias = {"small": bias, "negative": bias - 2.0, "zero": torch.zeros(num_experts), None: None}[bias_kind]
    logits = logits.to(dtype)

    host = tokens * num_experts <= gate_module.HOST_SELECT_MAX
    assert host == (tokens < 30)  # both selections are covered
    weights, ids = grouped_topk(
        logits, bias, n_group, topk_group, top_k, norm, scaling, scoring=scoring, impl="torch"
    )
    assert weights.shape == ids.shape == (tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    weights, ids = by_expert(weights, ids)
    for t in range(tokens):
        want_w, want_ids = by_expert(
            *hf_route_one(logits[t : t + 1], bias, n_group, topk_group, top_k, norm, scaling, scoring)
        )
        assert ids[t].tolist() == want_ids[0].tolist(), f"token {t}: logits {logits[t].tolist()}"
        torch.testing.assert_close(weights[t], want_w[0], **TOL[torch.float32])
        assert len(set(ids[t].tolist())) == top_k
        if topk_group < n_group:  # chosen experts lie in at most topk_group groups
            assert len({e // (num_experts // n_group) for e in ids[t].tolist()}) <= topk_group


# --- rotary embedding ------------------------------------------------------------------------------

YARN = RopeConfig(
    type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.8
)
ROTARY_SHAPES = [(0, 1, 8), (1, 1, 8), (17, 4, 8), (5, 4, 24), (64, 1, 24)]
ROTARY_IDS = [f"N{n}-H{h}-R{r}" for n, h, r in ROTARY_SHAPES]


def rotary_inputs(tokens: int, heads: int, dim: int, seed: int = 23):
    g = gen(seed)
    cos_all, sin_all = rope_cos_sin_cache(YARN, dim, 300)
    pos = torch.randint(0, 300, (tokens,), generator=g)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, dim, generator=g)
    return q, k, cos_all[pos], sin_all[pos]


def rotate_naive(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x_2i, x_2i+1) rotated as complex numbers, float64, pairs kept in place."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    rot = torch.complex(cos.double(), sin.double()).view(shape)
    return torch.view_as_real(z * rot).flatten(-2)


def qk_dots(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.einsum("nhr,mr->nhm", q.double(), k.double())  # every query against every key


def interleave_to_halves(dim: int) -> torch.Tensor:
    """Index map: ref_layout = interleaved_layout[..., perm] (evens first, then odds)."""
    return torch.cat((torch.arange(0, dim, 2), torch.arange(1, dim, 2)))


@pytest.mark.parametrize("tokens,heads,dim", ROTARY_SHAPES, ids=ROTARY_IDS)
def test_rotary_fast_and_ref_agree_on_qk(tokens, heads, dim):
    q, k, cos, sin = rotary_inputs(tokens, heads, dim)
    q_fast, k_fast = apply_rotary(q, cos, sin, True), apply_rotary(k, cos, sin, True)
    q_ref, k_ref = apply_rotary_ref(q, cos, sin, True), apply_rotary_ref(k, cos, sin, True)
    want = qk_dots(rotate_naive(q, cos, sin), rotate_naive(k, cos, sin))
    assert_close(qk_dots(q_fast, k_fast), want, torch.float32)
    assert_close(qk_dots(q_ref, k_ref), want, torch.float32)
    # Both write OUTPUT_LAYOUT: the naive pairwise rotation, evens first, then odds (the cache
    # stores k_pe so, whichever path wrote it).
    perm = interleave_to_halves(dim)
    assert_close(q_fast, q_ref, torch.float32)
    assert_close(k_fast, rotate_naive(k, cos, sin)[..., perm], torch.float32)


@pytest.mark.parametrize("tokens,heads,dim", ROTARY_SHAPES, ids=ROTARY_IDS)
def test_rotary_layout_does_not_depend_on_strides(tokens, heads, dim):
    """In the model q_pe and k_pe are slices of wider rows (q[..., nope:], kv_a[:, L:]); whether a
    slice's offset or strides are odd must not change the output layout, or q.k breaks."""
    q, k, cos, sin = rotary_inputs(tokens, heads, dim)
    q_wide = torch.cat((torch.randn(tokens, heads, 3, generator=gen(1)), q), dim=-1)  # odd nope width
    k_wide = torch.cat((torch.randn(tokens, 4, generator=gen(2)), k), dim=-1)  # even latent width
    q_pe, k_pe = q_wide[..., 3:], k_wide[:, 4:]
    q_rot, k_rot = apply_rotary(q_pe, cos, sin, True), apply_rotary(k_pe, cos, sin, True)
    # Same layout as the contiguous input (values may differ in the last bit: other vector code).
    assert_close(q_rot, apply_rotary(q, cos, sin, True), torch.float32)
    assert_close(k_rot, apply_rotary(k, cos, sin, True), torch.float32)
    assert_close(
        qk_dots(q_rot, k_rot), qk_dots(rotate_naive(q, cos, sin), rotate_naive(k, cos, sin)), torch.float32
    )


@pytest.mark.parametrize("tokens,heads,dim", ROTARY_SHAPES[1:], ids=ROTARY_IDS[1:])  # HF cannot reshape N=0
def test_rotary_fast_matches_hf_v2_complex(tokens, heads, dim):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import apply_rotary_emb

    q, k, cos, sin = rotary_inputs(tokens, heads, dim)
    freqs_cis = torch.complex(cos, sin)[None]  # [1, N, R/2]
    hf_q, hf_k = apply_rotary_emb(
        q.transpose(0, 1)[None], k[None, None], freqs_cis
    )  # [1, H, N, R], [1, 1, N, R], pairs kept interleaved
    perm = interleave_to_halves(dim)  # our OUTPUT_LAYOUT
    assert_close(apply_rotary(q, cos, sin, True), hf_q[0].transpose(0, 1)[..., perm], torch.float32)
    assert_close(apply_rotary(k, cos, sin, True), hf_k[0, 0][..., perm], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("tokens,heads,dim", ROTARY_SHAPES, ids=ROTARY_IDS)
def test_rotary_ref_matches_hf_v3(tokens, heads, dim, interleaved, dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    q, k, cos, sin = rotary_inputs(tokens, heads, dim)
    q, k = q.to(dtype), k.to(dtype)
    # HF's rotary embedding hands cat(freqs, freqs) cos/sin, already in the activations' dtype.
    cos_hf, sin_hf = (torch.cat((c, c), dim=-1).to(dtype)[None] for c in (cos, sin))  # [1, N, R]
    hf_apply = apply_rotary_pos_emb_interleave if interleaved else apply_rotary_pos_emb
    hf_q, hf_k = hf_apply(q.transpose(0, 1)[None], k[None, None], cos_hf, sin_hf)
    want_q, want_k = hf_q[0].transpose(0, 1), hf_k[0, 0]
    # apply_rotary takes the fast path (its own layout, tested above) only for interleaved float32.
    fast_path = interleaved and dtype == torch.float32
    for fn in (apply_rotary_ref,) if fast_path else (apply_rotary_ref, apply_rotary):
        got_q, got_k = fn(q, cos, sin, interleaved), fn(k, cos, sin, interleaved)
        assert got_q.dtype == dtype
        assert_close(got_q, want_q, dtype)
        assert_close(got_k, want_k, dtype)


# name -> (rope dim, max_position_embeddings, HF rope_parameters besides rope_type and rope_theta)
V3_YARN = dict(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1)
YARN_CASES = {
    "deepseek-v3": (64, 163840, dict(V3_YARN, mscale=1.0, mscale_all_dim=1.0)),
    "v2-lite": (64, 163840, dict(V3_YARN, mscale=0.707, mscale_all_dim=0.707)),
    "tiny": (
        16,
        4096,
        dict(factor=4.0, original_max_position_embeddings=1024, mscale=1.0, mscale_all_dim=1.0),
    ),
    "R24-no-mscale": (24, 4096, dict(factor=8.0, original_max_position_embeddings=512)),
    "R24-mscale-ratio": (
        24,
        2048,
        dict(factor=4.0, original_max_position_embeddings=512, mscale=1.0, mscale_all_dim=0.5),
    ),
    "R40-no-truncate": (
        40,
        8192,
        dict(factor=16.0, original_max_position_embeddings=512, beta_fast=16, beta_slow=2, truncate=False),
    ),
    "R8-attention-factor": (
        8,
        1024,
        dict(factor=2.0, original_max_position_embeddings=512, attention_factor=1.3),
    ),
}
THETA = 10000.0


@pytest.mark.parametrize("case", YARN_CASES)
def test_yarn_matches_hf(case):
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    dim, max_pos, params = YARN_CASES[case]
    hf_params = {"rope_type": "yarn", "rope_theta": THETA, **params}
    config = DeepseekV3Config(
        qk_rope_head_dim=dim, max_position_embeddings=max_pos, rope_parameters=hf_params
    )
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = RopeConfig(
        theta=THETA,
        type="yarn",
        factor=params["factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"],
        beta_fast=params.get("beta_fast", 32.0),
        beta_slow=params.get("beta_slow", 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=params.get("truncate", True),
    )
    inv_freq, factor = rope_inv_freq(rope, dim)
    assert inv_freq.shape == (dim // 2,) and inv_freq.dtype == torch.float32
    torch.testing.assert_close(inv_freq, hf_inv_freq.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(hf_factor, rel=1e-12)

    # The cos/sin cache against HF's rotary module (its cos is cat(freqs, freqs).cos() * factor).
    positions = 2048
    cos, sin = rope_cos_sin_cache(rope, dim, positions)
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(config)(
        torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None]
    )
    assert cos.shape == sin.shape == (positions, dim // 2)
    assert_close(cos, hf_cos[0, :, : dim // 2], torch.float32)
    assert_close(sin, hf_sin[0, :, : dim // 2], torch.float32)


def test_default_rope_inv_freq():
    inv_freq, factor = rope_inv_freq(RopeConfig(theta=10000.0), 24)
    want = 1.0 / 10000.0 ** (torch.arange(0, 24, 2, dtype=torch.float64) / 24)
    assert factor == 1.0
    assert_close(inv_freq, want, torch.float32)


# --- RMSNorm ----------------------------------------------------------------------------------------

NORM_SHAPES = [(0, 40), (1, 40), (17, 40), (3, 5, 64), (2, 128)]
NORM_IDS = ["x".join(map(str, s)) for s in NORM_SHAPES]
EPS = 1e-6


def rms_norm_naive(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float64 statistics, rounded to x's dtype before the weight multiply (HF's order)."""
    xd = x.double()
    normed = (xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return weight.double() * normed.double()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=NORM_IDS)
def test_rms_norm(shape, dtype):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    g = gen(29)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    got, ref = rms_norm(x, weight, EPS), rms_norm_ref(x, weight, EPS)
    assert got.shape == x.shape and got.dtype == dtype
    assert_close(got, rms_norm_naive(x, weight), dtype)
    assert_close(got, ref, dtype)
    hf = DeepseekV3RMSNorm(shape[-1], eps=EPS).to(dtype)
    hf.weight.data.copy_(weight)
    torch.testing.assert_close(ref, hf(x), atol=0, rtol=0)  # the reference is HF's arithmetic exactly


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=NORM_IDS)
def test_fused_add_rms_norm(shape, dtype):
    g = gen(31)
    x = torch.randn(*shape, generator=g).to(dtype)
    residual = (torch.randn(*shape, generator=g) * 4).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    normed, summed = fused_add_rms_norm(x, residual, weight, EPS)
    assert normed.dtype == summed.dtype == dtype
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    assert_close(normed, rms_norm_naive(x + residual, weight), dtype)


@pytest.mark.parametrize("chunk_rows", [1, 2], ids=lambda c: f"chunk{c}")
def test_mla_decode_fast_in_chunks_matches_one_piece(chunk_rows, monkeypatch):
    """Long batches run the fast path in chunks of sequences; the chunking must not change results."""
    import kernels.mla as mla

    g = gen(11)
    seq_lens, bs = [0, 5, 17, 16, 33], 16
    kv_cache, table, rows = paged_cache(seq_lens, bs, torch.float32, g)
    q = torch.randn(len(seq_lens), 2, 4, LAT + ROPE, generator=g)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    whole, _ = mla_decode(q, kv_cache, table, lens_t, 0.1, LAT, impl="torch", return_lse=False)
    row_bytes = max(seq_lens) * (LAT + ROPE) * 4
    monkeypatch.setattr(mla, "FAST_CHUNK_BYTES", chunk_rows * row_bytes)
    chunked, _ = mla_decode(q, kv_cache, table, lens_t, 0.1, LAT, impl="torch", return_lse=False)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)
    want, _ = mla_naive(q, rows, seq_lens, 0.1)
    assert_close(chunked, want, torch.float32)


def test_linear_orientation_benchmark_smoke():
    """benchmarks/linear_orientation.py --smoke as a user runs it: both forms are checked against
    each other and timed for every shape and row count, and nothing is saved."""
    results = REPO / "benchmarks" / "results"
    before = sorted(results.iterdir())
    out = run_benchmark("linear_orientation.py", "--smoke", "--threads", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if " M=" in line]
    assert len(rows) == 4 and all(line.rstrip().endswith("x") for line in rows), out.stdout
    assert sorted(results.iterdir()) == before
