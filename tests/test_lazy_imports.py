"""Heavy imports only where they run: triton only when a Triton kernel runs (kernels/jit), so an
engine on the CPU's native kernels and torch never maps its compiler; torch never in the router,
which moves token ids and text (~190 MiB less resident per router)."""

from __future__ import annotations

import sys

from tests.bench_testing import run_python

SCRIPT = """
import sys
import torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams
import services.cli
llm = LLM(sys.argv[1], dtype="bfloat16", num_threads=1)
out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=3, temperature=0.0))
assert len(out[0].token_ids) == 3
print("triton" in sys.modules, "kernels.jit.norm" in sys.modules)
"""


def test_a_cpu_engine_never_imports_triton(tiny_model):
    res = run_python("-c", SCRIPT, tiny_model, timeout=300, unset=("TRITON_INTERPRET",))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["False", "False"]


def test_a_triton_launch_imports_its_kernels():
    import torch

    from kernels.norm import rms_norm

    x, w = torch.randn(3, 32), torch.randn(32)
    out = rms_norm(x, w, 1e-6, impl="triton")  # under TRITON_INTERPRET (conftest)
    assert "kernels.jit.norm" in sys.modules
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6, impl="torch"))


def test_the_router_never_imports_torch(serving_stack):
    """After start-up and a streamed completion, the router process has not mapped libtorch."""
    from pdserve.v1 import inference_pb2 as pb
    from tests.service_testing import inference

    stub = inference(serving_stack)
    request = pb.GenerateRequest(
        text="hello there", sampling=pb.SamplingParams(max_tokens=3, ignore_eos=True)
    )
    assert sum(len(m.token_ids) for m in stub.Generate(request, timeout=60)) == 3
    router = next(p for p in serving_stack.procs if p.name == "router")
    with open(f"/proc/{router.popen.pid}/maps") as f:
        assert not any("libtorch" in line for line in f)
