"""kernels/native: the AVX512-BF16 one-row products, against float32 sums rounded to bf16, and
the torch path everywhere they cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import env
from kernels import linear as linear_mod
from kernels import native

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
]


@pytest.fixture(scope="module")
def loaded() -> bool:
    from pathlib import Path

    return native.load(Path(env.native_build_dir()))  # where the engines of the other tests build them


def _want(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 sums of the exact products, rounded once to bf16: what VDPBF16PS and torch's bf16
    BLAS compute, up to the order of the float32 additions."""
    return torch.matmul(x.float(), w.float().transpose(-1, -2))


def test_loads_exactly_where_the_cpu_has_the_instructions(loaded):
    assert loaded == native.supported() == native.loaded()
    assert native.supported() == all(f in native.cpu_flags() for f in native.REQUIRED_FLAGS)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-M{}-N{}-K{}".format(*s))
def test_linear_bf16_equals_float32_sums_rounded(loaded, shape):
    if not loaded:  # no AVX512-BF16 here: the torch path serves, and the native one refuses
        with pytest.raises(AssertionError, match="load"):
            native.linear_bf16(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16))
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
    torch.testing.assert_close(got.float(), torch.bmm(q.transpose(0, 1).float(), heads.float()), rtol=2**-7, atol=1e-3)


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


def test_kernels_linear_takes_one_bf16_row_natively(loaded, monkeypatch):
    """One bf16 row goes native where loaded; two rows, float32 and strided weights stay on torch."""
    calls = []
    real = native.linear_bf16
    monkeypatch.setattr(native, "linear_bf16", lambda x, w: calls.append(x.shape) or real(x, w))
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=gen).bfloat16()
    for rows in (1, 2):
        x = torch.randn(rows, 96, generator=gen).bfloat16()
        y = linear_mod.linear(x, w)
        torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), rtol=2**-7, atol=1e-2)
    linear_mod.linear(torch.randn(1, 96), w.float())
    linear_mod.linear(torch.randn(1, 64).bfloat16(), w.t())
    assert calls == ([torch.Size([1, 96])] if loaded else [])


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
        assert llm.engine.runner.native_kernels == (side == "native" and loaded)
        errors[side] = _decode_error(llm, ref)
    assert 0 < errors["torch"] < 0.5, errors  # bf16 is off the float32 reference, but not far
    assert errors["native"] <= 1.5 * errors["torch"] + 0.01, errors
