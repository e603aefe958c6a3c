"""kernels/native: the few-row products (on the AMX tile unit and with VDPBF16PS) against float32
sums rounded to bf16, the MoE, MLA decode, RMSNorm and rotary kernels against the torch path, and
the torch path everywhere they cannot run."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from engine import env
from kernels import linear as linear_mod
from kernels import native
from tests.engine_testing import mla_caches

SHAPES = [  # (B, M, N, K): odd sizes, exact tile multiples, the K tail under one 32-lane step
    (1, 1, 1, 1),
    (1, 1, 37, 100),
    (1, 2, 17, 33),
    (1, 3, 16, 64),
    (1, 4, 64, 512),
    (1, 5, 33, 31),
    (1, 9, 65, 96),
    (1, 1, 512, 512),
    (8, 1, 512, 64),  # attention's absorbed products, one query token: per head
    (3, 2, 19, 40),
    (1, 40, 70, 64),  # AMX: two passes of rows (the second of 8), 64 columns in steps, 6 after
    (2, 17, 64, 96),  # AMX: both halves of x's rows in one pass, per head
]


@pytest.fixture(scope="module")
def loaded() -> bool:
    from engine.platform import load_native

    return load_native()  # where the engines of the other tests build them


@pytest.fixture(params=["amx", "avx512"])
def products(request, loaded) -> str:
    """The products and the decode attention on the AMX tile paths or with VDPBF16PS. The tile
    paths run on the unit where the CPU has it (and Linux grants its state), on software tiles
    elsewhere (kernels/native/tiles.h): their logic is tested on every CPU. The load-time choice
    is restored after."""
    if not loaded:
        yield request.param
        return
    before, before_emulated = native.uses_amx(), native.amx_emulated()
    if request.param == "amx":
        unit = native.use_amx(True)
        # Only where the CPU has the unit (Linux before 5.16 does not grant its state).
        assert unit <= (native.AMX_FLAGS <= native.cpu_flags())
        assert unit or native.use_amx(True, emulated=True)
        assert native.uses_amx() and native.max_rows() == native.AMX_ROWS
        assert native.amx_emulated() == (not unit)
    else:
        assert not native.use_amx(False) and not native.amx_emulated()
    yield request.param
    native.use_amx(before, emulated=before_emulated)


def _want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sums of the exact products, rounded once to bf16: what VDPBF16PS and torch's bf16
    BLAS compute, up to the order of the float32 additions."""
    return torch.matmul(x.float(), w.float().transpose(-1, -2))


def test_loads_exactly_where_the_cpu_has_the_instructions(loaded):
    assert loaded == native.supported() == native.loaded()
    assert native.supported() == (
        all(f in native.cpu_flags() for f in native.REQUIRED_FLAGS)
        or all(f in native.cpu_flags() for f in native.AVX2_FLAGS)
    )
    # The AVX-512 build where the CPU has it, unless PDSERVE_NATIVE_AVX512=0 asks for the AVX2 one.
    assert native.avx512() == (loaded and native.has_avx512() and env.native_avx512())
    # The products take the AMX tile unit where the CPU has it and Linux (5.16 on) grants its state.
    linux = tuple(int(v) for v in os.uname().release.split(".")[:2])
    if loaded and native.AMX_FLAGS <= native.cpu_flags() and linux >= (5, 16) and env.native_amx():
        assert native.uses_amx() and native.max_rows() == native.AMX_ROWS


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-M{}-N{}-K{}".format(*s))
def test_linear_bf16_equals_float32_sums_rounded(loaded, products, shape):
    if not loaded:  # no AVX512F here: the torch path serves, and the native one refuses
        with pytest.raises(AssertionError, match="load"):
            native.linear_bf16(
                torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16)
            )
        return
    b, m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(b, m, k, generator=gen).bfloat16()
    w = torch.randn(b, n, k, generator=gen).bfloat16()
    if b == 1:
        x, w = x[0], w[0]
    got = native.linear_bf16(x, w)
    want = _want(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    # One bf16 rounding of a float32 sum: within one bf16 ulp of the exact sum, whose own float32
    # error (the order of additions) is bounded by K ulps of float32 of the sum of |terms|.
    bound = torch.matmul(x.float().abs(), w.float().abs().transpose(-1, -2))
    tolerance = want.abs() * 2.0**-8 + bound * k * 2.0**-24
    assert bool(((got.float() - want).abs() <= tolerance).all())


def test_each_row_is_bitwise_the_one_row_product(loaded, products):
    """A row's result does not depend on how many rows share the call: a speculative verification
    (2-3 rows) computes each token exactly as a one-token decode would, and a prefill's rows (where
    every product runs here: native.EMULATED_ROWS) as each alone, over blocks of 256 rows."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(600, 192, generator=gen).bfloat16()  # K = 6 tile steps on AMX; 3 row blocks
    # Three small products in one call; one wide enough to be cut into chunks shared over the
    # threads, each chunk taking every 32-row pass of x (AMX) from one packing.
    for w in (torch.randn(3, 40, 192, generator=gen), torch.randn(1, 2080, 192, generator=gen)):
        w = w.bfloat16()
        heads = w.shape[0]
        together = native.linear_bf16(x.expand(heads, -1, -1), w)
        for i in range(x.shape[0]):
            alone = native.linear_bf16(x[i : i + 1].expand(heads, -1, -1), w)
            assert torch.equal(together[:, i : i + 1], alone)


def test_exp_is_within_two_ulp_of_libm_with_its_edges(loaded):
    """The kernels' 16-lane exp (softmaxes and SiLUs) against float64's exp rounded to float32,
    which libm's expf matches: within 2 ulp over the whole finite range, denormal results
    included; exactly 0 for -inf and below -104, inf above ~88.72, NaN for NaN; any length
    (masked tails)."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(0)
    x = torch.cat(
        (
            torch.linspace(-104, 88.7, 200_003),
            torch.randn(10_000, generator=gen) * 4,
            torch.tensor([0.0, -0.0, 1e-30, -1e-30, 0.5 * math.log(2), -0.5 * math.log(2), -87.0, -100.0]),
        )
    )
    got, want = native.exp_f32(x), x.double().exp().float()
    finite = want.isfinite() & (want != 0)
    ulp = (want.abs().nextafter(torch.tensor(float("inf"))) - want.abs())[finite]
    assert float(((got[finite] - want[finite]).abs() / ulp).max()) <= 2.0
    assert torch.equal(got[want == 0], want[want == 0])
    edges = torch.tensor([float("-inf"), -104.5, -1e4, float("inf"), 89.0, 1e4, float("nan")])
    out = native.exp_f32(edges)
    assert out[:3].eq(0).all() and out[3:6].eq(float("inf")).all() and out[6].isnan()
    for n in (1, 15, 17, 33):
        assert torch.equal(native.exp_f32(x[:n]), got[:n])


@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 15), (5, 16), (7, 17), (33, 1000), (4, 32000)], ids=str)
def test_argmax_is_torch_max_with_ties_nans_and_infinities(loaded, rows, vocab):
    """argmax_bf16 answers as torch.max(dim=-1) over the widened logits (what the sampler took):
    the first of equal values, the first NaN before anything, index 0 in a row of -inf."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(rows * vocab)
    cases = [
        torch.randn(rows, vocab, generator=gen),
        torch.randint(-3, 3, (rows, vocab), generator=gen).float(),  # many ties
        torch.full((rows, vocab), float("-inf")),
    ]
    nans = torch.randint(-3, 3, (rows, vocab), generator=gen).float()
    nans[:, vocab // 2] = float("nan")
    nans[:, -1] = float("nan")
    cases.append(nans)
    wide = torch.randn(rows, vocab + 40, generator=gen)  # a padded LM head's columns, cut off: row stride
    for x in [c.bfloat16() for c in cases] + [wide.bfloat16()[:, :vocab]]:
        assert torch.equal(native.argmax_bf16(x), x.float().max(dim=-1).indices)
    with pytest.raises(ValueError, match=r"\[R, V\] CPU bfloat16"):
        native.argmax_bf16(torch.zeros(2, 3))


def test_strided_rows_and_views(loaded):
    """x rows with a row stride (a slice of a wider tensor), and per-head views with a batch
    stride, as MLAttention passes them."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 200, generator=gen).bfloat16()
    x = wide[:, 50:150]  # [3, 100], row stride 200
    w = torch.randn(40, 100, generator=gen).bfloat16()
    assert torch.equal(native.linear_bf16(x, w), native.linear_bf16(x.contiguous(), w))
    q = torch.randn(1, 8, 128, generator=gen).bfloat16()[..., :64]  # [T=1, H, nope] of [T, H, nope+rope]
    heads = torch.randn(8, 64, 512, generator=gen).bfloat16()
    got = native.linear_bf16(q.transpose(0, 1), heads.transpose(1, 2).contiguous())  # [H, 1, 512]
    torch.testing.assert_close(
        got.float(), torch.bmm(q.transpose(0, 1).float(), heads.float()), rtol=2**-7, atol=1e-3
    )


