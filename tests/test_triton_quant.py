"""The Triton kernels for weights kept quantized (kernels/jit/quant.py, fused_moe_quant_kernel) on
CPU tensors under the Triton interpreter, against their PyTorch references and a float64 product
of the weights dequantized from their bytes: the per-token group quantization of activations
(bytes and scales exactly), the block-FP8 GEMM (w8a8) over partial blocks, 128 and 32 wide, one
row and many, and the fused MoE with FP8 (w8a8) and MXFP4 (weight-only) experts, pairs routed to
-1 and experts without tokens."""

from __future__ import annotations

import pytest
import torch

from engine.quant import expand_scale_rows
from kernels.moe import fused_moe_quant, fused_moe_quant_ref, fused_moe_quant_triton
from kernels.quant import QuantWeight, act_quant, act_quant_ref, linear, w8a8_linear, w8a8_linear_ref
from modelkit.quantize import quantize_fp8, quantize_mxfp4
from tests.kernel_testing import gen, one_thread  # noqa: F401 (fixture)


def fp8_weight(w: torch.Tensor, block: int) -> QuantWeight:
    q, grid = quantize_fp8(w, (block, block), False)
    return QuantWeight("fp8", q, expand_scale_rows(grid, w.shape[0], block).contiguous(), block)


@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32", "ue8m0"])
@pytest.mark.parametrize("rows, k, group", [(1, 200, 128), (5, 96, 32), (3, 7, 32)])
def test_act_quant_matches_the_reference_bytes(rows, k, group, ue8m0):
    x = torch.randn(rows, k, generator=gen(k)) * torch.logspace(-3, 3, rows)[:, None]
    x[0, :3] = 0.0
    if rows > 2:
        x[2] = 0.0  # an all-zero group: the 1e-10 floor
    q, scale = act_quant(x, group, ue8m0, impl="triton")
    q_ref, scale_ref = act_quant_ref(x, group, ue8m0)
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    # The reference itself: within half an e4m3 step (2^-4 relative) of x, scales from amax.
    xd = q_ref.double() * scale_ref.double().repeat_interleave(group, 1)[:, :k]
    assert ((xd - x.double()).abs() <= x.double().abs() * 2.0**-4 + 2.0**-9 * scale_ref.max().item()).all()


@pytest.mark.parametrize("m, n, k, block", [(1, 40, 200, 128), (17, 72, 160, 32), (33, 16, 64, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_block_fp8_gemm_matches_the_reference(m, n, k, block, dtype):
    g = gen(m + n)
    w = fp8_weight(torch.randn(n, k, generator=g), block)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    y = w8a8_linear(x, w, bias, impl="triton")
    ref = w8a8_linear_ref(x, w, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y, ref, **tol)
    # Against the exact product of the stored weight: the activations' quantization error only.
    exact = x.double() @ w.dequantize(torch.float64).T + bias.double()
    err = (y.double() - exact).abs().max() / exact.abs().max()
    assert err < 0.03
    # The dispatch: an FP8 weight under "triton" takes this GEMM.
    torch.testing.assert_close(linear(x, w, bias, impl="triton"), y, atol=0, rtol=0)


def experts(fmt: str, e: int, n: int, k: int, g: torch.Generator) -> QuantWeight:
    w = torch.randn(e * n, k, generator=g) / k**0.5
    if fmt == "mxfp4":
        one = QuantWeight("mxfp4", *quantize_mxfp4(w), 32)
    else:
        one = fp8_weight(w, 32)
    return QuantWeight(one.fmt, one.data.view(e, n, -1), one.scale.view(e, n, -1), one.block_k)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_quant_matches_the_reference(fmt, dtype):
    g = gen(7)
    num_experts, hidden, inter, top_k, tokens = 6, 64, 32, 2, 5
    w13, w2 = experts(fmt, num_experts, 2 * inter, hidden, g), experts(fmt, num_experts, hidden, inter, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.tensor([[0, 3], [3, -1], [5, 0], [3, 5], [0, 3]])  # experts 1, 2, 4 without tokens
    weights = torch.rand(tokens, top_k, generator=g)
    got = fused_moe_quant_triton(x, w13, w2, weights, ids)
    ref = fused_moe_quant_ref(x, w13, w2, weights, ids)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    # And the exact float64 MoE of the stored weights: within the activations' quantization (FP8).
    exact = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j, e in enumerate(ids[t].tolist()):
            if e >= 0:
                gu = x[t].double() @ w13[e].dequantize(torch.float64).T
                act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
                exact[t] += weights[t, j].double() * (act @ w2[e].dequantize(torch.float64).T)
    bound = 0.05 if dtype == torch.float32 else 0.1  # bf16: gate_up and the activations rounded too
    assert (got.double() - exact).abs().max() < bound * exact.abs().max()
    # fused_moe_quant under "triton" takes this path.
    torch.testing.assert_close(fused_moe_quant(x, w13, w2, weights, ids, impl="triton"), got, atol=0, rtol=0)
