"""Slow and greedy HTTP clients (services/openai/limits.py) and public TLS, over raw sockets.

Slowloris heads and endless chunked bodies are cut after their timeouts (1 s here), connections
past max_connections are refused at once, and the public HTTP and gRPC servers speak TLS with
a server certificate only.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.tokenizer import Tokenizer
from services.common.grpc_utils import add_health_and_reflection, bind_public, new_server, set_health
from services.openai.limits import read_body
from services.openai.server import build_app, server_ssl_context, start_http
from services.router.server import RouterServerConfig
from tests.service_testing import wait_until
from tests.test_openai_front import FakeFrontend

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
SLACK_S = 1.0
"""How late past its timeout a connection may be closed."""


class Served:
    """An app from build_app (plus test routes) served by start_http on its own loop thread."""

    def __init__(self, app: web.Application, **http_options):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = self.call(start_http(app, "127.0.0.1", 0, **http_options))
        self.port = self.runner.addresses[0][1]

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    @property
    def open_connections(self) -> int:
        return self.runner.server.open

    def stop(self) -> None:
        self.call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


async def _echo(request: web.Request) -> web.Response:
    return web.Response(body=await read_body(request))


async def _slow(request: web.Request) -> web.Response:
    await asyncio.sleep(HEADER_TIMEOUT_S * 1.5)
    return web.json_response({"slow": True})


@pytest.fixture(scope="module")
def frontend(tiny_model) -> FakeFrontend:
    return FakeFrontend(Tokenizer(tiny_model))


def _app(frontend: FakeFrontend) -> web.Application:
    app = build_app(frontend, body_timeout_s=BODY_TIMEOUT_S)
    app.router.add_post("/test/echo", _echo)
    app.router.add_get("/test/slow", _slow)
    return app


@pytest.fixture(scope="module")
def served(frontend):
    srv = Served(_app(frontend), header_timeout_s=HEADER_TIMEOUT_S)
    yield srv
    srv.stop()


def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (monotonic) it did;
    fails the test if it is still open after `timeout`."""
    received, deadline = b"", time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            pytest.fail(f"connection still open after {timeout} s; received {received[:200]!r}")
        sock.settimeout(left)
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            data = b""
        if not data:
            return received, time.monotonic()
        received += data


def _trickle(
    socks: list[socket.socket], piece: bytes, every_s: float, stop: threading.Event
) -> threading.Thread:
    """Send `piece` on every socket every `every_s` until stop (errors: that socket is closed)."""

    def run() -> None:
        while not stop.wait(every_s):
            for s in socks:
                try:
                    s.send(piece)
                except OSError:
                    pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=10, context=context) as resp:
        return resp.status, resp.read()


# ---- header timeout ----------------------------------------------------------------------------


def test_slowloris_heads_are_closed_while_others_are_served(served):
    socks = [socket.create_connection(("127.0.0.1", served.port), timeout=5) for _ in range(50)]
    started = time.monotonic()
    stop = threading.Event()
    try:
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        trickler = _trickle(socks, b"X", 1.0, stop)  # one header byte per second, never "\r\n\r\n"
        assert wait_until(lambda: served.open_connections == 50, 2)
        status, body = _get(f"http://127.0.0.1:{served.port}/v1/models")  # another connection
        assert status == 200 and json.loads(body)["data"][0]["id"] == "pdserve-tiny"
        closed = [_read_until_closed(s, HEADER_TIMEOUT_S + SLACK_S)[1] - started for s in socks]
        assert max(closed) <= HEADER_TIMEOUT_S + SLACK_S
        assert min(closed) >= HEADER_TIMEOUT_S * 0.9
        assert wait_until(lambda: served.open_connections == 0, 2), served.open_connections
    finally:
        stop.set()
        for s in socks:
            s.close()
    trickler.join(timeout=5)


def test_head_timer_spares_running_requests_and_rearms_after_each_response(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        sock.sendall(b"GET /test/slow HTTP/1.1\r\nHost: x\r\n\r\n")  # handler outlives the head timer
        received = b""
        while b'{"slow": true}' not in received:
            received += sock.recv(65536)
        answered = time.monotonic()
        assert received.startswith(b"HTTP/1.1 200")
        _, closed_at = _read_until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)  # idle keep-alive
        assert HEADER_TIMEOUT_S * 0.9 <= closed_at - answered <= HEADER_TIMEOUT_S + SLACK_S


# ---- body timeout ------------------------------------------------------------------------------


