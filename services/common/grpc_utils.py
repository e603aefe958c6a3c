"""Shared gRPC plumbing: the server (health, reflection, error mapping), channels and deadlines.

Handlers stay thin: they raise `ValueError` (caller mistakes) or `services.common.errors.ServiceError`
(with a status code) and the one interceptor below turns them into statuses. Downstream RPC errors
pass through with their own code.
"""

from __future__ import annotations

import inspect
import logging
import uuid
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.errors import ServiceError
from services.common.security import Security, client_interceptors, server_interceptors

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 4 * 2**20
"""gRPC's default message cap, kept on purpose: KV moves in chunks under it."""
LIVENESS = "liveness"
READINESS = "readiness"


async def _map_error(context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
    if isinstance(exc, ServiceError):
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            context.set_trailing_metadata((("retry-after-ms", str(int(retry_after * 1000))),))
        await context.abort(exc.code, exc.message)
    if isinstance(exc, ValueError):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    if isinstance(exc, grpc.aio.AioRpcError):  # a downstream call failed: keep its code
        await context.abort(exc.code(), exc.details() or "")
    # The exception's text stays in the log: it may hold internals (paths, state, other requests'
    # data) that callers must not see. The id ties the caller's report to the log line.
    error_id = uuid.uuid4().hex[:12]
    logger.error("%s failed (error id %s)", method, error_id, exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (error id {error_id})")


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Map exceptions raised by handlers to status codes (ValueError -> INVALID_ARGUMENT)."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                try:
                    return await inner(request, context)
                except (grpc.aio.AbortError, grpc.aio.UsageError):
                    raise
                except Exception as e:  # noqa: BLE001 - mapped to a status
                    await _map_error(context, method, e)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream and inspect.iscoroutinefunction(handler.unary_stream):
            # A streaming handler that writes with `await context.write(...)` and returns (the
            # standard grpc.health.v1 Watch is one) stays a coroutine: gRPC only takes writes from
            # a coroutine handler, and only iterates an async generator one.
            inner_writer = handler.unary_stream

            async def unary_stream_writer(request, context):
                try:
                    await inner_writer(request, context)
                except (grpc.aio.AbortError, grpc.aio.UsageError):
                    raise
                except Exception as e:  # noqa: BLE001 - mapped to a status
                    await _map_error(context, method, e)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream_writer, handler.request_deserializer, handler.response_serializer
            )
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def unary_stream(request, context):
                try:
                    async for item in inner_stream(request, context):
                        yield item
                except (grpc.aio.AbortError, grpc.aio.UsageError):
                    raise
                except Exception as e:  # noqa: BLE001
                    await _map_error(context, method, e)

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, handler.request_deserializer, handler.response_serializer
            )
        return handler


def new_server(security: Security | None = None, interceptors: Sequence = ()) -> grpc.aio.Server:
    """An aio server: the internal-token check (when configured), then `interceptors` (the
    router's public API-key check), run before the error mapping."""
    return grpc.aio.server(
        interceptors=[*server_interceptors(security), *interceptors, ErrorInterceptor()],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )


def add_health_and_reflection(server: grpc.aio.Server, service_names: list[str]) -> health.aio.HealthServicer:
    """Standard grpc.health.v1 with "liveness" and "readiness" (both NOT_SERVING until set) and
    server reflection for the given fully qualified service names."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return servicer


async def set_health(servicer: health.aio.HealthServicer, live: bool, ready: bool) -> None:
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    await servicer.set(LIVENESS, serving if live else not_serving)
    await servicer.set(READINESS, serving if ready else not_serving)
    await servicer.set("", serving if ready else not_serving)


def bind(server: grpc.aio.Server, host: str, port: int, security: Security | None = None) -> int:
    """Bind to host:port (port 0 picks a free one), with mutual TLS when configured; returns the
    port. Never binds other addresses."""
    creds = security.server_credentials() if security is not None else None
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


def bind_public(
    server: grpc.aio.Server, host: str, port: int, tls_cert: str | None = None, tls_key: str | None = None
) -> int:
    """Bind a public (client-facing) service to host:port, port 0 picking a free one; returns the
    port. With tls_cert and tls_key (PEM files) it serves TLS without asking clients for
    certificates (internal services use `bind` with mutual TLS); without them, plaintext."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("tls_cert and tls_key go together (public TLS)")
    address = f"{host}:{port}"
    if tls_cert is None:
        bound = server.add_insecure_port(address)
    else:
        creds = grpc.ssl_server_credentials(
            [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())], require_client_auth=False
        )
        bound = server.add_secure_port(address, creds)
    if bound == 0:
        raise OSError(f"cannot bind gRPC server to {host}:{port}")
    return bound


def channel(endpoint: str, security: Security | None = None) -> grpc.aio.Channel:
    """A channel to an internal service, carrying the internal token / client certificate if set."""
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # A restarted peer is back within seconds: do not let reconnect backoff grow to minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 2000),
        # Connections of its own, not the process-wide pool: a channel opened to replace one that
        # failed must really connect again, not inherit the old connection's backoff and error.
        ("grpc.use_local_subchannel_pool", 1),
    ]
    interceptors = client_interceptors(security)
    creds = security.channel_credentials() if security is not None else None
    if creds is not None:
        return grpc.aio.secure_channel(endpoint, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)


def remaining(context: grpc.aio.ServicerContext) -> float | None:
    """Seconds left before the caller's deadline (None: no deadline), to pass downstream."""
    left = context.time_remaining()
    return None if left is None else max(left, 0.0)


def caller_key(peer: str) -> str:
    """The key a Prefill caller's pinned blocks are counted under: the host of its gRPC peer
    address ("ipv4:10.0.0.7:51234" -> "10.0.0.7", "ipv6:[::1]:51234" -> "::1"); other address
    kinds (unix sockets) as given."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0] or address
    if kind == "ipv6" and address.startswith("[") and "]" in address:
        return address[1 : address.index("]")]
    return peer
