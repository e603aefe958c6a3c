"""Protecting the internal RPCs: a shared bearer token in call metadata and/or mutual TLS.

Servers check `authorization: Bearer <token>` on every internal method (health and reflection
stay open so orchestrators can probe): missing -> UNAUTHENTICATED, wrong -> PERMISSION_DENIED.
Clients attach it with a channel interceptor. With TLS files set, servers listen with mutual TLS
(client certificates required) and clients present theirs.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

from engine import env

OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


@dataclass(frozen=True)
class Security:
    token: str | None = None
    """Shared secret for internal RPCs (PDSERVE_INTERNAL_TOKEN); None: not required."""
    tls_cert: str | None = None
    """PEM certificate chain this process presents (server and client side)."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_ca: str | None = None
    """PEM CA bundle peers' certificates must chain to; with cert and key set, TLS is mutual."""

    @classmethod
    def from_env(
        cls, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None
    ) -> Security:
        sec = cls(env.internal_token(), tls_cert, tls_key, tls_ca)
        if any((tls_cert, tls_key, tls_ca)) and not all((tls_cert, tls_key, tls_ca)):
            raise ValueError("--tls-cert, --tls-key and --tls-ca go together (mutual TLS)")
        return sec

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_server_credentials(
            [(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())],
            root_certificates=Path(self.tls_ca).read_bytes(),
            require_client_auth=True,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self.tls:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=Path(self.tls_ca).read_bytes(),
            private_key=Path(self.tls_key).read_bytes(),
            certificate_chain=Path(self.tls_cert).read_bytes(),
        )


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization")
        if got is None:
            return _refusing(
                handler, grpc.StatusCode.UNAUTHENTICATED, "missing internal token (authorization metadata)"
            )
        if not hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return _refusing(handler, grpc.StatusCode.PERMISSION_DENIED, "wrong internal token")
        return handler


def _refusing(handler, code: grpc.StatusCode, message: str):
    """A handler of the same kind as `handler` that only aborts."""
    if handler.unary_stream:

        async def refuse_stream(request, context):
            await context.abort(code, message)
            yield  # pragma: no cover - makes this an async generator

        return grpc.unary_stream_rpc_method_handler(
            refuse_stream, handler.request_deserializer, handler.response_serializer
        )

    async def refuse(request, context):
        await context.abort(code, message)

    return grpc.unary_unary_rpc_method_handler(
        refuse, handler.request_deserializer, handler.response_serializer
    )


class _TokenMetadata:
    def __init__(self, token: str):
        self._pair = ("authorization", f"Bearer {token}")

    def _with_token(self, details):
        metadata = list(details.metadata or ()) + [self._pair]
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


# grpc.aio files an interceptor under the first call kind it implements, so one class per kind.
class _UnaryTokenInterceptor(_TokenMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


class _StreamTokenInterceptor(_TokenMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with_token(details), request)


def client_interceptors(security: Security | None) -> list:
    if security is None or not security.token:
        return []
    return [_UnaryTokenInterceptor(security.token), _StreamTokenInterceptor(security.token)]


def server_interceptors(security: Security | None) -> list:
    return [TokenAuthInterceptor(security.token)] if security is not None and security.token else []
