"""Protecting the internal RPCs: a shared bearer token in call metadata and/or mutual TLS; and
the public API's keys.

Servers check `authorization: Bearer <token>` on every internal method (health and reflection
stay open so orchestrators can probe): missing -> UNAUTHENTICATED, wrong -> PERMISSION_DENIED.
Clients attach it with a channel interceptor. With TLS files set, servers listen with mutual TLS
(client certificates required) and clients present theirs.

The router's public API takes API keys the same way (`ApiKeys`): gRPC `Inference` wants
`authorization: Bearer KEY` metadata (UNAUTHENTICATED otherwise, health and reflection open), the
OpenAI routes the same header (services/openai/server.py). Keys are compared in constant time and
never logged.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
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


MAX_API_KEYS = 1024
"""Most keys an --api-key-file may hold (each is compared on every request)."""
MAX_API_KEY_CHARS = 512


@dataclass(frozen=True)
class ApiKeys:
    """The keys the public API accepts; none: it is open."""

    keys: tuple[str, ...] = field(default=(), repr=False)

    @classmethod
    def load(cls, keys: Sequence[str] = (), key_file: str | None = None, from_env: bool = True) -> ApiKeys:
        """--api-key values, the keys of key_file (one per line; blank lines and lines starting
        with # skipped) and PDSERVE_API_KEY. ValueError naming the source and the limit for a key
        that is empty, has whitespace inside, or is longer than MAX_API_KEY_CHARS, and for a
        key_file that holds no key or more than MAX_API_KEYS."""
        found = [(k, "--api-key") for k in keys]
        if key_file is not None:
            try:
                lines = [line.strip() for line in Path(key_file).read_text().splitlines()]
            except (OSError, UnicodeDecodeError) as e:
                raise ValueError(f"--api-key-file {key_file} cannot be read: {e}") from None
            in_file = [line for line in lines if line and not line.startswith("#")]
            if not in_file:
                raise ValueError(f"--api-key-file {key_file} holds no key")
            if len(in_file) > MAX_API_KEYS:
                raise ValueError(
                    f"--api-key-file {key_file} holds {len(in_file)} keys, more than {MAX_API_KEYS}"
                )
            found += [(k, f"--api-key-file {key_file}") for k in in_file]
        if from_env and env.api_key() is not None:
            found.append((env.api_key(), env.API_KEY_VAR))
        for key, where in found:
            if not key or any(c.isspace() for c in key) or len(key) > MAX_API_KEY_CHARS:
                raise ValueError(
                    f"an API key from {where} must be 1 to {MAX_API_KEY_CHARS} characters without whitespace"
                )
        return cls(tuple(dict.fromkeys(k for k, _ in found)))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | bytes | None) -> bool:
        """Whether an Authorization value is `Bearer <one of the keys>`. Every key is compared,
        each in constant time, so the time taken says nothing about which matched or how much."""
        if authorization is None:
            return False
        got = authorization.encode() if isinstance(authorization, str) else bytes(authorization)
        ok = False
        for key in self.keys:
            ok |= hmac.compare_digest(got, b"Bearer " + key.encode())
        return ok


API_KEY_MISSING = "missing API key: send it as 'Authorization: Bearer <key>'"
API_KEY_WRONG = "invalid API key"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """The public gRPC API's key check: every method but health and reflection needs a key in
    `authorization: Bearer KEY` metadata; missing or wrong -> UNAUTHENTICATED."""

    def __init__(self, keys: ApiKeys):
        assert keys, "an ApiKeyInterceptor without keys would refuse everything"
        self._keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization")
        if not self._keys.check(got):
            message = API_KEY_MISSING if got is None else API_KEY_WRONG
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED, message)
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


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1) or "localhost"."""
    name = host.strip().removeprefix("[").removesuffix("]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:  # a host name other than localhost: may resolve to anything
        return False


def check_exposure(host: str, security: Security, insecure: bool) -> None:
    """Refuse (ValueError; the CLI exits 2) to serve internal RPCs, or call them, from a
    non-loopback `host` without an internal token or mutual TLS, unless `insecure`
    (--insecure-internal) says the network itself is trusted."""
    if insecure or security.token or security.tls or is_loopback(host):
        return
    raise ValueError(
        f"binding {host} without an internal token (PDSERVE_INTERNAL_TOKEN) or mutual TLS "
        "(--tls-cert/--tls-key/--tls-ca); pass --insecure-internal to allow it"
    )


# ---- signed KV handles -----------------------------------------------------------------------------
# The router signs each KvHandle it passes to a decode worker, so a caller holding only the
# worker's port cannot name an endpoint of its choosing (whose bytes would become the prompt's KV
# and enter the prefix cache). The MAC covers every field of the handle.

import hashlib  # noqa: E402
import struct  # noqa: E402

from pdserve.v1 import kv_transfer_pb2 as kv_pb  # noqa: E402

HANDLE_MAC_DOMAIN = b"pdserve.v1.KvHandle.mac/1"
"""Separates these MACs from any other use of the internal token."""


def _handle_message(handle: kv_pb.KvHandle) -> bytes:
    """A canonical encoding of every KvHandle field: each part as an 8-byte big-endian length and
    its bytes, strings as UTF-8, integers as 8 big-endian bytes, block_hashes as a count then each
    hash, and where either is set block_ids then block_checksums as one part each of 8-byte
    integers (so no two different handles encode alike)."""
    p = handle.producer
    parts = [
        HANDLE_MAC_DOMAIN,
        handle.transfer_id.encode(),
        p.engine_id.encode(),
        struct.pack(">Q", p.epoch),
        struct.pack(">q", p.dp_rank),
        p.endpoint.encode(),
        struct.pack(">q", len(handle.block_hashes)),
        *handle.block_hashes,
        struct.pack(">q", handle.num_tokens),
        struct.pack(">q", handle.num_blocks),
        struct.pack(">q", handle.block_size),
        struct.pack(">q", handle.lease_expiry_unix_ms),
        handle.compat_hash.encode(),
    ]
    if handle.block_ids or handle.block_checksums:  # a NIXL producer's (absent: as before they were)
        parts.append(struct.pack(f">{len(handle.block_ids)}q", *handle.block_ids))
        parts.append(struct.pack(f">{len(handle.block_checksums)}Q", *handle.block_checksums))
    return b"".join(struct.pack(">Q", len(part)) + part for part in parts)


def handle_mac(key: str, handle: kv_pb.KvHandle) -> bytes:
    """HMAC-SHA256 of the handle under key (the internal token): DecodeRequest.kv_handle_mac."""
    return hmac.new(key.encode(), _handle_message(handle), hashlib.sha256).digest()


def verify_handle_mac(key: str, handle: kv_pb.KvHandle, mac: bytes) -> bool:
    """Whether mac is handle_mac(key, handle), compared in constant time."""
    return hmac.compare_digest(handle_mac(key, handle), bytes(mac))
