"""`benchmarks/served_vs_offline.py` as a user runs it, on the tiny model: the offline engine and a
real stack run the same streams, every served token arrives, and the ratios (whole workload and
decode at the same batch) are written out."""

from __future__ import annotations

import json

import pytest

from tests.bench_testing import run_benchmark


@pytest.mark.parametrize("client", ["grpc", "openai"])
def test_served_vs_offline_smoke(tiny_model, tmp_path, client):
    out = tmp_path / "served.json"
    args = ["--model", tiny_model, "--dtype", "float32", "--concurrency", "3", "--input-len", "12"]
    args += ["--output-len", "8", "--num-kv-blocks", "64", "--threads", "1", "--rounds", "1"]
    args += ["--client", client, "--output", str(out), "--log-dir", str(tmp_path / "logs")]
    proc = run_benchmark("served_vs_offline.py", *args, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert any(line.startswith("served / offline") for line in lines) and f"saved {out}" in lines
    result = json.loads(out.read_text())
    assert len(result["offline_tok_s"]) == len(result["served_tok_s"]) == 1
    assert result["offline_tok_s"][0] > 0 and result["served_tok_s"][0] > 0
    assert result["ratio"] == pytest.approx(result["served_tok_s"][0] / result["offline_tok_s"][0])
    decode = result["served_decode_tok_s"][0], result["offline_decode_tok_s"][0]
    assert decode[0] > 0 and decode[1] > 0
    assert result["decode_ratio"] == pytest.approx(decode[0] / decode[1])
    if client == "grpc":
        assert result["served_pieces"] == [3 * 8]  # every token of every stream arrived
    else:
        assert 0 < result["served_pieces"][0] <= 3 * 8
