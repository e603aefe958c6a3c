"""Running Python the way a user does, in a fresh process from the repository root: benchmark
scripts for their smoke tests, and modules or snippets a test needs in a process of their own."""

from __future__ import annotations

import json
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


def saved_result(proc: subprocess.CompletedProcess, out: Path) -> dict:
    """The JSON a benchmark run saved at `out`: the run exited 0 and said where it saved (its
    output in the assertion's message otherwise)."""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert f"saved {out}" in proc.stdout.splitlines()
    return json.loads(out.read_text())


def head_revision() -> str:
    """The repository's HEAD commit, in full."""
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
