"""Starting up: the router says ready only when it can serve, and a cold start says what it is doing.

- A router started before its worker answers HTTP /health 503 naming why (and gRPC readiness
  NOT_SERVING) until a request can be routed, 200 from then on (a completion sent the moment it says
  so is served), and 503 again once no worker that decodes is left. Real processes on loopback, the
  `openai` client and gRPC health.
- While a stack starts, the launcher reports what it still waits for; loading a checkpoint reports
  how much of it is read."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request

import grpc
import openai
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.launcher import Stack, free_port, wait_ready
from tests.service_testing import ENGINE_ARGS, stack_config, wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING


def _health(stack: Stack) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(stack.http_url + "/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except urllib.error.URLError:  # not listening yet
        return 0, {}


def _grpc_ready(stack: Stack) -> bool:
    with grpc.insecure_channel(stack.grpc_endpoint) as ch:
        check = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5
        )
    return check.status == SERVING


def test_health_answers_503_until_a_request_can_be_routed(tiny_model, tmp_path):
    stack = Stack(stack_config(tiny_model, tmp_path))
    port = free_port(taken={stack.grpc_port, stack.http_port})
    endpoint = f"127.0.0.1:{port}"
    client = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        router = stack.start_router(workers=[endpoint])
        wait_ready(stack.grpc_endpoint, 60, router.popen, service="liveness")
        assert wait_until(lambda: _health(stack)[0] != 0, 30)

        # Nothing behind the router yet: not ready, and a completion is refused as the probe says.
        status, body = _health(stack)
        assert status == 503 and body["status"] == "unavailable", body
        assert endpoint in body["reason"] and "no decode worker is ready" in body["reason"], body
        assert not _grpc_ready(stack)
        try:
            client.completions.create(model="pdserve-tiny", prompt="def f(x):", max_tokens=2)
            raise AssertionError("a completion was served with no worker")
        except openai.APIStatusError as e:
            assert e.status_code == 503

        # The worker comes up: the first 200 means a completion is served, at once.
        worker = stack.start_worker("decode", 0, port=port)
        assert wait_until(lambda: _health(stack)[0] == 200, 120, interval=0.02), _health(stack)
        out = client.completions.create(model="pdserve-tiny", prompt="def f(x):", max_tokens=2, temperature=0)
        assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2
        assert _health(stack) == (200, {"status": "ok"})
        assert wait_until(lambda: _grpc_ready(stack), 5)

        # It goes away: not ready again, on both fronts.
        stack.kill(worker)
        assert wait_until(lambda: _health(stack)[0] == 503, 30), _health(stack)
        assert "unhealthy" in _health(stack)[1]["reason"]
        assert wait_until(lambda: not _grpc_ready(stack), 5)
    finally:
        codes = stack.stop()
    assert codes["router"] == 0, codes


def test_a_starting_stack_says_what_it_still_waits_for(tiny_model, tmp_path):
    lines: list[str] = []
    stack = Stack(stack_config(tiny_model, tmp_path, progress_every_s=0.2))
    try:
        stack.start(on_wait=lines.append)
        assert lines, "no progress line while the processes started"
        names = {p.name for p in stack.procs}
        for line in lines:
            waiting = line.split("waiting for ", 1)[1].split(", ")
            assert waiting and set(waiting) <= names, line
        assert _health(stack) == (200, {"status": "ok"})  # it returned once it could serve
    finally:
        stack.stop()


def test_loading_a_checkpoint_reports_how_much_is_read(tiny_model, caplog, monkeypatch):
    import re

    from engine import LLM, progress

    class EveryTensor(progress.Progress):  # a line after every tensor, not every 5 s
        def __init__(self, *args, **kw):
            super().__init__(*args, **{**kw, "every_s": 0.0})

    monkeypatch.setattr("engine.loader.Progress", EveryTensor)
    with caplog.at_level(logging.INFO, logger="engine.loader"):
        LLM(tiny_model, dtype="float32", num_kv_blocks=16)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading weights from")]
    size = r"([\d.]+) (MB|GB)"
    steps = [re.search(rf": {size} of {size} \((\d+)%\)", line) for line in lines[:-1]]
    assert len(steps) > 10 and all(steps), lines
    read = [_bytes(m[1], m[2]) for m in steps]
    assert read == sorted(read) and 0 < read[-1] <= _bytes(steps[0][3], steps[0][4])
    assert int(steps[-1][5]) >= 90  # all but the file headers
    done = re.search(rf": {size} in [\d.]+ s$", lines[-1])
    assert done and _bytes(done[1], done[2]) == read[-1], lines[-1]


def _bytes(value: str, unit: str) -> float:
    return float(value) * {"MB": 1e6, "GB": 1e9}[unit]


def test_a_worker_whose_metrics_port_is_taken_says_so_before_loading(tiny_model, tmp_path):
    """A worker binds its metrics port with its gRPC port, before it loads the model (a port picked
    for it is held the sooner: picked, then bound only after the load, another process's
    connection once took it in between). One already held stops it there: exit 1, a line naming
    the address, nothing loaded."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        stack = Stack(
            stack_config(tiny_model, tmp_path, engine_args=[*ENGINE_ARGS, "--metrics-port", str(taken)])
        )
        proc = stack.start_worker("decode", 0)
        assert proc.popen.wait(timeout=120) == 1
    log = proc.log_path.read_text()
    assert f"cannot serve metrics on 127.0.0.1:{taken}" in log, log
    assert "worker listening on" not in log and "worker ready on" not in log, log
