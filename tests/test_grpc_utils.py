"""The services' gRPC server plumbing with real gRPC clients: the standard health service's Watch
streams through the error interceptor (client-side health checking uses it), and a streaming
handler that writes with `context.write` gets its errors mapped like any other."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_utils import add_health_and_reflection, new_server, set_health
from services.launcher import free_port

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_watch_streams_every_change():
    async def scenario() -> list[int]:
        server = new_server()
        servicer = add_health_and_reflection(server, [])
        endpoint = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(endpoint)
        await server.start()
        await set_health(servicer, live=True, ready=False)
        try:
            async with grpc.aio.insecure_channel(endpoint) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(
                    health_pb2.HealthCheckRequest(service="readiness")
                )
                seen = [(await call.read()).status]
                await set_health(servicer, live=True, ready=True)
                seen.append((await call.read()).status)
                await set_health(servicer, live=True, ready=False)
                seen.append((await call.read()).status)
                call.cancel()
                return seen
        finally:
            await server.stop(None)

    assert asyncio.run(scenario()) == [NOT_SERVING, SERVING, NOT_SERVING]


class _Writer(health_pb2_grpc.HealthServicer):
    """A write-style streaming handler that fails after its first message."""

    async def Watch(self, request, context):
        await context.write(health_pb2.HealthCheckResponse(status=SERVING))
        raise ValueError(f"service must be known, got {request.service!r}")


def test_a_write_style_stream_error_is_mapped_to_its_status():
    async def scenario():
        server = new_server()
        health_pb2_grpc.add_HealthServicer_to_server(_Writer(), server)
        endpoint = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(endpoint)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(endpoint) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service="nope"))
                first = await call.read()
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                return first.status, err.value.code(), err.value.details()
        finally:
            await server.stop(None)

    status, code, details = asyncio.run(scenario())
    assert status == SERVING
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == "service must be known, got 'nope'"


def fake_socket(busy: frozenset[int] = frozenset()) -> type:
    """A socket class whose bind to a port in `busy` fails as a held one does."""

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            if address[1] in busy:
                raise OSError("address in use")

    return FakeSocket


def test_free_port_skips_ports_already_handed_out(monkeypatch):
    """The system may offer a port again until its process binds it (a stack's router port, picked
    first and bound last, was once offered to its decode worker): a stack never hands one out twice."""
    import services.launcher as launcher

    offered = iter([5000, 5000, 5000, 5001, 5001, 5002])
    monkeypatch.setattr(launcher, "_offered", lambda host: offered)
    monkeypatch.setattr(launcher.socket, "socket", fake_socket())
    assert free_port() == 5000
    stack = launcher.Stack(launcher.StackConfig(model="unused", http_port=None))
    assert stack.grpc_port == 5000
    assert [stack._free_port(), stack._free_port()] == [5001, 5002]


def test_free_port_count_gives_a_run_of_free_ports(monkeypatch):
    """A worker group binds `--port + i` for each rank: count=2 skips a port whose neighbour is
    held, and the run it returns can be bound at once."""
    import socket

    import services.launcher as launcher

    port = free_port(count=3)
    with contextlib.ExitStack() as held:
        for i in range(3):
            held.enter_context(socket.socket()).bind(("127.0.0.1", port + i))

    monkeypatch.setattr(launcher, "_offered", lambda host: iter([6000, 6010]))
    monkeypatch.setattr(launcher.socket, "socket", fake_socket(frozenset({6001})))
    assert free_port(count=2) == 6010


def test_free_port_picks_below_the_ephemeral_range(monkeypatch):
    """Its ports lie below the range the kernel takes outgoing connections' local ports from (a
    worker's metrics port from that range was once taken by another process's connection before
    the worker bound it); where the range leaves no room below, the system's choice."""
    import services.launcher as launcher

    start = launcher._ephemeral_start()
    assert 1024 < start <= 65535
    ports = [free_port() for _ in range(20)]
    assert all(launcher.PICK_FROM <= p < start for p in ports) or start - launcher.PICK_FROM < 1000, ports
    monkeypatch.setattr(launcher, "_ephemeral_start", lambda: launcher.PICK_FROM + 10)
    assert free_port() >= start  # bind(0)'s, from the system's range
