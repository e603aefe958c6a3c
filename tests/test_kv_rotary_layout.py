"""KV moves between engines whatever kernels wrote it: the rotary half of every cached latent row
(k_pe) has one element order on every path, and the KV spec names it.

The hazard this guards against: a worker computing on the PyTorch CPU path and one on the Triton
kernels (a GPU worker) exchange KV over a transfer or the shared Redis tier. If the two paths
stored k_pe in different orders, the importer's queries would meet permuted keys and decode
different tokens with no error. Here the producer prefills on the CPU path; the consumer runs
every kernel through Triton (the interpreter, conftest.py) and continues the request from the
imported blocks; it must give the tokens the producer gives when it runs the whole request.
"""

from __future__ import annotations

import pytest
import torch

import kernels.rotary
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.kv_cache.codec import read_slab, write_slab
from engine.sampling_params import SamplingParams
from kernels.dispatch import resolve_impl
from tests.engine_testing import run_finished
from tests.hf_reference import VARIANTS, build_hf_checkpoint
from tests.test_engine_triton import KERNEL_MODULES

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
PROMPT = [5, 9, 13, 17, 21, 25, 29, 33, 40]  # two full blocks of 4 and a partial one


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_hf_checkpoint(VARIANTS[0].values[0], tmp_path_factory.mktemp("rope-ckpt"), seed=3)


def _core(model_dir) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(model_dir), dtype="float32", block_size=4, num_kv_blocks=16, num_threads=1)
    )


def _force_triton(monkeypatch) -> list[str]:
    calls: list[str] = []

    def forced(impl, tensor, *, has_triton):
        calls.append(impl)
        return "triton" if has_triton else resolve_impl(impl, tensor, has_triton=has_triton)

    for module in KERNEL_MODULES:
        monkeypatch.setattr(module, "resolve_impl", forced)
    return calls


def test_every_rotary_path_writes_the_layout_the_spec_names():
    """The float32 CPU fast path, the generic reference and the Triton kernel agree element for
    element on interleaved and split-halves inputs, and the layout is the spec's."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen)
    angles = torch.rand(5, 8, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    for interleaved in (True, False):
        ref = kernels.rotary.apply_rotary_ref(x, cos, sin, interleaved)
        fast = kernels.rotary.apply_rotary(x, cos, sin, interleaved, impl="torch")
        triton = kernels.rotary.apply_rotary(x, cos, sin, interleaved, impl="triton")
        torch.testing.assert_close(fast, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(triton, ref, rtol=1e-5, atol=1e-5)
    assert kernels.rotary.OUTPUT_LAYOUT == "halves"
    # First members of every pair, then the second members (pair i = dims 2i, 2i+1 interleaved).
    first = x[..., 0::2] * cos[:, None] - x[..., 1::2] * sin[:, None]
    torch.testing.assert_close(kernels.rotary.apply_rotary(x, cos, sin, True)[..., :8], first)


def test_kv_written_on_the_cpu_path_decodes_the_same_on_triton_kernels(model_dir, monkeypatch):
    producer, consumer = _core(model_dir), _core(model_dir)
    assert producer.kv_spec.compat_hash() == consumer.kv_spec.compat_hash()
    producer.add_request("whole", PROMPT, PARAMS)
    whole = run_finished(producer)["whole"]

    producer.add_request("r", PROMPT, PARAMS, kv_export=True)
    first = run_finished(producer)["r"]
    kv = first.exported_kv
    consumer.begin_import("r", PROMPT, first.token_ids, PARAMS, kv.generator_state)
    assert consumer.handover.allocate_import("r") == 0
    layers = producer.kv_spec.num_caches
    data = read_slab(producer.kv_spec, producer.runner.kv_caches, kv.block_ids, 0, layers)
    write_slab(consumer.kv_spec, consumer.runner.kv_caches, consumer.requests["r"].block_ids[0], 0, data)
    consumer.handover.finish_import("r")
    assert producer.handover.release_export("r")

    calls = _force_triton(monkeypatch)
    final = run_finished(consumer)["r"]
    assert calls, "the consumer must run through the kernel dispatch"
    assert final.token_ids == whole.token_ids
    for got, want in zip(first.logprobs + final.logprobs, whole.logprobs, strict=True):
        assert got.keys() == want.keys()
        for token, lp in want.items():
            assert got[token] == pytest.approx(lp, abs=1e-4)
