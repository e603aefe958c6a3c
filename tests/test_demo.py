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


def test_serve_starts_the_stack_and_sigterm_stops_every_process(tiny_model):
    import json
    import os
    import signal
    import time
    import urllib.request

    from services.launcher import free_port

    http_port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--model",
            tiny_model,
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
    try:
        lines = []
        while not any(line.strip().startswith("router") for line in lines):
            line = proc.stdout.readline()
            assert line, f"serve exited early: {lines}"
            lines.append(line)
        pids = [int(m) for m in re.findall(r"\(pid (\d+)\)", "".join(lines))]
        assert len(pids) == 3  # prefill, decode, router
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models"))
        assert [m["id"] for m in models["data"]] == [os.path.basename(tiny_model)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        time.sleep(0.2)
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive = True
            except ProcessLookupError:
                alive = False
            assert not alive, f"process {pid} outlived serve"
    finally:
        if proc.poll() is None:
            proc.kill()
