"""benchmarks/kernels_gpu.py, the one-shot GPU check-and-benchmark script, run here with --smoke:
the same code paths on tiny shapes on CPU under the Triton interpreter. What only the GPU run
can tell (real tolerances at full size, timings, compilation for sm_90) is not checked here."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from tests.bench_testing import run_benchmark

KERNELS = {
    "mla_decode",
    "extend_attention",
    "merge_attn_states",
    "fused_moe",
    "grouped_topk",
    "rms_norm",
    "apply_rotary",
    "store_kv",
    "act_quant",
    "w8a8_linear",
    "fused_moe_fp8",
    "fused_moe_mxfp4",
    "v4_hc",
    "v4_compress_pool",
    "v4_attention",
}
TIMED = {
    "mla_decode",
    "fused_moe",
    "extend_attention",
    "w8a8_linear",
    "fused_moe_fp8",
    "fused_moe_mxfp4",
    "v4_hc",
    "v4_attention",
}


def run_script(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("kernels_gpu.py", *args, env={"TRITON_INTERPRET": "1"})


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path_factory.mktemp("kernels_gpu")
    proc = run_script("--smoke", "--out", str(out))
    files = list(out.glob("kernels_gpu_*.json"))
    payload = json.loads(files[0].read_text()) if len(files) == 1 else {}
    return proc, payload


def test_smoke_exits_zero_and_every_kernel_passes(smoke):
    proc, _ = smoke
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    verdicts = {}  # kernel -> the verdict column of the summary table
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] in KERNELS and fields[1] in ("PASS", "FAIL"):
            verdicts[fields[0]] = fields[1]
    assert verdicts == dict.fromkeys(KERNELS, "PASS"), proc.stdout[-4000:]
    assert "FAIL" not in proc.stdout and "ERROR" not in proc.stdout


def test_smoke_json(smoke):
    proc, payload = smoke
    assert payload, f"no single result file; stdout:\n{proc.stdout[-4000:]}"
    expected = {"date", "git", "hardware", "mode", "device", "dtype", "peaks", "goals", "shapes"}
    expected |= {"calibration", "checks", "timings", "errors", "notes", "summary", "elapsed_s"}
    assert expected <= payload.keys()
    assert payload["mode"] == "smoke" and payload["dtype"] == "bfloat16"
    assert payload["errors"] == [] and payload["summary"]["failed"] == []
    assert {c["kernel"] for c in payload["checks"]} == KERNELS
    for check in payload["checks"]:
        assert check["pass"] is True and check["outputs"], check
        assert isinstance(check["max_abs_err"], float)
    assert {t["kernel"] for t in payload["timings"]} == TIMED
    for row in payload["timings"]:
        assert row["triton_ms"] > 0 and "gb_s" in row and "tflops" in row and "pct_roofline" in row, row
    assert any("goal" in row and row["goal_met"] is None for row in payload["timings"])  # n/a on CPU
    assert any(row["skipped"] for row in payload["timings"])  # the reference cap was exercised
    assert {"matmul", "copy"} <= payload["calibration"].keys()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_without_gpu_and_smoke_exits_with_a_message():
    proc = run_script()
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
