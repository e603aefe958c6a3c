"""The small Triton kernels (routing, RMSNorm, rotary, KV store) against their PyTorch references.

Runs on CPU under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any
kernel is defined) and on a GPU as is. The interpreter costs milliseconds per program instance,
so every grid here is a handful of programs. Shapes are deliberately not powers of two (E=12
experts, D=40, R=24, L=24, odd head counts) so every mask is exercised.

The interpreter rounds float32 -> bfloat16 by truncation (a GPU rounds to nearest even), so
bfloat16 outputs are compared within the dtype's tolerance, never bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import RopeConfig
from kernels.gate import grouped_topk, grouped_topk_ref
from kernels.kv_store import store_kv, store_kv_ref
from kernels.norm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref, rope_cos_sin_cache
from tests.kernel_testing import DTYPE_ID, DTYPES, TOL, assert_close, gen  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# --- grouped top-k routing -----------------------------------------------------------------------
#
# Ties: the reference and the kernel both take the lowest index among equal values (torch.topk
# has no tie order, so the reference uses a stable sort). The kernel is held to the reference and
# to `route_lowest_index` below, an independent transcription of the same rule, ties included.

# name -> (E, n_group, topk_group, top_k, scoring, biased, norm_topk_prob, routed_scaling_factor)
GATE_CASES = {
    "E12-G4-g2-k3-v3": (12, 4, 2, 3, "sigmoid", True, True, 2.5),
    "E12-G3-g2-k4-v3-nonorm": (12, 3, 2, 4, "sigmoid", True, False, 1.0),
    "E12-G1-k5-v3": (12, 1, 1, 5, "sigmoid", True, True, 1.5),  # no groups: one [1, E] tile
    "E12-G4-g2-k3-v2": (12, 4, 2, 3, "softmax", False, False, 16.0),  # group score = max
    "E12-G3-g1-k4-v2-norm": (12, 3, 1, 4, "softmax", False, True, 1.0),  # k = the kept group
    "E256-G8-g4-k8-v3": (256, 8, 4, 8, "sigmoid", True, True, 2.5),  # DeepSeek-V3 routing
}
GATE_TOKENS = 8
GATE_PARAMS = [
    pytest.param(
        case, ties, dtype, id=f"T{GATE_TOKENS}-{case}-{'ties' if ties else 'distinct'}-{DTYPE_ID[dtype]}"
    )
    for case in GATE_CASES
    for ties in (False, True)
    for dtype in DTYPES
    # Every case in float32; the input dtype only changes the load, so one case covers the rest.
    if dtype == torch.float32 or case == "E12-G4-g2-k3-v3"
]


def gate_inputs(tokens: int, num_experts: int, ties: bool, dtype: torch.dtype):
    g = gen(19)
    if ties:
        # Few distinct non-negative logits and biases: many exactly equal scores, group scores and
        # choices. (Logits of both signs would add accidental near-ties such as
        # sigmoid(a) + sigmoid(-a) against 2 * sigmoid(0), which two correct sigmoids may round
        # differently.)
        logits = torch.randint(0, 3, (tokens, num_experts), generator=g).float() * 0.5
        bias = torch.randint(0, 2, (num_experts,), generator=g).float() * 0.125
    else:
        logits = torch.randn(tokens, num_experts, generator=g) * 2
        bias = torch.randn(num_experts, generator=g) * 0.1
    return logits.to(dtype), bias


def route_lowest_index(logits, bias, n_group, topk_group, top_k, norm, scaling, scoring):
    """grouped_topk_ref with every top-k taken by a stable descending sort: among equal values
    the lowest index wins. -> (weights [T, k], ids [T, k])."""

    def top(values: torch.Tensor, k: int) -> torch.Tensor:
        return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]

    scores = logits.float().sigmoid() if scoring == "sigmoid" else logits.float().softmax(dim=-1)
    tokens, num_experts = scores.shape
    choice = scores if bias is None else scores + bias
    if n_group > 1 and topk_group < n_group:
        grouped = choice.view(tokens, n_group, num_experts // n_group)
        if bias is not None:
            group_scores = grouped.gather(-1, top(grouped, 2)).sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, top(group_scores, topk_group), True
        )
        fill = float("-inf") if bias is not None else 0.0
        choice = grouped.masked_fill(~keep[..., None], fill).view(tokens, num_experts)
    ids = top(choice, top_k)
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def by_expert(weights: torch.Tensor, ids: torch.Tensor):
    """Sort each row by expert id (the order of the k experts is unspecified)."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.parametrize("case,ties,dtype", GATE_PARAMS)