def test_bad_operands_name_the_shape(loaded):
    if not loaded:
        assert not native.loaded()
        return
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="share B and K"):
        native.linear_bf16(x, torch.zeros(4, 9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 with unit stride"):
        native.linear_bf16(x.float(), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="unit stride"):
        native.linear_bf16(x, torch.zeros(8, 4, dtype=torch.bfloat16).t())


def test_kernels_linear_takes_few_bf16_rows_natively(loaded, monkeypatch):
    """Up to max_rows() bf16 rows go native where loaded, through any weight: AMX_ROWS on the tile
    unit, FEW_ROWS through VDPBF16PS, EMULATED_ROWS through its emulation; more rows, float32 and
    strided weights stay on torch."""
    calls = []
    real = native.few_rows_linear

    def counted(x, w):
        y = real(x, w)
        if y is not None:
            calls.append(tuple(x.shape))
        return y

    monkeypatch.setattr(native, "few_rows_linear", counted)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    wide = torch.randn((1 << 20) // (2 * 96) + 1, 96, generator=gen).bfloat16()  # over 1 MB
    top = min(native.max_rows(), 300)  # the emulation's any: past one block of 256 rows will do
    for weight in (w, wide):
        for rows in range(1, top + 2):
            x = torch.randn(rows, 96, generator=gen).bfloat16()
            y = linear_mod.linear(x, weight)
            torch.testing.assert_close(y.float(), F.linear(x.float(), weight.float()), rtol=2**-7, atol=1e-2)
    linear_mod.linear(torch.randn(1, 96), w.float())
    linear_mod.linear(torch.randn(1, 64).bfloat16(), w.t())
    amx = native.uses_amx()
    assert amx <= (loaded and native.AMX_FLAGS <= native.cpu_flags())
    if loaded:
        rows = native.FEW_ROWS if native.bf16_instructions() else native.EMULATED_ROWS
        assert native.max_rows() == (native.AMX_ROWS if amx else rows)
    expected = [(rows, 96) for rows in range(1, top + 2) if rows <= native.max_rows()] * 2
    assert calls == (expected if loaded else [])


def test_the_switch_turns_them_off(monkeypatch, tmp_path):
    from engine.platform import use_native_kernels

    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
    assert not env.native_kernels()
    assert not use_native_kernels(torch.bfloat16, torch.device("cpu"))
    monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "1")
    monkeypatch.setenv("PDSERVE_NATIVE_DIR", str(tmp_path))
    assert env.native_build_dir() == str(tmp_path)
    assert not use_native_kernels(torch.float32, torch.device("cpu"))  # only bf16 models
    assert use_native_kernels(torch.bfloat16, torch.device("cpu")) == native.supported()


def _decode_error(llm, ref) -> float:
    """Largest |engine logprob - float32 reference| over the returned ids of each greedy decode step,
    up to and including the first step where the engine's token differs from the reference's."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=len(ref.greedy_tokens), ignore_eos=True, logprobs=5)
    out = llm.generate(prompt_token_ids=[ref.prompt_ids], sampling_params=params)[0]
    worst = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        worst = max(worst, max(abs(float(lp) - ref.step_logprobs[step, t].item()) for t, lp in entry.items()))
        if token != ref.greedy_tokens[step]:
            break
    return worst


def test_bf16_decode_through_them_is_as_close_to_the_reference_as_torch(loaded, monkeypatch, tmp_path):
    """A bf16 engine decoding one sequence (every product one row, so native where loaded) against
    transformers in float32: its logprob error is no larger than the same engine's on torch's
    products (the bf16 weights and activations are the error, not the kernels)."""
    from engine import LLM
    from tests.hf_reference import VARIANTS, build_hf_checkpoint, hf_reference

    model_dir = build_hf_checkpoint(VARIANTS[0].values[0], tmp_path / "ckpt", seed=0)
    ref = hf_reference(model_dir, [5, 17, 99, 3, 42, 7, 64], steps=8)
    errors = {}
    for side in ("native", "torch"):
        if side == "torch":
            monkeypatch.setattr(native, "_library", None)
            monkeypatch.setenv("PDSERVE_NATIVE_KERNELS", "0")
        llm = LLM(model=str(model_dir), dtype="bfloat16", block_size=4)
        assert llm.engine.runner.native_kernels == (side == "native" and loaded and env.native_kernels())
        errors[side] = _decode_error(llm, ref)
    assert 0 < errors["torch"] < 0.5, errors  # bf16 is off the float32 reference, but not far
    assert errors["native"] <= 1.5 * errors["torch"] + 0.01, errors


@pytest.mark.parametrize(
    "tokens, shared", [(1, False), (3, False), (2, True), (5, True), (12, True)], ids=str
)
def test_moe_pairs_equal_the_torch_loop(loaded, products, monkeypatch, tokens, shared):
    """The routed experts of a few tokens in one native call, an expert seen by several tokens
    (shared) taking them as one product; 12 tokens (24 pairs over 16 experts: past the few-token
    loop, within native_pairs_per_expert()): the torch path's value up to
    the products' float32 summation order (the roundings between are its own)."""
    from kernels.moe import fused_moe_ref

    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 16, 96, 40, 2
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    if shared:  # expert 3 sees every token
        others = torch.randperm(experts - 1, generator=gen)[:tokens] + 4
        ids = torch.stack((torch.full((tokens,), 3), others % experts), dim=1)
    else:  # each expert once
        ids = torch.randperm(experts, generator=gen)[: tokens * top_k].view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=gen)
    calls = []
    if loaded:
        real = native.moe_topk
        monkeypatch.setattr(native, "moe_topk", lambda *a: calls.append(a[4].flatten().tolist()) or real(*a))
    got = fused_moe_ref(x, w13, w2, weights, ids)
    assert calls == ([ids.flatten().tolist()] if loaded else [])
    monkeypatch.setattr(native, "_library", None)
    want = fused_moe_ref(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * float(want.abs().max()))


def test_batch_invariant_moe_gives_each_token_its_own_bits(loaded, monkeypatch):
    """In a batch-invariant step (native.set_batch_invariant) the MoE takes the native kernel
    whatever the number of pairs per expert, so each token's output is bit for bit its output
    alone; 200 tokens of top-2 over 4 experts (100 pairs an expert, over the 64 the default
    takes natively) would otherwise run the torch loop."""
    from kernels.moe import fused_moe_ref, native_pairs_per_expert

    if not loaded:
        return
    gen = torch.Generator().manual_seed(5)
    tokens, experts, hidden, inter = 200, 4, 64, 32
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    calls = []
    real = native.moe_topk
    monkeypatch.setattr(native, "moe_topk", lambda *a: calls.append(len(a[0])) or real(*a))
    try:
        native.set_batch_invariant(True)
        assert native_pairs_per_expert() >= tokens
        batched = fused_moe_ref(x, w13, w2, weights, ids)
        alone = torch.cat(
            [fused_moe_ref(x[i : i + 1], w13, w2, weights[i : i + 1], ids[i : i + 1]) for i in range(tokens)]
        )
    finally:
        native.set_batch_invariant(False)
    assert calls[0] == tokens  # the whole batch in the native kernel
    assert torch.equal(batched, alone)
    assert native_pairs_per_expert() < tokens * 2 // experts  # the default's limit, restored


@pytest.mark.parametrize("tokens", [1, 3], ids=lambda t: f"T{t}")
def test_the_shared_expert_in_the_same_call_equals_adding_its_mlp(loaded, products, monkeypatch, tokens):
    """fused_moe's shared expert (its own intermediate size) goes into the routed experts' native
    call as the last pair of every token: the value of the torch path's `routed + swiglu(x)`."""
    from kernels.moe import fused_moe_ref, swiglu

    gen = torch.Generator().manual_seed(100 + tokens)
    experts, hidden, inter, shared_inter, top_k = 8, 64, 32, 48, 2
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    shared = (
        (torch.randn(2 * shared_inter, hidden, generator=gen) * hidden**-0.5).bfloat16(),
        (torch.randn(hidden, shared_inter, generator=gen) * shared_inter**-0.5).bfloat16(),
    )
    ids = torch.randperm(experts, generator=gen)[: tokens * top_k].view(tokens, top_k)
    weights = torch.rand(tokens, top_k, generator=gen)
    calls = []
    if loaded:
        real = native.moe_topk
        monkeypatch.setattr(native, "moe_topk", lambda *a: calls.append(a[6]) or real(*a))
    got = fused_moe_ref(x, w13, w2, weights, ids, shared)
    assert len(calls) == int(loaded) and all(c is shared for c in calls)  # one call, the shared expert in it
    monkeypatch.setattr(native, "_library", None)
    routed = fused_moe_ref(x, w13, w2, weights, ids)
    want = routed + swiglu(x, *shared)
    assert torch.equal(fused_moe_ref(x, w13, w2, weights, ids, shared), want)  # the torch path adds it
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * float(want.abs().max()))
    assert not torch.allclose(routed.float(), want.float(), atol=2**-6 * float(want.abs().max()))


