"""The engine wired to the Triton kernels gives the same results as with the PyTorch references.

On CUDA, impl="auto" picks the Triton kernels; here (no GPU) every kernel module's dispatch is
forced to "triton" and the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set in
conftest.py). A tiny float32 model keeps the interpreter's per-program cost affordable. Two
prompts share a prefix so the second prefill attends over cached blocks, and both decode together.
"""

from __future__ import annotations

import pytest

import kernels.attention
import kernels.gate
import kernels.kv_store
import kernels.mla
import kernels.moe
import kernels.norm
import kernels.rotary
from engine import LLM, SamplingParams
from kernels.dispatch import resolve_impl
from tests.hf_reference import VARIANTS, build_hf_checkpoint

KERNEL_MODULES = (
    kernels.attention,
    kernels.gate,
    kernels.kv_store,
    kernels.mla,
    kernels.moe,
    kernels.norm,
    kernels.rotary,
)
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
PREFIX = [5, 9, 13, 17, 21, 25, 29, 33]
PROMPTS = [PREFIX + [40, 41, 42], PREFIX + [50, 51, 52, 53, 54]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_checkpoint(VARIANTS[0].values[0], tmp_path_factory.mktemp("triton-ckpt"), seed=3)


def _generate(model_dir) -> list:
    llm = LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=32)
    first = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=PARAMS)
    rest = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS)  # prefix-cache hits
    assert rest[1].num_cached_tokens == len(PREFIX)
    return first + rest


def test_engine_on_triton_kernels_matches_torch(model_dir, monkeypatch):
    expected = _generate(model_dir)
    calls: list[str] = []

    def forced(impl, tensor, *, has_triton):
        calls.append(impl)
        return "triton" if has_triton else resolve_impl(impl, tensor, has_triton=has_triton)

    for module in KERNEL_MODULES:
        monkeypatch.setattr(module, "resolve_impl", forced)
    got = _generate(model_dir)
    assert calls, "the model must go through the kernel dispatch"
    for want, out in zip(expected, got, strict=True):
        assert out.token_ids == want.token_ids
        for step_want, step_got in zip(want.logprobs, out.logprobs, strict=True):
            assert step_got.keys() == step_want.keys()
            for token, lp in step_want.items():
                assert step_got[token] == pytest.approx(lp, abs=1e-4)


def test_deepseek_v4_on_triton_kernels_matches_torch(tmp_path, monkeypatch):
    """DeepSeek-V4 (every layer type) with its kernels (kernels/v4.py: hyper-connections,
    compressor pooling, attention over slots) forced to Triton: the tokens and logprobs of the
    PyTorch path, the second prompt's prefill starting from the first's cached blocks and state."""
    import kernels.v4
    from tests.hf_reference import build_hf_v4_checkpoint
    from tests.test_parity_v4 import MIXED

    # Four Sinkhorn iterations, not 20: the interpreter runs each as ops of its own (the kernel's
    # 20 are checked in tests/test_triton_v4.py).
    v4_dir = build_hf_v4_checkpoint(MIXED | {"hc_sinkhorn_iters": 4}, tmp_path / "v4", seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3)

    def generate() -> list:
        llm = LLM(str(v4_dir), dtype="float32", block_size=8, num_kv_blocks=16)
        first = llm.generate(prompt_token_ids=PROMPTS[:1], sampling_params=params)
        second = llm.generate(prompt_token_ids=PROMPTS[1:], sampling_params=params)
        assert second[0].num_cached_tokens == len(PREFIX)
        return first + second

    expected = generate()
    calls: list[str] = []

    def forced(impl, tensor, *, has_triton):
        calls.append(impl)
        return "triton" if has_triton else resolve_impl(impl, tensor, has_triton=has_triton)

    monkeypatch.setattr(kernels.v4, "resolve_impl", forced)
    got = generate()
    assert len(calls) > 50
    for e, g in zip(expected, got, strict=True):
        assert g.token_ids == e.token_ids
        for le, lg in zip(e.logprobs, g.logprobs, strict=True):
            assert le.keys() == lg.keys() and all(abs(le[t] - lg[t]) < 1e-4 for t in le)
