"""benchmarks/peers_plot.py reads the peer harness's result files and draws every engine's curve."""

from __future__ import annotations

import json

from benchmarks.peers_plot import curves, plot


def _result(path, curve, bs1=None):
    res = {
        "engine": path.stem,
        "model": "pdserve-bench",
        "cpu": "test cpu",
        "cores": 2,
        "date": "2026-12-01T00:00:00",
    }
    res["curve"] = [{"B": b, "decode_tok_s": v} for b, v in curve]
    if bs1 is not None:
        res["throughput"] = {"bs1_ms_per_token": bs1}
    path.write_text(json.dumps(res))


def test_curves_per_engine_with_the_batch_1_point(tmp_path):
    _result(tmp_path / "pdserve.json", [(16, 300.0), (8, 200.0)], bs1=20.0)
    _result(tmp_path / "llamacpp.json", [(8, 350.0), (16, None)])  # a point not measured is left out
    (tmp_path / "table.md").write_text("not a result")
    got = curves(tmp_path)
    assert got == {"pdserve": [(1, 50.0), (8, 200.0), (16, 300.0)], "llama.cpp": [(8, 350.0)]}
    png = plot(tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