def test_read_body_returns_a_body_in_time(served):
    req = urllib.request.Request(f"http://127.0.0.1:{served.port}/test/echo", data=b"hello" * 1000)
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200 and resp.read() == b"hello" * 1000


def test_endless_chunked_body_gets_408(served):
    stop = threading.Event()
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
        sock.sendall(b"POST /test/echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        started = time.monotonic()
        trickler = _trickle([sock], b"1\r\na\r\n", 0.2, stop)  # a chunk every 0.2 s, forever
        try:
            received = b""
            while b"\r\n\r\n" not in received or not received.rstrip().endswith(b"}"):
                received += sock.recv(65536)
            answered = time.monotonic()
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408")
            error = json.loads(body)["error"]
            assert "body_timeout_s" in error["message"] and "1 s" in error["message"]
            assert error["code"] == "request_timeout"
            assert BODY_TIMEOUT_S * 0.9 <= answered - started <= BODY_TIMEOUT_S + SLACK_S
            # What is left of the body is discarded until the next head is due, then it is closed.
            _read_until_closed(sock, HEADER_TIMEOUT_S + SLACK_S)
        finally:
            stop.set()
        trickler.join(timeout=5)


# ---- connection cap ----------------------------------------------------------------------------


def test_connections_past_the_cap_are_refused_at_once(frontend, caplog):
    srv = Served(_app(frontend), header_timeout_s=30.0, max_connections=5)
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port), timeout=5) for _ in range(5)]
        assert wait_until(lambda: srv.open_connections == 5, 2)
        with caplog.at_level(logging.WARNING, logger="services.openai.limits"):
            for _ in range(5):
                with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as extra:
                    started = time.monotonic()
                    received, closed_at = _read_until_closed(extra, 1.0)
                    assert closed_at - started < 0.5
                    head, _, body = received.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 503")
                    assert "max_connections=5" in json.loads(body)["error"]["message"]
        refusals = [r for r in caplog.records if "max_connections=5" in r.getMessage()]
        assert len(refusals) == 1  # rate-limited: one line for the burst
        assert srv.open_connections == 5
        for s in held:
            s.close()
        assert wait_until(lambda: srv.open_connections == 0, 2)
        for _ in range(5):
            assert _get(f"http://127.0.0.1:{srv.port}/health")[0] == 200
    finally:
        srv.stop()


# ---- public TLS --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed server certificate for 127.0.0.1 (its own CA) and its key."""
    d = tmp_path_factory.mktemp("public-tls")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
            "-keyout", "key.pem", "-out", "cert.pem", "-subj", "/CN=pdserve-public-test",
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        cwd=d, check=True, capture_output=True,
    )  # fmt: skip
    return d / "cert.pem", d / "key.pem"


def test_https_with_the_ca_succeeds_and_plain_http_fails(frontend, cert):
    srv = Served(_app(frontend), ssl_context=server_ssl_context(str(cert[0]), str(cert[1])))
    try:
        trusted = ssl.create_default_context(cafile=str(cert[0]))
        assert _get(f"https://127.0.0.1:{srv.port}/health", trusted) == (200, b'{"status": "ok"}')
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            _get(f"https://127.0.0.1:{srv.port}/health", ssl.create_default_context())
        with pytest.raises((http.client.HTTPException, ConnectionError)):
            _get(f"http://127.0.0.1:{srv.port}/health")
    finally:
        srv.stop()


async def _health_server(cert: Path, key: Path) -> tuple[grpc.aio.Server, int]:
    """A gRPC server with only health (and reflection), bound as the router binds Inference."""
    server = new_server()
    health = add_health_and_reflection(server, [])
    await set_health(health, live=True, ready=True)
    port = bind_public(server, "127.0.0.1", 0, tls_cert=str(cert), tls_key=str(key))
    await server.start()
    return server, port


def _check(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5).status


def test_grpc_public_tls_answers_a_secure_channel_only(cert):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=30)

    server, port = call(_health_server(*cert))
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert[0].read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", creds) as ch:  # no client certificate
            assert _check(ch) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                _check(ch)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        call(server.stop(None))
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)


def test_public_tls_cert_and_key_go_together(cert):
    with pytest.raises(ValueError, match="tls_cert and tls_key"):
        bind_public(None, "127.0.0.1", 0, tls_cert=str(cert[0]))  # refused before binding
    with pytest.raises(ValueError, match="--public-tls-key"):
        RouterServerConfig(model="m", settings=None, public_tls_cert=str(cert[0]))
