"""The native kernels' products with weights kept quantized (kernels/native/quantized.h): FP8 with
block scales and MXFP4, widened as they are read, against a float64 reference dequantized from the
stored bytes (kernels/quant.py), over odd shapes, on each form the build has (the AVX2 build's own
and the AVX-512 code on its emulation); every e4m3 and e2m1 code widened exactly; a row's bits
whatever rows run beside it; the routed and shared experts (moe_topk) against the torch loop."""

from __future__ import annotations

import pytest
import torch

from engine.quant import expand_scale_rows
from kernels import native
from kernels.moe import fused_moe_quant
from kernels.quant import QuantWeight
from modelkit.quantize import quantize_fp8, quantize_mxfp4


@pytest.fixture(scope="module")
def loaded() -> None:
    from engine.platform import load_native

    if not load_native():
        pytest.fail("the native kernels must load on this CPU (tests/test_native_install.py says why not)")


@pytest.fixture(params=["own", "generic"])
def form(request, loaded):
    """The build's own quantized products, and (the AVX2 build) the AVX-512 builds' code on its
    emulation; an AVX-512 build has the one form, run twice."""
    before = native.use_quant_generic(request.param == "generic")
    yield request.param
    native.use_quant_generic(before)


def fp8_weight(w: torch.Tensor, block: int, ue8m0: bool = False) -> QuantWeight:
    q, grid = quantize_fp8(w, (block, block), ue8m0)
    return QuantWeight("fp8", q, expand_scale_rows(grid, w.shape[0], block).contiguous(), block)


def mxfp4_weight(w: torch.Tensor) -> QuantWeight:
    return QuantWeight("mxfp4", *quantize_mxfp4(w), 32)


def check_close(y: torch.Tensor, x: torch.Tensor, w: QuantWeight) -> None:
    """y (bf16) against x @ w^T in float64 from the stored bytes: within y's rounding to bf16 and
    the float32 sums' error (K terms of |x| |w|)."""
    wd = w.dequantize(torch.float64)
    ref = x.double() @ wd.T
    bound = ref.abs() * 2.0**-8 + (x.double().abs() @ wd.abs().T) * (x.shape[1] * 2.0**-24) + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"worst {(err / bound).max().item():.2f}x the bound"


SHAPES = [
    (1, 37, 200, 128),
    (1, 16, 32, 32),
    (2, 33, 300, 128),
    (5, 64, 256, 32),
    (7, 100, 96, 32),
    (13, 33, 160, 32),
    (256, 48, 160, 128),
]
"""(rows, N, K, block_k): one row, 256, K past the last whole block, N past the last tile of 16,
odd rows and columns past the few-row limit (the AVX2 form's tile, three rows over two columns)."""


