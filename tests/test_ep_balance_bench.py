"""`benchmarks/ep_balance.py --smoke` as a user runs it: the table is printed, EPLB lowers the
max/mean rank load in every row, and nothing is written to benchmarks/results."""

from __future__ import annotations

from tests.bench_testing import run_benchmark


def test_ep_balance_smoke_shows_eplb_improving_balance():
    proc = run_benchmark("ep_balance.py", "--smoke")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["EP", "nodes"])
    columns = lines[header].split()
    rows = [dict(zip(columns, line.split(), strict=True)) for line in lines[header + 1 :]]
    assert [(r["EP"], r["policy"]) for r in rows] == [
        ("2", "hierarchical"),
        ("8", "hierarchical"),
        ("16", "hierarchical"),
        ("16", "global"),
    ]
    for r in rows:
        assert float(r["EPLB"]) < float(r["static"]), r
        assert float(r["EPLB"]) < float(r["static+spare"]), r
        assert 1.0 <= float(r["EPLB"]) <= float(r["EPLB-worst"]), r
    assert float(rows[2]["static"]) > 1.5  # the trace is skewed enough to matter
    assert not any(line.startswith("saved") for line in lines)
