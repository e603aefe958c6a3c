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


def _serve(model: str, http_port: int, grpc_port: int) -> tuple[subprocess.Popen, list[int]]:
    """`pdserve serve` (a prefill and a decode worker) started, read until it says where it serves:
    -> the process and the pids it names (workers, then the router)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--model",
            model,
            "--http-port",
            str(http_port),
            "--grpc-port",
            str(grpc_port),
            "--dtype",
            "float32",
            "--num-kv-blocks",
            "256",
            "--threads-per-worker",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    while not any(line.strip().startswith("router") for line in lines):
        line = proc.stdout.readline()
        if not line:
            proc.kill()
            raise AssertionError(f"serve exited early: {lines}")
        lines.append(line)
    return proc, [int(m) for m in re.findall(r"\(pid (\d+)\)", "".join(lines))]


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_starts_the_stack_and_sigterm_stops_every_process(tiny_model):
    """`pdserve serve` starts a prefill and a decode worker and runs the router in its own
    process; SIGTERM stops all three, exit status 0."""
    import json
    import os
    import signal
    import time
    import urllib.request

    from services.launcher import free_port

    http_port = free_port()
    proc, pids = _serve(tiny_model, http_port, free_port())
    try:
        assert len(pids) == 3 and pids[-1] == proc.pid  # prefill, decode; the router is serve itself
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models"))
        assert [m["id"] for m in models["data"]] == [os.path.basename(tiny_model)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        for pid in pids:
            assert not _alive(pid), f"process {pid} outlived serve"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_worker_dying_stops_serve_with_status_1(tiny_model):
    """A worker killed: serve says so, stops the router it runs and the other worker, exit 1."""
    import os
    import signal
    import time

    from services.launcher import free_port

    proc, pids = _serve(tiny_model, free_port(), free_port())
    try:
        os.kill(pids[0], signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
        time.sleep(0.2)
        assert not _alive(pids[1]), "the other worker outlived serve"
    finally:
        if proc.poll() is None:
            proc.kill()
