"""`benchmarks/serving.py --smoke` as a user runs it: a real stack (router, prefill and decode
worker) on the tiny model, 3 requests disaggregated and 3 colocated, summary printed and written
to a temporary file (never to benchmarks/results)."""

from __future__ import annotations

import json

from tests.bench_testing import run_benchmark


def test_serving_benchmark_smoke_compares_disaggregated_with_colocated(tiny_model, tmp_path):
    out = tmp_path / "serving.json"
    args = ["--smoke", "--model", tiny_model, "--dtype", "float32", "--num-kv-blocks", "256"]
    args += ["--rates", "4", "--input-len", "64", "--output-len", "8"]
    args += ["--output", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = run_benchmark("serving.py", *args, timeout=180)
    logs = "".join(p.read_text() for p in sorted((tmp_path / "logs").glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs[-4000:]}"

    lines = proc.stdout.splitlines()
    assert "rate 4 req/s (3 requests)" in lines
    assert any(line.split() == ["disaggregated", "colocated", "disagg/coloc"] for line in lines)
    assert any(line.split()[:2] == ["output", "tok/s"] for line in lines)
    assert f"saved {out}" in lines

    summary = json.loads(out.read_text())
    assert summary["settings"]["smoke"] is True
    assert {w["role"] for w in summary["server"]["workers"]} == {"prefill", "decode"}
    (rate,) = summary["results"]
    assert rate["rate"] == 4.0 and rate["num_requests"] == 3
    for mode in ("disaggregated", "colocated"):
        run = rate[mode]
        assert run["failures"] == 0, run["errors"]
        assert run["completed"] == 3 and run["output_tokens"] == 3 * 8
        assert run["output_tok_per_s"] > 0 and run["req_per_s"] > 0
        assert run["mode_mismatches"] == 0
        assert 0 < run["ttft_ms"]["p50"] <= run["ttft_ms"]["p99"] <= run["e2e_ms"]["p99"]
        assert run["itl_ms"]["p50"] > 0
        assert run["cached_tokens"] == 0  # the per-run salt: no run reads another's cached KV
    assert rate["disaggregated"]["kv_transfer_bytes"] > 0
    assert rate["colocated"]["kv_transfer_bytes"] == 0
