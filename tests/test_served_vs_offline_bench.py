"""`benchmarks/served_vs_offline.py` as a user runs it, on the tiny model: the offline engine and a
real stack run the same streams, every served token arrives, and the ratios (whole workload and
decode at the same batch) are written out."""

from __future__ import annotations

import json
import statistics

import pytest

from tests.bench_testing import run_benchmark


# Every client and both orders of the sides, with a stack each run (seconds of process starts): the
# gRPC client interleaved (where it counts every token of the gathered messages), the two openai
# clients one side after the other, and the http client in test_served_ab_smoke (the same Served).
@pytest.mark.parametrize(
    "client, interleave, stream_interval",
    [("openai", False, 1), ("openai-threads", False, 1), ("grpc", True, 3)],
    ids=["openai", "openai-threads", "grpc-interleaved-stream-interval"],
)
def test_served_vs_offline_smoke(tiny_model, tmp_path, client, interleave, stream_interval):
    out = tmp_path / "served.json"
    rounds = 2 if interleave else 1
    args = ["--model", tiny_model, "--dtype", "float32", "--concurrency", "3", "--input-len", "12"]
    args += ["--output-len", "8", "--num-kv-blocks", "64", "--threads", "1", "--rounds", str(rounds)]
    args += ["--client", client, "--output", str(out), "--log-dir", str(tmp_path / "logs")]
    args += ["--stream-interval", str(stream_interval)] + (["--interleave"] if interleave else [])
    proc = run_benchmark("served_vs_offline.py", *args, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    assert any(line.startswith("served / offline") for line in lines) and f"saved {out}" in lines
    result = json.loads(out.read_text())
    assert result["settings"]["interleave"] is interleave
    assert result["settings"]["stream_interval"] == stream_interval
    assert len(result["offline_tok_s"]) == len(result["served_tok_s"]) == rounds
    assert min(result["offline_tok_s"]) > 0 and min(result["served_tok_s"]) > 0
    median = statistics.median
    assert result["ratio"] == pytest.approx(median(result["served_tok_s"]) / median(result["offline_tok_s"]))
    decode = median(result["served_decode_tok_s"]), median(result["offline_decode_tok_s"])
    assert decode[0] > 0 and decode[1] > 0
    assert result["decode_ratio"] == pytest.approx(decode[0] / decode[1])
    if interleave:
        pairs = zip(result["served_decode_tok_s"], result["offline_decode_tok_s"], strict=True)
        assert result["decode_ratio_by_round"] == pytest.approx(median(s / o for s, o in pairs))
    else:  # one side's rounds, then the other's: no pairs
        assert "decode_ratio_by_round" not in result
    pauses = result["served_first_pause_s"]  # per round, the streams' median first-to-second gap
    gaps = result["served_longest_gap_s"]  # per round, the longest wait between pieces after the second
    assert len(pauses) == len(gaps) == rounds
    if client == "grpc":
        assert result["served_pieces"] == [3 * 8] * rounds  # every token of every stream arrived
        assert all(p > 0 for p in pauses) and all(g > 0 for g in gaps)
    else:
        assert 0 < result["served_pieces"][0] <= 3 * 8
        assert all(p is None or p > 0 for p in pauses)  # None: no stream had a second text piece
        assert all(g >= 0 for g in gaps)  # 0: no stream had a third
    assert set(result["served_cpu_s_per_token"]) == {"prefill-0", "decode-0", "router", "client"}
    assert result["offline_cpu_s_per_token"] > 0


def test_served_ab_smoke(tiny_model, tmp_path):
    """`benchmarks/served_ab.py`: two stacks that differ in one launcher field, rounds alternating,
    driven by the http client (aiohttp, SSE lines parsed); each arm's rates and its ratios to the
    first are written out, and each arm's workers got the setting (their logs are apart)."""
    out = tmp_path / "ab.json"
    args = ["--model", tiny_model, "--dtype", "float32", "--concurrency", "2", "--input-len", "12"]
    args += ["--output-len", "6", "--num-kv-blocks", "64", "--threads", "1", "--rounds", "2"]
    args += ["--client", "http", "--output", str(out), "--log-dir", str(tmp_path / "logs")]
    args += [
        "--arm",
        'spin={"omp_wait_policy": "inherit"}',
        "--arm",
        'passive={"omp_wait_policy": "PASSIVE"}',
    ]
    proc = run_benchmark("served_ab.py", *args, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    arms = json.loads(out.read_text())["arms"]
    assert list(arms) == ["spin", "passive"]
    assert arms["passive"]["stack"] == {"omp_wait_policy": "PASSIVE"}
    for arm in arms.values():
        assert len(arm["decode_tok_s"]) == len(arm["tok_s"]) == len(arm["first_pause_s"]) == 2
        assert len(arm["longest_gap_s"]) == 2 and min(arm["longest_gap_s"]) >= 0  # 0: no third piece
        assert all(p is None or p > 0 for p in arm["first_pause_s"])  # None: no second text piece
        assert min(arm["decode_tok_s"]) > 0
        assert set(arm["cpu_s_per_token"]) == {"prefill-0", "decode-0", "router", "client"}
    median = statistics.median
    assert arms["spin"]["decode_ratio"] == 1.0
    ratio = median(arms["passive"]["decode_tok_s"]) / median(arms["spin"]["decode_tok_s"])
    assert arms["passive"]["decode_ratio"] == pytest.approx(ratio)
    assert arms["spin"]["paired_decode_ratio"] == 1.0
    by_round = [
        p / s for p, s in zip(arms["passive"]["decode_tok_s"], arms["spin"]["decode_tok_s"], strict=True)
    ]
    assert arms["passive"]["paired_decode_ratio"] == pytest.approx(median(by_round))
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {"spin", "passive"}


def test_served_ab_refuses_a_bad_arm(tiny_model, tmp_path):
    proc = run_benchmark(
        "served_ab.py", "--model", tiny_model, "--arm", "only={}", "--arm", "x=[1]", timeout=60
    )
    assert proc.returncode != 0 and "--arm x: the JSON must be an object" in proc.stderr
