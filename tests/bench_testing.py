"""Running a benchmark script the way a user does, for the benchmarks' smoke tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_benchmark(
    script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> *args` from the repository root with one OpenMP thread (plus
    `env`); stdout and stderr captured as text."""
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