@pytest.mark.parametrize(
    "fmt, rows, n, k, block",
    [
        (fmt, *shape)
        for fmt in ("fp8", "fp8-ue8m0", "mxfp4")
        for shape in SHAPES
        if fmt != "mxfp4" or shape[2] % 32 == 0
    ],
)  # MXFP4's K is a multiple of 32 by its format
def test_products_match_the_dequantized_reference(form, fmt, rows, n, k, block):
    g = torch.Generator().manual_seed(rows * 1000 + k)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3
    w[0, :7] = 1e-6  # e4m3 subnormals after the block's scale
    qw = mxfp4_weight(w) if fmt == "mxfp4" else fp8_weight(w, block, ue8m0=fmt == "fp8-ue8m0")
    x = torch.randn(rows, k, generator=g).bfloat16()
    y = native.few_rows_quant_linear(x, qw)
    assert y is not None and y.shape == (rows, n) and y.dtype is torch.bfloat16
    check_close(y, x, qw)
    # A row's bits whatever rows run beside it: one row alone (the register path) against the same
    # row among the others (the tile path).
    for i in {0, rows // 2, rows - 1}:
        assert torch.equal(native.few_rows_quant_linear(x[i : i + 1], qw)[0], y[i])


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_every_code_widens_exactly(form, fmt):
    """One-hot rows of x pick single weights: y is every e4m3 code (subnormals, both zeros, 448)
    or e2m1 code times a power-of-two scale, exactly."""
    k = 256
    if fmt == "fp8":
        codes = torch.arange(256, dtype=torch.uint8)
        codes[codes & 0x7F == 0x7F] = 0  # e4m3's two NaNs: checkpoints hold none
        data = codes.view(torch.float8_e4m3fn).reshape(1, k).repeat(3, 1)
        scale = torch.tensor([[1.0, 2.0**-10], [2.0**6, 1.0], [0.5, 4.0]])
        qw = QuantWeight("fp8", data, scale, 128)
    else:
        every = torch.arange(256, dtype=torch.int32)  # every pair of codes, a byte each, over the rows
        data = torch.stack([every[:128], every[128:], (every[:128] * 7 + 3) % 256]).to(torch.uint8)
        scale = torch.tensor([[127] * 8, [120] * 8, [140] * 8], dtype=torch.uint8)
        qw = QuantWeight("mxfp4", data, scale, 32)
    x = torch.eye(k, dtype=torch.bfloat16)
    y = native.few_rows_quant_linear(x, qw)
    want = qw.dequantize(torch.float64).T
    assert torch.equal(y.double(), want)  # every value a bf16 value: no rounding anywhere
    if fmt == "fp8":  # and the reference is torch's own e4m3 decoding
        assert torch.equal(codes[:128].view(torch.float8_e4m3fn).double(), want[:128, 0])


def test_shapes_the_kernels_do_not_take_go_to_torch(loaded):
    w = torch.randn(40, 64)
    q, grid = quantize_fp8(w, (16, 16), False)
    odd_block = QuantWeight("fp8", q, expand_scale_rows(grid, 40, 16).contiguous(), 16)
    assert not native.takes_weight(odd_block)
    x = torch.randn(2, 64).bfloat16()
    assert native.few_rows_quant_linear(x, odd_block) is None
    assert native.few_rows_quant_linear(x.float(), fp8_weight(w, 32)) is None  # float32 x: torch's
    assert native.few_rows_quant_linear(torch.randn(2, 32).bfloat16(), fp8_weight(w, 32)) is None  # K differs


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_per_head_products_match_the_reference_and_each_heads_own_call(form, rows):
    """linear_heads (MLA's absorbed products with kv_b_proj kept FP8): every head's weight a strided
    view of one kv_b-like weight, as W_UV is ([H, v, L] of [H, nope + v, L]), x a transposed view as
    the queries are ([H, M, K] of [M, H, K]): each head against float64 from the stored bytes, and
    bit for bit the one-head product of that head's weight alone."""
    g = torch.Generator().manual_seed(rows)
    heads, nope, v, k = 3, 32, 48, 160
    kv_b = fp8_weight(torch.randn(heads * (nope + v), k, generator=g), 32)
    data, scale = kv_b.data.view(heads, nope + v, k), kv_b.scale.view(heads, nope + v, -1)
    w = QuantWeight("fp8", data[:, nope:], scale[:, nope:], 32)  # [H, v, K], heads (nope + v) rows apart
    x = torch.randn(rows, heads, k, generator=g).bfloat16().transpose(0, 1)  # [H, M, K]
    y = native.linear_heads(x, w)
    assert y.shape == (heads, rows, v) and y.dtype is torch.bfloat16
    for h in range(heads):
        check_close(y[h], x[h], w[h])
        alone = native.few_rows_quant_linear(x[h].contiguous(), QuantWeight("fp8", w.data[h], w.scale[h], 32))
        assert torch.equal(y[h], alone)
    with pytest.raises(ValueError, match="share B and K"):
        native.linear_heads(x[:2], w)


def experts(fmt: str, e: int, n: int, k: int, g: torch.Generator) -> QuantWeight:
    w = torch.randn(e * n, k, generator=g) / k**0.5
    one = mxfp4_weight(w) if fmt == "mxfp4" else fp8_weight(w, 128)
    return QuantWeight(one.fmt, one.data.view(e, n, -1), one.scale.view(e, n, -1), one.block_k)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_moe_matches_the_torch_loop_and_keeps_a_tokens_bits(form, fmt):
    g = torch.Generator().manual_seed(5)
    num_experts, hidden, inter, top_k = 8, 192, 96, 3
    w13, w2 = experts(fmt, num_experts, 2 * inter, hidden, g), experts(fmt, num_experts, hidden, inter, g)
    s13, s2 = experts("fp8", 1, 2 * 64, hidden, g)[0], experts("fp8", 1, hidden, 64, g)[0]
    x = torch.randn(6, hidden, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(6)])
    ids[2, 1] = -1  # an expert on another rank
    weights = torch.rand(6, top_k, generator=g)
    out = torch.zeros_like(x)
    native.moe_topk(x, w13, w2, out, ids, weights, (s13, s2))
    # The torch loop's arithmetic in float64 on the dequantized weights (the kernel rounds as the
    # bf16 loop does: a few bf16 roundings per expert).
    ref = torch.zeros(6, hidden, dtype=torch.float64)
    for t in range(6):
        for j, e in enumerate(ids[t].tolist()):
            if e >= 0:
                gu = x[t].double() @ w13[e].dequantize(torch.float64).T
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                ref[t] += weights[t, j].double() * (act @ w2[e].dequantize(torch.float64).T)
        gu = x[t].double() @ s13.dequantize(torch.float64).T
        ref[t] += (torch.nn.functional.silu(gu[:64]) * gu[64:]) @ s2.dequantize(torch.float64).T
    err = (out.double() - ref).abs().max().item()
    assert err <= 0.02 * ref.abs().max().item(), err
    # fused_moe_quant takes the kernel here; the same bits for a token alone as among the others.
    for t in (0, 2, 5):
        alone = fused_moe_quant(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], (s13, s2))
        assert torch.equal(alone[0], out[t])
    bad = ids.clone()
    bad[4, 0] = num_experts
    with pytest.raises(ValueError, match="expert ids"):
        native.moe_topk(x, w13, w2, out, bad, weights, None)


