"""benchmarks/served_peers.py without the peers: `pdserve serve --colocated 1` started as a user
would, driven by the built-in load generator for a few requests, stopped, and its figures written."""

import json

from tests.bench_testing import run_benchmark


def test_the_served_benchmark_runs_pdserve_alone_and_reports_every_point(tiny_model, tmp_path):
    args = ["--model", tiny_model, "--engines", "pdserve-colocated", "--client", "builtin"]
    args += ["--concurrency", "1,2", "--num-prompts", "3", "--input-len", "12", "--output-len", "5"]
    args += ["--dtype", "float32", "--kv-tokens", "4096", "--threads", "1", "--out", str(tmp_path)]
    proc = run_benchmark("served_peers.py", *args, timeout=240)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"

    res = json.loads((tmp_path / "pdserve-colocated.json").read_text())
    assert res["command"][-2:] == ["--colocated", "1"]
    blocks = res["command"][res["command"].index("--num-kv-blocks") + 1]
    assert blocks == "256"  # --kv-tokens 4096 in blocks of 16
    assert res["exit_code"] == 0  # stopped by SIGTERM, cleanly
    assert [p["concurrency"] for p in res["points"]] == [1, 2]
    for p in res["points"]:
        assert (p["completed"], p["failed"], p["total_output_tokens"]) == (3, 0, 15)
        assert p["output_throughput"] == 15 / p["duration"]
        assert 0 < p["median_ttft_ms"] <= p["p99_ttft_ms"] and 0 <= p["median_itl_ms"] <= p["p99_itl_ms"]
        assert p["median_tpot_ms"] > 0
        assert 100 < p["peak_rss_mib"] <= res["peak_rss_mib"]  # a router and a worker, both sampled
        assert p["server_cpu_s"] > 0 and 0 < p["client_cpu_share"] < 1
    table = (tmp_path / "table.md").read_text()
    rows = [line for line in table.splitlines() if "pdserve serve --colocated 1 |" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2"]
    assert (tmp_path / "served_peers.png").stat().st_size > 0
