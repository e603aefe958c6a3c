"""`benchmarks/openmp_spin.py` as a user runs it, on the tiny model: each setting's processes run
both workloads with their own OpenMP environment, and the ratios follow."""

from __future__ import annotations

import pytest

from benchmarks.openmp_spin import environment
from tests.bench_testing import run_benchmark, saved_result


def test_openmp_spin_smoke(tiny_model, tmp_path):
    out = tmp_path / "spin.json"
    args = ["--model", tiny_model, "--concurrency", "3", "--prompt-len", "8", "--output-len", "3"]
    # One pair: a process per setting (each loads torch and builds an engine, most of the time).
    proc = run_benchmark(
        "openmp_spin.py", *args, "--rounds", "1", "--pairs", "1", "--settings", "300000,passive",
        "--threads", "1", "--output", str(out), timeout=300,
    )  # fmt: skip
    result = saved_result(proc, out)
    assert [row["setting"] for row in result["results"]] == ["300000", "passive"]
    first, second = result["results"]
    assert first["offline_ratio"] == first["arriving_ratio"] == 1.0
    for row in result["results"]:
        [run] = row["runs"]
        assert run["offline"] > 0 and run["arriving"] > 0
        assert row["offline_tok_s"] == run["offline"] and row["arriving_tok_s"] == run["arriving"]
    for workload in ("offline", "arriving"):
        ratio = second["runs"][0][workload] / first["runs"][0][workload]
        assert second[f"{workload}_ratio"] == pytest.approx(ratio)
        assert second[f"{workload}_paired_ratio"] == pytest.approx(ratio)


def test_each_setting_names_one_openmp_variable(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "1")
    spin, passive = environment("30000"), environment("passive")
    assert spin["GOMP_SPINCOUNT"] == "30000" and "OMP_WAIT_POLICY" not in spin
    assert passive["OMP_WAIT_POLICY"] == "PASSIVE" and "GOMP_SPINCOUNT" not in passive