def test_grouped_topk(case, ties, dtype):
    num_experts, n_group, topk_group, top_k, scoring, biased, norm, scaling = GATE_CASES[case]
    logits, bias = gate_inputs(GATE_TOKENS, num_experts, ties, dtype)
    bias = bias if biased else None
    args = (n_group, topk_group, top_k, norm, scaling, scoring)
    dev_bias = bias.to(DEVICE) if bias is not None else None
    weights, ids = grouped_topk(logits.to(DEVICE), dev_bias, *args, impl="triton")
    assert weights.shape == ids.shape == (GATE_TOKENS, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    weights, ids = by_expert(weights.cpu(), ids.cpu())
    want = [
        by_expert(*route_lowest_index(logits, bias, *args)),
        by_expert(*grouped_topk_ref(logits, bias, *args)),
    ]
    for want_w, want_ids in want:
        assert ids.tolist() == want_ids.tolist(), f"logits {logits.tolist()}"
        torch.testing.assert_close(weights, want_w, **TOL[torch.float32])


def test_grouped_topk_ties_are_exercised():
    """The tie inputs really tie where choices are made: at the k-th expert (E12-G1-k5), at the
    last kept group (E12-G4-g2, biased top-2 sums and V2 maxima) and inside a group's top 2."""
    logits, bias = gate_inputs(GATE_TOKENS, 12, True, torch.float32)
    choice = logits.sigmoid() + bias  # [T, E]
    ranked = choice.sort(dim=-1, descending=True).values
    assert (ranked[:, 4] == ranked[:, 5]).sum() >= 2
    top2 = choice.view(-1, 4, 3).topk(2, dim=-1).values  # [T, G, 2]
    assert (top2[..., 0] == top2[..., 1]).sum() >= 2
    for group_scores in (top2.sum(dim=-1), logits.view(-1, 4, 3).max(dim=-1).values):
        ranked = group_scores.sort(dim=-1, descending=True).values
        assert (ranked[:, 1] == ranked[:, 2]).sum() >= 2


def test_grouped_topk_several_programs_strided_logits():
    """20 tokens: a full program of 16 and a masked one; logits read through a row stride (a
    column slice of a wider tensor)."""
    num_experts, n_group, topk_group, top_k, scoring, _, norm, scaling = GATE_CASES["E12-G4-g2-k3-v3"]
    wide = torch.randn(20, num_experts + 5, generator=gen(7)) * 2
    bias = torch.randn(num_experts, generator=gen(8)) * 0.1
    args = (n_group, topk_group, top_k, norm, scaling, scoring)
    logits = wide.to(DEVICE)[:, 2 : 2 + num_experts]
    weights, ids = by_expert(*(t.cpu() for t in grouped_topk(logits, bias.to(DEVICE), *args, impl="triton")))
    want_w, want_ids = by_expert(*grouped_topk_ref(wide[:, 2 : 2 + num_experts], bias, *args))
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_w, **TOL[torch.float32])


def test_grouped_topk_empty():
    weights, ids = grouped_topk(torch.empty(0, 12, device=DEVICE), None, 4, 2, 3, True, 1.0, impl="triton")
    assert weights.shape == ids.shape == (0, 3)


# --- RMSNorm ----------------------------------------------------------------------------------------

NORM_SHAPES = [(0, 40), (5, 40), (2, 3, 40), (3, 64)]
EPS = 1e-6


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("shape", NORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rms_norm(shape, residual, dtype):
    g = gen(29)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    res = (torch.randn(*shape, generator=g) * 4).to(dtype)
    weight = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    if not residual:
        got = rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS, impl="triton")
        assert got.shape == x.shape and got.dtype == dtype
        assert_close(got, rms_norm_ref(x, weight, EPS), dtype)
        return
    got, summed = rms_norm(x.to(DEVICE), weight.to(DEVICE), EPS, residual=res.to(DEVICE), impl="triton")
    assert got.shape == summed.shape == x.shape and got.dtype == summed.dtype == dtype
    assert_close(summed, x + res, dtype)
    if dtype != torch.bfloat16:  # the interpreter truncates to bf16 (see the module docstring)
        torch.testing.assert_close(summed.cpu(), x + res, atol=0, rtol=0)
    assert_close(got, rms_norm_ref(x + res, weight, EPS), dtype)


def test_rms_norm_strided_rows():
    """Rows of a wider tensor (x[:, :D], as kv_a[:, :L] in MLA) are read through their stride."""
    g = gen(3)
    wide = torch.randn(5, 47, generator=g).to(DEVICE)
    weight = (torch.rand(40, generator=g) + 0.5).to(DEVICE)
    got = rms_norm(wide[:, :40], weight, EPS, impl="triton")
    assert_close(got, rms_norm_ref(wide[:, :40].cpu(), weight.cpu(), EPS), torch.float32)


# --- rotary embedding ------------------------------------------------------------------------------

YARN = RopeConfig(
    type="yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.8
)
ROTARY_SHAPES = [(3, 5, 16), (4, 1, 24), (5, None, 16)]  # (N, H, R); H None: k_pe's [N, R]
ROTARY_IDS = [f"N{n}-H{h}-R{r}" if h else f"N{n}-R{r}" for n, h, r in ROTARY_SHAPES]


