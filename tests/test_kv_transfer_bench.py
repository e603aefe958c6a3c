"""`benchmarks/kv_transfer.py` as a user runs it, on the tiny model: both transports move the same
KV bytes for every prompt length, every rate is positive, the raw NIXL ceiling reads the same
bytes, and the results land where --output says."""

from __future__ import annotations

from tests.bench_testing import run_benchmark, saved_result


def test_kv_transfer_smoke(tiny_model, tmp_path):
    out = tmp_path / "kv.json"
    args = ["--model", tiny_model, "--dtype", "float32", "--lengths", "20,40", "--rounds", "1"]
    args += ["--num-kv-blocks", "64", "--output", str(out)]
    proc = run_benchmark("kv_transfer.py", *args, timeout=300)
    result = saved_result(proc, out)
    rows = {(r["prompt_tokens"], r["transport"]): r for r in result["rows"]}
    assert set(rows) == {(n, t) for n in (20, 40) for t in ("nixl", "grpc")}
    for n in (20, 40):
        assert rows[(n, "nixl")]["kv_bytes"] == rows[(n, "grpc")]["kv_bytes"] > 0
    for r in rows.values():
        assert r["pull_gbps"] > 0 and r["ttft_ms"] > 0 and r["second_token_ms"] > 0
    raw = {r["prompt_tokens"]: r for r in result["raw_nixl"]}
    assert set(raw) == {20, 40, 8192}
    for n in (20, 40):
        assert raw[n]["kv_bytes"] == rows[(n, "nixl")]["kv_bytes"]
    assert all(r["nixl_read_gbps"] > 0 and r["checksum_gbps"] > 0 for r in raw.values())
    assert set(result["nixl_over_grpc_pull_gbps"]) == {"20", "40"}
