"""`make run`'s job: the demo brings the stack up, streams through it both ways, and stops it."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys


def test_demo_streams_through_the_stack_and_moves_kv(tiny_model, tmp_path):
    model_dir = tmp_path / "models"
    model_dir.mkdir()
    shutil.copytree(tiny_model, model_dir / "pdserve-tiny")
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", "demo", "--model-dir", str(model_dir), "--max-tokens", "8"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    reports = re.findall(
        r"\[(openai|gRPC): (\d+) tokens, TTFT (\d+) ms, .* tok/s after the first, ([\d,]+) KV bytes moved",
        out.stdout,
    )
    assert [r[0] for r in reports] == ["openai", "gRPC"], out.stdout
    assert all(int(r[1]) == 8 for r in reports)
    assert int(reports[0][3].replace(",", "")) > 0  # the first request's whole prompt moved
    assert "stack ready" in out.stdout