def rotary_inputs(tokens: int, heads: int | None, dim: int, dtype: torch.dtype):
    g = gen(23)
    cos_all, sin_all = rope_cos_sin_cache(YARN, dim, 300)  # [300, R/2] float32
    pos = torch.randint(0, 300, (tokens,), generator=g)
    x = torch.randn(tokens, *((heads,) if heads else ()), dim, generator=g).to(dtype)
    return x, cos_all[pos], sin_all[pos]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_ID.get)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("tokens,heads,dim", ROTARY_SHAPES, ids=ROTARY_IDS)
def test_rotary(tokens, heads, dim, interleaved, dtype):
    x, cos, sin = rotary_inputs(tokens, heads, dim, dtype)
    got = apply_rotary(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), interleaved, impl="triton")
    assert got.shape == x.shape and got.dtype == dtype
    assert_close(got, apply_rotary_ref(x, cos, sin, interleaved), dtype)  # evens, then odds


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_rotary_in_place_on_a_strided_slice(interleaved):
    """q_pe = q[..., nope:] with an odd nope width, rotated in place: only the slice changes."""
    x, cos, sin = rotary_inputs(3, 5, 24, torch.float32)
    nope = torch.randn(3, 5, 7, generator=gen(5))
    q = torch.cat((nope, x), dim=-1).to(DEVICE)  # [N, H, nope + R]
    q_pe = q[..., 7:]
    out = apply_rotary(q_pe, cos.to(DEVICE), sin.to(DEVICE), interleaved, out=q_pe, impl="triton")
    assert out.data_ptr() == q_pe.data_ptr()
    assert_close(q[..., 7:], apply_rotary_ref(x, cos, sin, interleaved), torch.float32)
    torch.testing.assert_close(q[..., :7].cpu(), nope, atol=0, rtol=0)


def test_rotary_empty():
    x, cos, sin = rotary_inputs(0, 5, 16, torch.float32)
    assert apply_rotary(x.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), True, impl="triton").shape == (0, 5, 16)


# --- KV store ---------------------------------------------------------------------------------------

LAT, ROPE, BLOCK, BLOCKS = 24, 16, 4, 5
SLOTS = [7, -1, 0, 19, -1, 12]  # 19 = the last slot of the last block; -1 is skipped
STORE_DTYPES = [  # (activation dtype, cache dtype)
    (torch.float32, torch.float32),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.bfloat16, torch.float32),
    (torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("src,cache_dtype", STORE_DTYPES, ids=lambda d: DTYPE_ID.get(d, ""))
def test_store_kv(src, cache_dtype):
    g = gen(41)
    n = len(SLOTS)
    latent = torch.randn(n, LAT, generator=g).to(src)
    k_pe = torch.randn(n, ROPE, generator=g).to(src)
    slots = torch.tensor(SLOTS)
    want = torch.full((BLOCKS, BLOCK, LAT + ROPE), float("nan"), dtype=cache_dtype)
    store_kv_ref(latent, k_pe, want, slots)
    cache = torch.full_like(want, float("nan")).to(DEVICE)
    store_kv(latent.to(DEVICE), k_pe.to(DEVICE), cache, slots.to(DEVICE), impl="triton")
    cache = cache.cpu()

    written = torch.zeros(BLOCKS * BLOCK, dtype=torch.bool)
    written[[s for s in SLOTS if s >= 0]] = True
    rows = cache.view(-1, LAT + ROPE)
    assert rows[~written].isnan().all(), "a row no valid slot points at was touched"
    assert not rows[written].isnan().any()
    if (src, cache_dtype) == (torch.float32, torch.bfloat16):  # interpreter truncates (docstring)
        assert_close(rows[written], want.view(-1, LAT + ROPE)[written], torch.bfloat16)
    else:
        torch.testing.assert_close(cache, want, atol=0, rtol=0, equal_nan=True)


def test_store_kv_strided_inputs_and_int32_slots():
    """latent and k_pe as column slices of one [N, L+R] row (as in MLA), slots as int32."""
    g = gen(43)
    rows = torch.randn(3, LAT + ROPE + 2, generator=g)
    slots = torch.tensor([5, -1, 2], dtype=torch.int32)
    want = torch.full((BLOCKS, BLOCK, LAT + ROPE), float("nan"))
    store_kv_ref(rows[:, :LAT], rows[:, LAT : LAT + ROPE], want, slots.long())
    cache = torch.full_like(want, float("nan")).to(DEVICE)
    dev = rows.to(DEVICE)
    store_kv(dev[:, :LAT], dev[:, LAT : LAT + ROPE], cache, slots.to(DEVICE), impl="triton")
    torch.testing.assert_close(cache.cpu(), want, atol=0, rtol=0, equal_nan=True)
