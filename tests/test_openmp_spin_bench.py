"""`benchmarks/openmp_spin.py` as a user runs it, on the tiny model: each setting's processes run
both workloads with their own OpenMP environment, and the ratios follow."""

from __future__ import annotations

import pytest

from benchmarks.openmp_spin import environment
from tests.bench_testing import run_benchmark, saved_result


def test_openmp_spin_smoke(tiny_model, tmp_path):
    out = tmp_path / "spin.json"
    args = ["--model", tiny_model, "--concurrency", "3", "--prompt-len", "8", "--output-len", "3"]
    proc = run_benchmark(
        "openmp_spin.py", *args, "--rounds", "1", "--pairs", "2", "--settings", "300000,passive",
        "--threads", "1", "--output", str(out), timeout=300,
    )  # fmt: skip
    result = saved_result(proc, out)
    assert [row["setting"] for row in result["results"]] == ["300000", "passive"]
    first, second = result["results"]
    assert first["offline_ratio"] == first["arriving_ratio"] == 1.0
    for row in result["results"]:
        assert len(row["runs"]) == 2 and all(
            run["offline"] > 0 and run["arriving"] > 0 for run in row["runs"]
        )
    base = sorted(run["offline"] for run in first["runs"])
    mine = sorted(run["offline"] for run in second["runs"])
    assert second["offline_ratio"] == pytest.approx((mine[0] + mine[1]) / (base[0] + base[1]))


def test_each_setting_names_one_openmp_variable(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1")
    spin, passive = environment("30000"), environment("passive")
    assert spin["GOMP_SPINCOUNT"] == "30000" and "OMP_WAIT_POLICY" not in spin
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in passive