@pytest.mark.parametrize(
    "nope, v, block, kept",
    [(32, 32, 32, True), (64, 64, 128, True), (128, 128, 128, True), (32, 16, 32, False)],
    ids=["32x32-grid", "bench-like", "v3-like", "heads-across-blocks"],
)
@torch.inference_mode()
def test_mla_keeps_kv_b_fp8_for_its_absorbed_products(loaded, nope, v, block, kept):
    """MLA's absorbed products read kv_b_proj's FP8 bytes (W_UK transposed with its scales, W_UV a
    view) where each head's nope rows sit in whole row blocks of the grid, and dequantize it once
    where they do not (a head starting mid-block): either way the matrices are kv_b_proj's
    values, and absorb / unabsorb agree with float64 products of them."""
    from engine.config import ModelConfig
    from engine.models.mla import MLAttention

    heads, latent = 3, 160
    cfg = ModelConfig.from_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 64,
        "hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": heads,
        "kv_lora_rank": latent, "q_lora_rank": 64, "qk_nope_head_dim": nope, "qk_rope_head_dim": 16,
        "v_head_dim": v, "max_position_embeddings": 64,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block]},
    })  # fmt: skip
    attn = MLAttention(cfg, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(nope + v)
    kv_b = fp8_weight(torch.randn(heads * (nope + v), latent, generator=g), block)
    attn.kv_b_proj.weight.copy_(kv_b.data)
    attn.kv_b_proj.weight_scale.copy_(kv_b.scale)
    attn.process_weights()
    assert isinstance(attn.w_uk_t, QuantWeight) == kept and isinstance(attn.w_uv, QuantWeight) == kept
    values = kv_b.dequantize(torch.float64).view(heads, nope + v, latent)
    if not kept:  # dequantized once, to bf16
        values = values.bfloat16().double()

    def dense(w):
        return w.dequantize(torch.float64) if isinstance(w, QuantWeight) else w.double()

    assert torch.equal(dense(attn.w_uk_t), values[:, :nope].transpose(1, 2))
    assert torch.equal(dense(attn.w_uv), values[:, nope:])
    if kept:  # W_UV is kv_b_proj's own bytes
        assert (
            attn.w_uv.data.untyped_storage().data_ptr() == attn.kv_b_proj.weight.untyped_storage().data_ptr()
        )
    q_nope = torch.randn(2, heads, nope, generator=g).bfloat16()
    o_lat = torch.randn(2, heads, latent, generator=g).bfloat16()
    assert attn.absorbs_natively(q_nope)
    for got, x, w in (
        (attn.absorb(q_nope, True), q_nope, values[:, :nope]),  # q_lat = q_nope @ W_UK
        (attn.unabsorb(o_lat, True), o_lat, values[:, nope:].transpose(1, 2)),  # o = o_lat @ W_UV^T
    ):
        ref = torch.einsum("nhk,hkj->nhj", x.double(), w)
        bound = ref.abs() * 2.0**-8 + torch.einsum("nhk,hkj->nhj", x.double().abs(), w.abs()) * 2.0**-16
        assert ((got.double() - ref).abs() <= bound).all()