@pytest.mark.parametrize("tokens", [1, 4, 9], ids=lambda t: f"T{t}")
def test_moe_topk_is_moe_pairs_in_expert_order(loaded, tokens):
    """native.moe_topk groups the router's (token, k) pairs itself: the bits of moe_pairs given the
    pairs by ascending expert, each expert's in (token, k) order, the -1s (other ranks') left out."""
    if not loaded:
        return
    gen = torch.Generator().manual_seed(tokens)
    experts, hidden, inter, top_k = 6, 64, 32, 3
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).bfloat16()
    shared = (
        (torch.randn(64, hidden, generator=gen) * 0.1).bfloat16(),
        (torch.randn(hidden, 32) * 0.1).bfloat16(),
    )
    ids = torch.randint(-1, experts, (tokens, top_k), generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    order = sorted(
        ((e, t, k) for t, row in enumerate(ids.tolist()) for k, e in enumerate(row) if e >= 0),
        key=lambda p: p[0],
    )
    want = torch.randn(tokens, hidden, generator=gen).bfloat16()
    got = want.clone()
    native.moe_topk(x, w13, w2, got, ids, weights, shared)
    native.moe_pairs(
        x, w13, w2, want, [e for e, _, _ in order], [t for _, t, _ in order],
        [float(weights[t, k]) for _, t, k in order], shared,
    )  # fmt: skip
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "scoring, with_bias, n_group, topk_group, top_k, norm, with_shared",
    [
        ("sigmoid", True, 4, 2, 4, True, True),  # V3 (noaux_tc), the bench model's routing
        ("softmax", False, 1, 1, 2, False, False),  # V2 greedy
        ("sigmoid", False, 4, 2, 3, True, False),  # group-limited without a bias
    ],
    ids=str,
)
def test_moe_block_equals_the_torch_path(
    loaded, products, scoring, with_bias, n_group, topk_group, top_k, norm, with_shared
):
    """A decode step's MoE in one native call (router product, scores, routing, routed and shared
    experts) against the torch path's ops (F.linear in float32, grouped_topk_ref, fused_moe_ref):
    equal up to the float32 summation order; and each token's row is the bits of that token alone
    (a verification's rows are one-token decodes)."""
    from kernels.gate import grouped_topk_ref
    from kernels.moe import fused_moe_ref

    if not loaded:
        return
    gen = torch.Generator().manual_seed(top_k * 7 + n_group)
    experts, hidden, inter = 32, 96, 48
    x = torch.randn(4, hidden, generator=gen).bfloat16()
    gate = torch.randn(experts, hidden, generator=gen) * hidden**-0.5
    bias = torch.randn(experts, generator=gen) * 0.1 if with_bias else None
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    shared = None
    if with_shared:
        shared = (
            (torch.randn(2 * 32, hidden, generator=gen) * hidden**-0.5).bfloat16(),
            (torch.randn(hidden, 32, generator=gen) * 32**-0.5).bfloat16(),
        )
    weights = native.MoEWeights(
        gate, bias, scoring == "softmax", n_group, topk_group, top_k, norm, 2.5, w13, w2, shared
    )
    got = native.moe_block(x, weights)
    routing = grouped_topk_ref(
        F.linear(x.float(), gate), bias, n_group, topk_group, top_k, norm, 2.5, scoring
    )
    topk_weights, topk_ids = routing
    want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, shared)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)
    # The experts' roundings are the torch loop's: a last-bit difference in a routing weight
    # moves an output's rounding now and then, no more.
    assert (got == want).float().mean() >= 0.95
    for t in range(x.shape[0]):
        assert torch.equal(native.moe_block(x[t : t + 1], weights), got[t : t + 1])
    with pytest.raises(ValueError, match="n_group=3"):
        native.MoEWeights(gate, bias, False, 3, 1, top_k, norm, 2.5, w13, w2, shared)


