"""`benchmarks/step_profile.py` as a user runs it, on the tiny model: every batch gets a step time,
its time by module region and its op counts, written where --output says."""

from __future__ import annotations

from tests.bench_testing import run_benchmark, saved_result


def test_step_profile_smoke(tiny_model, tmp_path):
    out = tmp_path / "profile.json"
    args = ["--model", tiny_model, "--dtype", "float32", "--batches", "1,3", "--context", "16"]
    args += ["--steps", "2", "--warmup", "1", "--kv-cache-gib", "0.05", "--output", str(out)]
    proc = run_benchmark("step_profile.py", *args, timeout=180)
    rows = saved_result(proc, out)["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    for r in rows:
        assert r["ms_per_step"] > 0 and r["aten_ops_per_step"] > 0
        assert {"attention", "moe", "norm"} <= set(r["regions_ms"]) and r["regions_ms"]["attention"] > 0
        assert r["top_ops"] and all(op["calls"] > 0 for op in r["top_ops"])
    assert out.with_suffix(".txt").read_text().startswith("B=1:")
