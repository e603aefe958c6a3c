"""`benchmarks/ab_revisions.py` as a user runs it, on the tiny model: both sides run in their own
checkouts, every round reports tokens/s, batch-1 latency and CPU time, and the ratios follow."""

from __future__ import annotations

import subprocess

import pytest

from tests.bench_testing import REPO, head_revision, run_benchmark, saved_result


def test_ab_revisions_smoke(tiny_model, tmp_path):
    out = tmp_path / "ab.json"
    args = ["--baseline", head_revision(), "--model", tiny_model, "--dtype", "float32", "--threads", "1"]
    args += ["--num-prompts", "2", "--prompt-len", "8", "--output-len", "4", "--rounds", "1"]
    args += ["--kv-cache-gib", "0.05", "--output", str(out)]
    proc = run_benchmark("ab_revisions.py", *args, timeout=300)
    result = saved_result(proc, out)
    assert result["candidate"].endswith("+ working tree")
    for side in ("baseline", "candidate"):
        [run] = result["runs"][side]
        assert run["tok_per_s"] > 0 and run["batch1_ms_per_token"] > 0 and run["cpu_seconds"] > 0
    b, c = result["median"]["baseline"], result["median"]["candidate"]
    assert result["ratios"] == pytest.approx(
        {
            "tok_per_s": c["tok_per_s"] / b["tok_per_s"],  # rates: candidate / baseline
            "batch1_ms_per_token": b["batch1_ms_per_token"] / c["batch1_ms_per_token"],  # times: inverted
            "cpu_seconds": b["cpu_seconds"] / c["cpu_seconds"],
        }
    )
    worktrees = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "list"], capture_output=True, text=True
    ).stdout
    assert "pdserve-ab-" not in worktrees  # the baseline checkout is gone again
