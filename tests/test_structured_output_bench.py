"""`benchmarks/structured_output.py` as a user runs it, on the tiny model: every batch gets both
rates and their ratio, and the compile times, written where --output says."""

from __future__ import annotations

from tests.bench_testing import run_benchmark, saved_result


def test_structured_output_bench_smoke(tiny_model, tmp_path):
    out = tmp_path / "structured.json"
    args = ["--model", tiny_model, "--dtype", "float32", "--batches", "1,3", "--prompt-len", "8"]
    args += ["--max-tokens", "6", "--rounds", "2", "--kv-cache-gib", "0.05", "--output", str(out)]
    proc = run_benchmark("structured_output.py", *args, timeout=180)
    result = saved_result(proc, out)
    assert [r["batch"] for r in result["rows"]] == [1, 3]
    for r in result["rows"]:
        assert r["unconstrained_tok_per_s"] > 0 and r["json_schema_tok_per_s"] > 0
        assert r["unconstrained_tok_per_cpu_s"] > 0 and r["json_schema_tok_per_cpu_s"] > 0
        assert len(r["ratios"]) == len(r["ratios_cpu"]) == 2 and r["ratio"] > 0 and r["ratio_cpu"] > 0
    assert result["compile_ms"]["cold"] > 0 and result["compile_ms"]["cached"] >= 0
