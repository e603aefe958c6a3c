"""`benchmarks/attention_ab.py` as a user runs it, on the tiny model's shapes: both sides' native
kernels built in their own checkouts, each batch timed on each, and the ratio follows."""

from __future__ import annotations

import subprocess

import pytest

from kernels import native
from tests.bench_testing import REPO, head_revision, run_benchmark, saved_result


@pytest.mark.parametrize("flags", [[], ["--avx2"]], ids=["this-cpu", "avx2-build"])
def test_attention_ab_smoke(tiny_model, tmp_path, flags):
    out = tmp_path / "attention.json"
    args = [
        "--baseline",
        head_revision(),
        "--model",
        tiny_model,
        "--batches",
        "1,5",
        "--context",
        "40",
        *flags,
    ]
    args += ["--candidate-path", "vdpbf16ps"]  # the baseline's default: the tiles where the CPU has them
    proc = run_benchmark(
        "attention_ab.py", *args, "--rounds", "2", "--threads", "1", "--output", str(out), timeout=600
    )
    if not native.supported():
        assert proc.returncode == 1 and "do not run on this CPU" in proc.stdout
        return
    result = saved_result(proc, out)
    assert [row["batch"] for row in result["results"]] == [1, 5] and result["context"] == 40
    unit = result["baseline_path"] == "tiles"  # where the CPU has the unit (and Linux grants it)
    assert unit <= (native.AMX_FLAGS <= native.cpu_flags())
    assert result["candidate_path"] == "vdpbf16ps"
    assert (result["build"] == "AVX2") is ("--avx2" in flags)
    assert not (unit and flags)  # the AVX2 build has no tiles
    for row in result["results"]:
        assert row["baseline_ms"] > 0 and row["candidate_ms"] > 0
        assert row["speedup"] == pytest.approx(row["baseline_ms"] / row["candidate_ms"])
        # The working tree here is the baseline's code: on one path, both sides compute the same bits.
        assert row["same_bits"] or unit
    worktrees = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert "pdserve-attention-ab-" not in worktrees  # the baseline checkout is gone again