@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 9])
@torch.inference_mode()
def test_moe_layer_takes_one_call_for_a_few_tokens(loaded, monkeypatch, tokens):
    """DeepseekMoE runs moe_block for up to NATIVE_MAX_BATCH tokens (where the kernels are loaded)
    and its own path beyond, with the same value either way."""
    from engine.config import ModelConfig
    from engine.models.moe import DeepseekMoE
    from kernels.mla import NATIVE_MAX_BATCH

    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
        "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "kv_lora_rank": 64, "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "max_position_embeddings": 256, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    }  # fmt: skip
    layer = DeepseekMoE(ModelConfig.from_dict(raw), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(tokens)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    layer.process_weights()
    assert (layer.native_weights is not None) == loaded
    calls = []
    if loaded:
        real = native.moe_block
        monkeypatch.setattr(native, "moe_block", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(tokens, 64, generator=gen).bfloat16()
    got = layer(x)
    assert calls == ([1] if loaded and tokens <= NATIVE_MAX_BATCH else [])
    layer.native_weights = None
    want = layer(x)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def test_moe_pairs_refuses_ids_out_of_range(loaded):
    if not loaded:
        assert not native.loaded()
        return
    x = torch.zeros(1, 64, dtype=torch.bfloat16)
    w13 = torch.zeros(4, 32, 64, dtype=torch.bfloat16)
    w2 = torch.zeros(4, 64, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 4\)"):
        native.moe_pairs(x, w13, w2, torch.zeros_like(x), [4], [0], [1.0])
    with pytest.raises(ValueError, match="tokens in"):
        native.moe_pairs(x, w13, w2, torch.zeros_like(x), [1], [1], [1.0])
    with pytest.raises(ValueError, match="1 expert ids lie at or past E=4"):
        native.moe_topk(x, w13, w2, torch.zeros_like(x), torch.tensor([[4, -1]]), torch.ones(1, 2))


@pytest.mark.parametrize(
    "block_size, lens, s_q, heads, lat, rope",
    [
        (4, [1, 7, 16, 0], 1, 3, 40, 8),
        (16, [33], 1, 3, 40, 8),
        (3, [5, 2, 11], 1, 3, 40, 8),
        (16, [33], 3, 3, 40, 8),
        (4, [7, 16], 2, 3, 40, 8),
        (3, [2, 5], 2, 3, 40, 8),
        # Tile-shaped latents (L a multiple of 64, L + R of 32, as the bench model's 512 + 64):
        (16, [1, 15, 16, 17, 0, 33, 100, 64], 1, 8, 64, 32),
        (32, [31, 33, 64], 2, 3, 64, 32),
        (16, [40, 7], 1, 20, 64, 32),  # two groups of heads on the tiles: 16 and 4
        (8, [9, 20, 3, 30, 5], 1, 4, 64, 32),  # blocks of half a tile: VDPBF16PS
        (4, [5, 9, 13, 2, 7, 1], 1, 9, 40, 8),  # heads in groups of 8 and 1, a tail of 8 columns
    ],
    ids=str,
)
def test_mla_decode_equals_the_torch_path(
    loaded, products, monkeypatch, block_size, lens, s_q, heads, lat, rope
):
    """s_q query tokens per sequence (a decode, or a verification of drafts, each query seeing the
    keys up to its own position) over a paged cache with shuffled blocks, odd lengths and an empty
    sequence: the torch path's value, up to float32 summation order. Where the kernels are loaded
    every batch goes native; on the AMX tile unit (tile-shaped latents, blocks of whole tiles)
    within one bf16 rounding of VDPBF16PS. There the rows past a sequence's length in its last
    block hold NaN: the tiles load them, and nothing of them reaches the output (the torch path
    multiplies them by zero, so it gets zeros there)."""
    from kernels.mla import mla_decode, mla_decode_ref, per_token_tables

    tiles = products == "amx" and block_size % 16 == 0 and lat % 64 == 0 and (lat + rope) % 32 == 0
    native_call = loaded
    gen = torch.Generator().manual_seed(len(lens) * block_size + heads)
    per_seq = max(1, -(-max(lens) // block_size))
    num_blocks = len(lens) * per_seq + 3
    cache = torch.randn(num_blocks, block_size, lat + rope, generator=gen).bfloat16()
    table = torch.randperm(num_blocks, generator=gen)[: len(lens) * per_seq].view(len(lens), per_seq).int()
    # Each sequence's unwritten rows (a block is never read past its owner's length).
    for b, n in enumerate(lens):
        rows = cache[table[b].long()].view(-1, lat + rope)
        rows[n:] = float("nan") if native_call else 0.0
        cache[table[b].long()] = rows.view(per_seq, block_size, lat + rope)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), s_q, heads, lat + rope, generator=gen).bfloat16()
    calls = []
    if loaded:
        real = native.mla_decode
        monkeypatch.setattr(native, "mla_decode", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    got, _ = mla_decode(q, cache, table, seq_lens, 0.2, lat, return_lse=False)
    assert calls == ([len(lens) * s_q] if native_call else [])
    assert got.shape == (len(lens), s_q, heads, lat) and got.dtype == torch.bfloat16
    assert not got.isnan().any()
    if tiles and loaded:  # the same attention through VDPBF16PS
        native.use_amx(False)
        try:
            tables = per_token_tables(table, seq_lens, s_q)
            vdp = real(q.view(-1, heads, lat + rope), cache, *tables, 0.2, lat)
        finally:
            native.use_amx(True)
        torch.testing.assert_close(got.view_as(vdp).float(), vdp.float(), rtol=2**-7, atol=1e-3)
    cache = cache.nan_to_num()
    monkeypatch.setattr(native, "_library", None)
    want, _ = mla_decode(q, cache, table, seq_lens, 0.2, lat, return_lse=False)
    exact, _ = mla_decode_ref(q.float(), cache.float(), table, seq_lens, 0.2, lat)  # no bf16 roundings
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)
    # Each side's error against the unrounded attention is of the same size.
    err = lambda o: float((o.float() - exact).abs().max())  # noqa: E731
    assert err(got) <= 1.5 * err(want) + 1e-3


def test_the_attention_can_be_kept_off_the_tiles_while_the_products_use_them(loaded, products):
    """use_amx_attention(False) (PDSERVE_NATIVE_AMX_ATTENTION=0): with the products on the tile
    path, the decode attention gives the VDPBF16PS path's bits; on again, the tile path's own."""
    if not loaded:
        assert not native.loaded()
        return
    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(34, 16, 576, generator=gen).bfloat16()  # the bench model's latents, 512 + 64
    table = torch.randperm(34, generator=gen)[:32].view(2, 16).int()
    lens = torch.tensor([250, 130], dtype=torch.int32)
    q = torch.randn(2, 8, 576, generator=gen).bfloat16()
    # A score whose float32 sum depends on the order: the tiles add a row's products in order
    # (2^24 - 2^24 + 1 = 1), VDPBF16PS in 16 lanes of pairs (lane 0: 2^24 + 1 = 2^24; then 0).
    q[0, 0] = 0
    q[0, 0, [0, 2, 32]] = 1
    cache[table[0, 0], 0, :] = 0
    cache[table[0, 0], 0, [0, 2, 32]] = torch.tensor([2.0**24, -(2.0**24), 1.0]).bfloat16()
    try:
        assert not native.use_amx_attention(False)
        off = native.mla_decode(q, cache, table, lens, 0.05, 512)
    finally:  # the products' tile path untouched by the switch
        assert native.use_amx_attention(True) == (products == "amx") == native.uses_amx()
    on = native.mla_decode(q, cache, table, lens, 0.05, 512)
    native.use_amx(False)
    try:
        vdpbf16ps = native.mla_decode(q, cache, table, lens, 0.05, 512)
    finally:
        native.use_amx(
            products == "amx", emulated=products == "amx" and not native.AMX_FLAGS <= native.cpu_flags()
        )
    assert torch.equal(off, vdpbf16ps)
    assert torch.equal(on, vdpbf16ps) == (products != "amx")


def test_attention_case_is_a_paged_cache_of_whole_blocks_in_shuffled_order():
    gen = torch.Generator().manual_seed(0)
    q, cache, table, lens = native.attention_case(3, 40, 5, 64, 32, 16, gen)
    assert q.shape == (3, 5, 96) and q.dtype == cache.dtype == torch.bfloat16
    assert cache.shape == (9, 16, 96) and table.shape == (3, 3) and table.dtype == lens.dtype == torch.int32
    assert sorted(table.flatten().tolist()) == list(range(9)) and table.flatten().tolist() != list(range(9))
    assert lens.tolist() == [40, 40, 40]
    assert float(cache.float().abs().max()) <= 1 and float(cache.float().std()) > 0.4


@pytest.mark.parametrize("setting", [True, False], ids=["on", "off"])
def test_time_attention_paths_times_both_paths_and_restores_the_setting(loaded, products, setting):
    """The engine's measurement behind PDSERVE_NATIVE_AMX_ATTENTION=auto (engine/platform.py
    pick_decode_attention): both paths timed, and the switch as it was after (which path is
    faster is the machine's: not asserted)."""
    if not loaded:
        assert not native.loaded()
        return
    case = native.attention_case(4, 50, 8, 64, 32, 16, torch.Generator().manual_seed(1))
    if products != "amx":  # the choice is between tile paths: nothing to time without them
        with pytest.raises(AssertionError, match="use_amx"):
            native.time_attention_paths(case, 64, rounds=1)
        return
    before = native.amx_attention()
    native.use_amx_attention(setting)
    try:
        seconds = native.time_attention_paths(case, 64, rounds=2)
        assert set(seconds) == {"tiles", "vdpbf16ps"} and all(s > 0 for s in seconds.values())
        assert native.amx_attention() == setting
        # The tile path again where it was on: the products' setting untouched.
        assert native.use_amx_attention(setting) == setting and native.uses_amx()
    finally:
        native.use_amx_attention(before)


@pytest.mark.parametrize("block_size, width, lat", [(2, 16, 8), (16, 96, 64)], ids=["vdpbf16ps", "tiles"])
def test_mla_decode_refuses_block_ids_outside_the_cache(loaded, products, block_size, width, lat):
    if not loaded:
        assert not native.loaded()
        return
    cache = torch.zeros(4, block_size, width, dtype=torch.bfloat16)
    # Each bad id the lengths reach counts once: one sequence (its heads split over the threads),
    # then two, one of them past its bad id's block (not reached) and one reaching two.
    q = torch.zeros(1, 2, width, dtype=torch.bfloat16)
    table, lens = torch.tensor([[1, 4]], dtype=torch.int32), torch.tensor([block_size + 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"holds 1 block ids outside \[0, 4\)"):
        native.mla_decode(q, cache, table, lens, 1.0, lat)
    q = torch.zeros(2, 2, width, dtype=torch.bfloat16)
    table = torch.tensor([[2, -1, 7], [9, 0, -3]], dtype=torch.int32)
    lens = torch.tensor([block_size, 3 * block_size], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"holds 2 block ids outside \[0, 4\)"):
        native.mla_decode(q, cache, table, lens, 1.0, lat)
    with pytest.raises(ValueError, match="must be int32"):
        native.mla_decode(q, cache, torch.tensor([[1]]), torch.tensor([1]), 1.0, 8)


@pytest.mark.parametrize("rows, dim", [(1, 512), (3, 37), (2, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_equals_the_reference(loaded, monkeypatch, rows, dim, with_residual):
    """kernels.norm.rms_norm through the native call (where loaded) against the torch reference:
    the new residual stream bitwise, the output within one bf16 rounding (the mean of squares is
    summed in another order)."""
    from kernels.norm import rms_norm

    gen = torch.Generator().manual_seed(rows * dim)
    x = torch.randn(rows, dim, generator=gen).bfloat16()
    residual = torch.randn(rows, dim, generator=gen).bfloat16() if with_residual else None
    weight = torch.randn(dim, generator=gen).bfloat16()
    calls = []
    if loaded:
        real = native.rms_norm
        monkeypatch.setattr(native, "rms_norm", lambda *a: calls.append(1) or real(*a))
    got = rms_norm(x, weight, 1e-6, residual=residual)
    assert calls == ([1] if loaded else [])
    monkeypatch.setattr(native, "_library", None)
    want = rms_norm(x, weight, 1e-6, residual=residual)
    if with_residual:
        assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("heads", [None, 3], ids=["rows", "heads"])
def test_rotary_equals_the_reference_bitwise(loaded, monkeypatch, interleaved, heads):
    """kernels.rotary.apply_rotary through the native call (where loaded) on slices as MLAttention
    passes them (q[..., nope:] of each head, kv_a[:, L:]): bitwise the reference's values."""
    from kernels.rotary import apply_rotary, apply_rotary_ref

    gen = torch.Generator().manual_seed(heads or 1)
    tokens, nope, rope = 5, 6, 8
    wide = torch.randn(tokens, heads or 1, nope + rope, generator=gen).bfloat16()
    x = wide[..., nope:] if heads else wide[:, 0, nope:]  # strided, unit stride along R
    angles = torch.rand(tokens, rope // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    calls = []
    if loaded:
        real = native.rotary
        monkeypatch.setattr(native, "rotary", lambda *a: calls.append(1) or real(*a))
    got = apply_rotary(x, cos, sin, interleaved)
    assert calls == ([1] if loaded else [])
    assert got.shape == x.shape and got.dtype == torch.bfloat16
    assert torch.equal(got, apply_rotary_ref(x, cos, sin, interleaved))


def _mla_layer(q_lora: int | None, seed: int):
    """A small MLA layer (odd-free but not the bench sizes: 3 heads) with random bf16 weights."""
    from engine.config import ModelConfig
    from engine.models.mla import MLAttention

    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
        "hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 3,
        "kv_lora_rank": 64, "q_lora_rank": q_lora, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "max_position_embeddings": 256, "n_routed_experts": None,
    }  # fmt: skip
    cfg = ModelConfig.from_dict(raw)
    layer = MLAttention(cfg, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    for param in layer.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    layer.process_weights()
    return cfg, layer


@pytest.mark.parametrize("q_lora", [48, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("seqs, s_q", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 3), (2, 2)], ids=str)
@torch.inference_mode()
def test_mla_attention_in_one_call_is_the_bits_of_the_layers_calls(loaded, products, q_lora, seqs, s_q):
    """native.mla_attention, a few decode tokens' attention in one call (batch 1, a verification),
    against MLAttention's own calls: the same output and the same cache rows written, bit for bit
    (it calls the same functions in the same order), where the layer takes it."""
    from engine.forward_batch import DecodeGroup, ForwardBatch
    from kernels.mla import NATIVE_MAX_BATCH
    from kernels.rotary import rope_cos_sin_cache

    if not loaded:
        assert _mla_layer(q_lora, 0)[1].native_weights is None
        return
    cfg, layer = _mla_layer(q_lora, seqs * 10 + s_q)
    assert layer.native_weights is not None
    tokens, block_size = seqs * s_q, 4
    gen = torch.Generator().manual_seed(tokens)
    lens = [9 + 6 * i for i in range(seqs)]  # context lengths, the s_q new tokens included
    per_seq = -(-max(lens) // block_size)
    cache = torch.randn(seqs * per_seq + 3, block_size, cfg.kv_cache_width, generator=gen).bfloat16()
    tables = torch.randperm(cache.shape[0], generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    positions = [lens[b] - s_q + i for b in range(seqs) for i in range(s_q)]
    slots = [int(tables[b, p // block_size]) * block_size + p % block_size for b, p in zip(
        [b for b in range(seqs) for _ in range(s_q)], positions, strict=True)]  # fmt: skip
    batch = ForwardBatch(
        input_ids=torch.zeros(tokens, dtype=torch.long),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        decodes=[DecodeGroup.of(0, s_q, tables.tolist(), lens, "cpu")],
        prefills=[],
        logits_indices=torch.arange(tokens),
    )
    cos, sin = (t[batch.positions] for t in rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, 256))
    x = torch.randn(tokens, cfg.hidden_size, generator=gen).bfloat16()
    takes = tokens <= NATIVE_MAX_BATCH and layer.native_weights.takes_rows(tokens)
    calls = []
    real = native.mla_attention
    try:
        native.mla_attention = lambda *a: calls.append(a[0].shape[0]) or real(*a)
        one_call_cache = cache.clone()
        got = layer(x, cos, sin, batch, one_call_cache)
    finally:
        native.mla_attention = real
    assert calls == ([tokens] if takes else [])
    weights, layer.native_weights = layer.native_weights, None
    calls_cache = cache.clone()
    want = layer(x, cos, sin, batch, calls_cache)
    layer.native_weights = weights
    assert torch.equal(got, want)
    assert torch.equal(one_call_cache, calls_cache) and not torch.equal(calls_cache, cache)


@pytest.mark.parametrize("first_layer", [True, False], ids=["no-residual", "residual"])
@torch.inference_mode()
def test_the_decoder_layer_norms_in_the_same_call_are_their_bits(loaded, first_layer):
    """With the decoder layer's input and post-attention norms (DecoderLayer.forward's few-token
    path): the normed output and the new residual stream equal the norms' own calls around the
    layer's, bit for bit, in the first layer (no residual yet) and after it."""
    from engine.forward_batch import DecodeGroup, ForwardBatch
    from engine.models.layers import RMSNorm
    from kernels.rotary import rope_cos_sin_cache

    if not loaded:
        return
    cfg, layer = _mla_layer(48, 3)
    gen = torch.Generator().manual_seed(5)
    norms = tuple(RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=torch.bfloat16) for _ in range(2))
    for norm in norms:
        norm.weight.copy_(1 + 0.1 * torch.randn(cfg.hidden_size, generator=gen))
    cache = torch.randn(6, 4, cfg.kv_cache_width, generator=gen).bfloat16()
    batch = ForwardBatch(
        input_ids=torch.zeros(2, dtype=torch.long),
        positions=torch.tensor([9, 10]),
        slot_mapping=torch.tensor([4 * 3 + 1, 4 * 3 + 2]),
        decodes=[DecodeGroup.of(0, 2, [[5, 0, 3]], [11], "cpu")],
        prefills=[],
        logits_indices=torch.arange(2),
    )
    cos, sin = (t[batch.positions] for t in rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, 64))
    x = torch.randn(2, cfg.hidden_size, generator=gen).bfloat16()
    residual = None if first_layer else torch.randn(2, cfg.hidden_size, generator=gen).bfloat16()
    assert layer.takes_in_one_call(batch, 2, cache)
    one_cache = cache.clone()
    got, got_stream = layer.one_call(x, cos, sin, batch, one_cache, norms, residual)
    normed, stream = (norms[0](x), x) if first_layer else norms[0](x, residual)
    weights, layer.native_weights = layer.native_weights, None
    want, want_stream = norms[1](layer(normed, cos, sin, batch, cache), stream)
    layer.native_weights = weights
    assert torch.equal(got, want) and torch.equal(got_stream, want_stream) and torch.equal(one_cache, cache)


def test_mla_attention_refuses_bad_operands(loaded):
    from kernels.rotary import rope_cos_sin_cache

    if not loaded:
        return
    cfg, layer = _mla_layer(48, 1)
    cache = torch.zeros(2, 4, cfg.kv_cache_width, dtype=torch.bfloat16)
    cos, sin = (t[:1] for t in rope_cos_sin_cache(cfg.rope, cfg.qk_rope_head_dim, 16))
    x = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    table, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="outside the cache's 2 blocks of 4"):
        native.mla_attention(x, layer.native_weights, cos, sin, cache, torch.tensor([8]), table, lens)
    with pytest.raises(ValueError, match=r"x must be \[M, hidden=96\]"):
        native.mla_attention(x[:, :64], layer.native_weights, cos, sin, cache, torch.tensor([3]), table, lens)
    with pytest.raises(ValueError, match="slots must be int64"):
        native.mla_attention(
            x, layer.native_weights, cos, sin, cache, torch.tensor([3], dtype=torch.int32), table, lens
        )


@pytest.mark.parametrize(
    "scoring, with_bias, n_group, topk_group, top_k, norm",
    [
        ("sigmoid", True, 4, 2, 4, True),  # DeepSeek-V3's noaux_tc (the bench model's)
        ("sigmoid", True, 8, 3, 8, True),
        ("sigmoid", True, 1, 1, 2, False),
        ("softmax", False, 1, 1, 6, False),  # V2's greedy
        ("softmax", False, 4, 2, 3, True),  # group-limited without a bias
    ],
    ids=str,
)
def test_route_is_the_bits_of_the_reference(
    loaded, monkeypatch, scoring, with_bias, n_group, topk_group, top_k, norm
):
    """native.route, a few tokens' routing from the scores on in one call, against grouped_topk_ref's
    own ops: the same ids and float32 weights bit for bit, over 2,400 tokens of which half have
    exact ties (logits on a coarse grid), where the lowest index must win."""
    from kernels.gate import HOST_SELECT_MAX, grouped_topk_ref

    experts, tokens = 32, HOST_SELECT_MAX // 32
    gen = torch.Generator().manual_seed(n_group * 10 + top_k)
    args = (n_group, topk_group, top_k, norm, 2.5)
    calls = []
    if loaded:
        real = native.route
        monkeypatch.setattr(native, "route", lambda *a: calls.append(1) or real(*a))
    for trial in range(300):
        logits = torch.randn(tokens, experts, generator=gen) * 3
        if trial % 2:
            logits = (logits * 2).round() / 2  # ties
        bias = torch.randn(experts, generator=gen) * 0.5 if with_bias else None
        got = grouped_topk_ref(logits, bias, *args, scoring=scoring)
        with monkeypatch.context() as torch_path:
            torch_path.setattr(native, "_library", None)
            want = grouped_topk_ref(logits, bias, *args, scoring=scoring)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), trial
    assert len(calls) == (300 if loaded else 0)


@pytest.mark.parametrize("rows", [1, 3], ids=lambda v: f"rows{v}")
def test_mtp_input_in_one_call_is_the_bits_of_the_separate_calls(loaded, products, rows):
    """The MTP layer's input (embedding, both norms, eh_proj) in one native call against the same
    calls one by one, bitwise, the hidden states a strided slice as the drafter passes them."""
    from kernels.linear import linear
    from kernels.norm import rms_norm

    gen = torch.Generator().manual_seed(rows)
    vocab, dim = 50, 64
    embed = torch.randn(vocab, dim, generator=gen).bfloat16()
    hidden = torch.randn(2 * rows, dim, generator=gen).bfloat16()[::2]  # rows 2 * dim apart
    enorm, hnorm = torch.randn(dim, generator=gen).bfloat16(), torch.randn(dim, generator=gen).bfloat16()
    eh_proj = torch.randn(dim, 2 * dim, generator=gen).bfloat16() / 8
    ids = torch.tensor([7, 0, vocab - 1][:rows])
    norms = (enorm, 1e-6, hnorm, 0.25)  # eps far apart: each must reach its own norm
    got = native.mtp_input(ids, embed, hidden, norms, eh_proj)
    want = linear(
        torch.cat((rms_norm(embed[ids], enorm, 1e-6), rms_norm(hidden, hnorm, 0.25)), dim=-1), eh_proj
    )
    if not loaded:
        assert got is None  # the caller runs the separate calls
        return
    assert got is not None and got.shape == (rows, dim) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_mtp_input_refuses_ids_out_of_range_and_leaves_many_rows_to_the_caller(loaded):
    embed, hidden = torch.zeros(10, 32, dtype=torch.bfloat16), torch.zeros(2, 32, dtype=torch.bfloat16)
    norms = (torch.ones(32, dtype=torch.bfloat16), 1e-6, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    eh_proj = torch.zeros(32, 64, dtype=torch.bfloat16)
    if not loaded:  # nothing checked here: the separate calls take any operands
        assert native.mtp_input(torch.tensor([3, 10]), embed, hidden, norms, eh_proj) is None
        return
    for bad in ([3, 10], [-1, 0]):
        with pytest.raises(ValueError, match=r"1 token ids lie outside \[0, 10\)"):
            native.mtp_input(torch.tensor(bad), embed, hidden, norms, eh_proj)
    with pytest.raises(ValueError, match="eh_proj"):
        native.mtp_input(torch.tensor([1, 2]), embed, hidden, norms, eh_proj[:, :32])
    many = min(native.max_rows(), 299) + 1  # more than the products take here, or 300 (any)
    rows = torch.zeros(many, 32, dtype=torch.bfloat16)
    got = native.mtp_input(torch.zeros(many, dtype=torch.long), embed, rows, norms, eh_proj)
    assert (got is None) == (many > native.max_rows())


def _small_model(
    v2: bool, seed: int, rope: int = 16, mtp: int = 0, quant: str | None = None, index_topk: int | None = None
):
    """A three-layer model with random bf16 weights: a dense first layer, then two MoE layers; V3's
    routing (sigmoid, bias, groups) and q_lora, or V2's (softmax, greedy) without. rope 32 makes
    the cache rows 96 wide, which the AMX tile attention takes. quant "fp8": every projection kept
    FP8 with 32 x 32 block scales (partial blocks: 80 and 48 are not multiples of 32); "mxfp4": the
    routed experts MXFP4 besides. index_topk: DeepSeek-V3.2, with a lightning indexer of 5 heads of
    40 (its leading `rope` roped) choosing that many keys (its wq_b and wk FP8 with quant)."""
    from engine.config import ModelConfig
    from engine.models.deepseek_v2 import DeepseekV2ForCausalLM
    from engine.models.deepseek_v32 import DeepseekV32ForCausalLM

    raw = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 80,
        "hidden_size": 96, "intermediate_size": 80, "num_hidden_layers": 3, "num_attention_heads": 3,
        "kv_lora_rank": 64, "q_lora_rank": 48, "qk_nope_head_dim": 32, "qk_rope_head_dim": rope,
        "v_head_dim": 32, "max_position_embeddings": 256, "n_routed_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    }  # fmt: skip
    if v2:
        raw.update(
            architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
            topk_method="greedy", scoring_func="softmax", n_shared_experts=2, routed_scaling_factor=1.0,
        )  # fmt: skip
    if index_topk is not None:
        raw.update(
            architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", index_n_heads=5,
            index_head_dim=40, index_topk=index_topk,
        )  # fmt: skip
    if quant is not None:
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32]}
        if quant == "mxfp4":
            raw["expert_dtype"] = "fp4"
    cfg = ModelConfig.from_dict(raw)
    cls = DeepseekV2ForCausalLM if index_topk is None else DeepseekV32ForCausalLM
    model = cls(cfg, dtype=torch.bfloat16, max_positions=256, num_mtp_layers=mtp)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen))
            elif param.dtype == torch.float8_e4m3fn:  # values in range; their scales set the size
                param.copy_((torch.randn(param.shape, generator=gen) * 64).clamp(-448, 448))
            elif param.dtype == torch.uint8 and "scale" in name:  # e8m0: 2^-4 .. 2^-2
                param.copy_(torch.randint(123, 126, param.shape, generator=gen))
            elif param.dtype == torch.uint8:  # two e2m1 codes a byte
                param.copy_(torch.randint(0, 256, param.shape, generator=gen))
            elif "scale" in name:  # FP8's float32 block scales: the values' 64 undone, 1/sqrt(K)
                param.copy_(torch.rand(param.shape, generator=gen) * 0.01 + 0.005)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    model.process_weights()
    return cfg, model


def _decode_batch(seqs: int, s_q: int, block_size: int, blocks: int, vocab: int, gen, first_len: int = 9):
    """One decode group of `seqs` sequences of s_q new tokens each, at scattered cache blocks, the
    first `first_len` tokens long, each next 6 longer."""
    from engine.forward_batch import DecodeGroup, ForwardBatch

    lens = [first_len + 6 * i for i in range(seqs)]
    per_seq = -(-max(lens) // block_size)
    tables = torch.randperm(blocks, generator=gen)[: seqs * per_seq].view(seqs, per_seq)
    positions = [lens[b] - s_q + i for b in range(seqs) for i in range(s_q)]
    owners = [b for b in range(seqs) for _ in range(s_q)]
    slots = [
        int(tables[b, p // block_size]) * block_size + p % block_size
        for b, p in zip(owners, positions, strict=True)
    ]
    return ForwardBatch(
        input_ids=torch.randint(0, vocab, (seqs * s_q,), generator=gen),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slots),
        decodes=[DecodeGroup.of(0, s_q, tables.tolist(), lens, "cpu")],
        prefills=[],
        logits_indices=torch.arange(seqs * s_q),
    )


@pytest.mark.parametrize(
    "v2, quant",
    [(False, None), (True, None), (False, "fp8"), (False, "mxfp4")],
    ids=["v3", "v2", "fp8", "mxfp4"],
)
@pytest.mark.parametrize("seqs, s_q", [(1, 1), (2, 1), (4, 1), (1, 2), (1, 3), (2, 2)], ids=str)
@torch.inference_mode()
def test_the_whole_stack_in_one_call_is_the_bits_of_the_layers_calls(loaded, products, v2, quant, seqs, s_q):
    """native.decode_stack, a decode step's embedding, layers and final norm in one call, against the
    model's layer by layer calls: the same hidden states and the same cache rows written in every
    layer, bit for bit, for batch 1, a few sequences and a verification's tokens; with the weights
    bf16 or kept quantized (FP8 projections, MXFP4 experts: the layer calls' products and experts
    then widen them in the same kernels)."""
    from kernels.mla import NATIVE_MAX_BATCH

    cfg, model = _small_model(v2, seqs * 10 + s_q, quant=quant)
    if not loaded:
        assert model.native_stack is None
        return
    assert model.native_stack is not None
    gen = torch.Generator().manual_seed(seqs + s_q)
    caches = [torch.randn(seqs * 8 + 3, 4, cfg.kv_cache_width, generator=gen).bfloat16() for _ in range(3)]
    batch = _decode_batch(seqs, s_q, 4, caches[0].shape[0], cfg.vocab_size, gen)
    tokens = seqs * s_q
    calls = []
    real = native.decode_stack
    try:
        native.decode_stack = lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k)
        one_call = [c.clone() for c in caches]
        got = model(batch, mla_caches(one_call))
    finally:
        native.decode_stack = real
    assert calls == ([tokens] if tokens <= NATIVE_MAX_BATCH and model.native_stack.takes_rows(tokens) else [])
    stack, model.native_stack = model.native_stack, None
    layer_calls = [c.clone() for c in caches]
    want = model(batch, mla_caches(layer_calls))
    model.native_stack = stack
    assert torch.equal(got, want)
    for a, b, before in zip(one_call, layer_calls, caches, strict=True):
        assert torch.equal(a, b) and not torch.equal(a, before)


@pytest.mark.parametrize("index_topk", [None, 12], ids=["v3", "v32"])
@pytest.mark.parametrize("seqs, s_q", [(1, 1), (1, 2), (2, 1), (1, 3)], ids=str)
@torch.inference_mode()
def test_the_mtp_layer_in_one_call_is_the_bits_of_its_calls(loaded, products, seqs, s_q, index_topk):
    """The MTP layer's draft forward (its input in one call, then the layer and its shared_head norm
    as a one-layer stack) against the layer's own calls: the same g and cache rows, bit for bit; a
    DeepSeek-V3.2 MTP layer with its indexer inside, over contexts past its top-12 (its latent and
    indexer-key rows)."""
    from engine.models.deepseek_v32 import DeepseekV32ForCausalLM

    cfg, model = _small_model(False, seqs * 10 + s_q, mtp=1, index_topk=index_topk)
    if not loaded:
        assert model.mtp_stack is None
        return
    assert model.mtp_stack is not None and len(model.mtp_stack.layers) == 1
    gen = torch.Generator().manual_seed(seqs + s_q)
    blocks = seqs * 8 + 3
    if index_topk is None:
        caches = [torch.randn(blocks, 4, cfg.kv_cache_width, generator=gen).bfloat16()]
    else:  # the MTP layer's latent and indexer-key caches
        spec = DeepseekV32ForCausalLM.kv_cache_spec(
            cfg, num_mtp_layers=1, block_size=4, dtype=torch.bfloat16, fingerprint="test"
        )
        caches = list(model.mtp_cache(spec.allocate(blocks, "cpu")))
        for c in caches:
            c.copy_(torch.randn(c.shape, generator=gen))
    batch = _decode_batch(
        seqs, s_q, 4, blocks, cfg.vocab_size, gen, first_len=9 if index_topk is None else 14
    )
    hidden = torch.randn(seqs * s_q, cfg.hidden_size, generator=gen).bfloat16()

    def draft(one_call: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        stack, calls, real = model.mtp_stack, [], native.decode_stack
        mine = [c.clone() for c in caches]
        try:
            native.decode_stack = lambda *a, **k: calls.append(1) or real(*a, **k)
            model.mtp_stack = stack if one_call else None
            g = model.mtp_forward(batch.input_ids, hidden, batch, mine[0] if len(mine) == 1 else tuple(mine))
        finally:
            native.decode_stack, model.mtp_stack = real, stack
        assert calls == ([1] if one_call else [])
        return g, mine

    (got, got_caches), (want, want_caches) = draft(True), draft(False)
    assert torch.equal(got, want)
    for a, b, before in zip(got_caches, want_caches, caches, strict=True):
        assert torch.equal(a, b) and not torch.equal(a, before)


@pytest.mark.parametrize("quant", [None, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "seqs, s_q, first_len",
    [(1, 1, 20), (1, 1, 9), (4, 1, 8), (1, 3, 13), (2, 2, 10)],
    ids=["sparse", "dense", "mixed", "verify-across-topk", "two-verifying"],
)
@torch.inference_mode()
def test_v32_sparse_decode_in_one_call_is_the_bits_of_the_layers_calls(
    loaded, products, quant, seqs, s_q, first_len
):
    """DeepSeek-V3.2's decode with the indexer inside the native calls (each layer's keys stored,
    its queries scored, the top index_topk=12 chosen, sparse MLA over them; a token whose context
    fits in 12 dense), as the whole stack in one call and as a call per layer's attention, against
    the model's Python path (indexer, native indexer_topk and sparse_mla_decode called one by one):
    the same hidden states and the same latent and indexer-key rows written, bit for bit, for
    contexts beyond topk, within it, both in one step and across a verification's tokens."""
    from engine.models.deepseek_v32 import DeepseekV32ForCausalLM

    cfg, model = _small_model(False, seqs * 10 + s_q, quant=quant, index_topk=12)
    if not loaded:
        assert model.native_stack is None
        return
    assert model.native_stack is not None and all(model.native_stack.indexed)
    spec = DeepseekV32ForCausalLM.kv_cache_spec(
        cfg, num_mtp_layers=0, block_size=4, dtype=torch.bfloat16, fingerprint="test"
    )
    gen = torch.Generator().manual_seed(seqs + s_q)
    caches = spec.allocate(seqs * 8 + 3, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    batch = _decode_batch(seqs, s_q, 4, caches[0].shape[0], cfg.vocab_size, gen, first_len)
    sparse = any(int(n) > 12 for n in batch.decodes[0].per_token[1])

    def run(route: str) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        calls, real = [], (native.decode_stack, native.mla_attention, native.indexer_topk)
        stack, weights = model.native_stack, [layer.self_attn.native_weights for layer in model.layers]
        if route != "stack":
            model.native_stack = None
        if route == "python":
            for layer in model.layers:
                layer.self_attn.native_weights = None
        mine = spec.allocate(caches[0].shape[0], "cpu")
        for a, b in zip(mine, caches, strict=True):
            a.copy_(b)
        try:
            native.decode_stack = lambda *a, **k: calls.append("stack") or real[0](*a, **k)
            native.mla_attention = lambda *a, **k: calls.append("layer") or real[1](*a, **k)
            native.indexer_topk = lambda *a, **k: calls.append("topk") or real[2](*a, **k)
            hidden = model(batch, mine)
        finally:
            native.decode_stack, native.mla_attention, native.indexer_topk = real
            model.native_stack = stack
            for layer, w in zip(model.layers, weights, strict=True):
                layer.self_attn.native_weights = w
        return hidden, list(mine), calls

    got, got_caches, calls = run("stack")
    assert calls == ["stack"]
    per_layer, per_layer_caches, calls = run("layer")
    assert calls == ["layer"] * 3
    want, want_caches, calls = run("python")
    assert calls == ["topk"] * (3 if sparse else 0)
    assert torch.equal(got, want) and torch.equal(per_layer, want)
    for a, b, c, before in zip(got_caches, per_layer_caches, want_caches, caches, strict=True):
        assert torch.equal(a, c) and torch.equal(b, c) and not torch.equal(c, before)


@torch.inference_mode()
def test_a_batch_in_one_call_gives_each_sequence_its_own_bits(loaded, products):
    """A decode step of up to max_rows() sequences runs as one call (on the AMX tile unit or
    through VDPBF16PS), and each sequence gets the hidden state and cache rows it gets alone (every
    product, the attention and the MoE block treat each token apart). Against the layer-by-layer
    path (torch's router product above NATIVE_MAX_BATCH tokens) it agrees to bf16 rounding."""
    from engine.forward_batch import DecodeGroup, ForwardBatch
    from kernels.mla import NATIVE_MAX_BATCH

    cfg, model = _small_model(False, 7, rope=32)
    if not loaded:
        return
    seqs, block_size = 40, 16  # two 32-row passes of every product on the tile unit
    gen = torch.Generator().manual_seed(3)
    caches = [
        torch.randn(seqs * 16 + 2, block_size, cfg.kv_cache_width, generator=gen).bfloat16() for _ in range(3)
    ]
    batch = _decode_batch(seqs, 1, block_size, caches[0].shape[0], cfg.vocab_size, gen)
    assert seqs <= native.max_rows() and model.runs_in_one_call(batch, mla_caches(caches))
    together = [c.clone() for c in caches]
    got = model(batch, mla_caches(together))
    tables, lens = batch.decodes[0].per_token
    apart = [c.clone() for c in caches]
    for i in range(seqs):
        alone = ForwardBatch(
            input_ids=batch.input_ids[i : i + 1],
            positions=batch.positions[i : i + 1],
            slot_mapping=batch.slot_mapping[i : i + 1],
            decodes=[DecodeGroup.of(0, 1, [tables[i].tolist()], [int(lens[i])], "cpu")],
            prefills=[],
            logits_indices=torch.arange(1),
        )
        assert torch.equal(model(alone, mla_caches(apart))[0], got[i])
    assert all(torch.equal(a, b) for a, b in zip(together, apart, strict=True))
    stack, model.native_stack = model.native_stack, None
    per_layer = model(batch, mla_caches([c.clone() for c in caches]))
    model.native_stack = stack
    assert seqs > NATIVE_MAX_BATCH
    torch.testing.assert_close(got.float(), per_layer.float(), rtol=2**-7, atol=2**-6)


@torch.inference_mode()
def test_decode_stack_refuses_bad_operands(loaded):
    if not loaded:
        return
    cfg, model = _small_model(False, 2)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.zeros(4, 4, cfg.kv_cache_width, dtype=torch.bfloat16) for _ in range(3)]
    batch = _decode_batch(1, 1, 4, 4, cfg.vocab_size, gen)
    cos, sin = model.rope_cos[batch.positions], model.rope_sin[batch.positions]
    tables, lens = batch.decodes[0].per_token
    stack = model.native_stack

    def run(ids=batch.input_ids, slots=batch.slot_mapping, kv=caches):
        return native.decode_stack(stack, ids, cos, sin, kv, slots, tables, lens)

    with pytest.raises(ValueError, match=r"1 token ids lie outside \[0, 80\)"):
        run(ids=torch.tensor([80]))
    with pytest.raises(ValueError, match="outside the cache's 4 blocks of 4"):
        run(slots=torch.tensor([16]))
    with pytest.raises(ValueError, match="kv_caches must be 3 contiguous"):
        run(kv=caches[:2])
    with pytest.raises(ValueError, match=r"ids must be int64 \[M\]"):
        run(ids=batch.input_ids.int())
    with pytest.raises(ValueError, match="give ids or x, not both"):
        native.decode_stack(stack, None, cos, sin, caches, batch.slot_mapping, tables, lens)
    with pytest.raises(ValueError, match=r"x must be CPU bfloat16 \[M, hidden=96\]"):
        native.decode_stack(
            stack, None, cos, sin, caches, batch.slot_mapping, tables, lens, torch.zeros(1, 95)
        )
    assert run().shape == (1, cfg.hidden_size)


@torch.inference_mode()
def test_greedy_spec_step_refuses_bad_operands(loaded):
    """native.greedy_spec_step (the engine's one-call speculative step, held to the step-by-step
    path's bits in tests/test_spec_decode.py) names what is wrong: rows that are not whole
    requests, ids outside the vocabulary, slots outside the cache, positions past the rope tables,
    a draft past the block table."""
    cfg, model = _small_model(False, 5, mtp=1)
    if not loaded:
        assert model.mtp_drafter is None
        return
    gen = torch.Generator().manual_seed(1)
    caches = [torch.zeros(16, 4, cfg.kv_cache_width, dtype=torch.bfloat16) for _ in range(4)]
    batch = _decode_batch(1, 2, 4, 16, cfg.vocab_size, gen)  # one request: its token and one draft
    tables, lens = batch.decodes[0].per_token

    def run(
        ids=batch.input_ids,
        positions=batch.positions,
        slots=batch.slot_mapping,
        caps=(9,),
        k=1,
        kv=caches[:3],
        mtp=caches[3],
    ):
        return native.greedy_spec_step(
            model.native_stack,
            model.mtp_drafter,
            ids,
            positions,
            kv,
            mtp,
            slots,
            tables,
            lens,
            2,
            list(caps),
            k,
        )

    with pytest.raises(ValueError, match=r"M=2 rows must be 2 requests of query_len=2"):
        run(caps=(9, 9))
    with pytest.raises(ValueError, match=r"1 token ids lie outside \[0, 80\)"):
        run(ids=torch.tensor([3, 80]))
    with pytest.raises(ValueError, match="outside the cache's 16 blocks of 4"):
        run(slots=torch.tensor([3, 64]))
    with pytest.raises(ValueError, match="the rope tables' 256 positions"):
        run(positions=torch.tensor([255, 256]))
    with pytest.raises(ValueError, match="kv_caches must be 3 contiguous"):
        run(kv=caches[:2])
    with pytest.raises(ValueError, match="the MTP layer's cache must be like the target's"):
        run(mtp=torch.zeros(8, 4, cfg.kv_cache_width, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="positions lie outside"):  # its later drafts run past its 3 blocks
        run(caps=(40,), k=8)
    tokens, accepted, drafts = run(caps=(2,), k=3)  # it may draft up to 2 - emitted tokens
    assert tokens.shape == (2,) and accepted.shape == (1,) and drafts.shape == (1, 3)
    assert 0 <= int(accepted[0]) <= 1 and (drafts[0] >= 0).sum() == max(0, 2 - int(accepted[0]) - 1)
