"""Running Python the way a user does, in a fresh process from the repository root: benchmark
scripts for their smoke tests, and modules or snippets a test needs in a process of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(
    *args: str, timeout: float = 120, env: dict[str, str] | None = None, unset: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """`python *args` from the repository root with one OpenMP thread (plus `env`, less `unset`);
    stdout and stderr captured as text."""
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env={k: v for k, v in environ.items() if k not in unset},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_benchmark(
    script: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python benchmarks/<script> *args`, as run_python runs it."""
    return run_python(str(REPO / "benchmarks" / script), *args, timeout=timeout, env=env)
