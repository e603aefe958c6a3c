"""What one HTTP client may hold of the OpenAI server: time to send a request head, time to send a
body, and a share of a bounded number of open connections.

aiohttp's server times out idle keep-alive connections only (and after an hour by default), so a
client that trickles a request head a byte at a time, or a chunked body that never ends, holds a
connection (a file descriptor, a parser, a task) for as long as it likes. Here:

- head: `GuardedRunner` serves with `_GuardedHandler`, aiohttp's `RequestHandler` plus one timer.
  It is armed when the connection is made and again when a response has been written (keep-alive),
  and cancelled when the parser has a complete request head; when it fires the connection is
  closed. Pipelined heads that arrived during a response leave it disarmed.
- body: the handlers read bodies with `read_body`, which gives up after the app's body_timeout_s
  with a 408 (aiohttp then discards what is left of the body for at most header_timeout_s, the
  head timer's deadline after that response, and closes).
- connections: past max_connections open ones, a new connection is answered 503 and closed at
  once, before anything is parsed; refusals are logged at most every REFUSAL_LOG_INTERVAL_S.

With TLS, a connection counts from the end of its handshake (asyncio bounds the handshake itself,
60 s by default).

The hooks `connection_made`, `data_received`, `connection_lost` and `_handle_request` (it returns
when a response is finished) and the counters `_request_count` / `_messages` are aiohttp 3.x
internals; tests/test_http_limits.py pins the behaviour built on them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from services.openai.protocol import ApiError, error_body

logger = logging.getLogger(__name__)

BODY_TIMEOUT_S = web.AppKey("body_timeout_s", float)
"""The app's body_timeout_s, read by `read_body` (set by build_app)."""
REFUSAL_LOG_INTERVAL_S = 10.0
"""Refused connections are logged at most this often (a flood must not flood the log)."""


async def read_body(request: web.Request) -> bytes:
    """The whole request body (`request.read()`, within client_max_size), or ApiError 408 when it
    has not arrived within the app's body_timeout_s."""
    limit = request.app[BODY_TIMEOUT_S]
    try:
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError:
        raise ApiError(
            f"request body not received within the limit of {limit:g} s (body_timeout_s)",
            status=408,
            code="request_timeout",
        ) from None


class GuardedRunner(web.AppRunner):
    """An AppRunner whose connections have a head timeout and are capped in number (module doc)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, max_connections: int, **kwargs):
        if not header_timeout_s > 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the app; aiohttp's Server over its handler
        return _GuardedServer(
            self.header_timeout_s,
            self.max_connections,
            plain.request_handler,
            request_factory=plain.request_factory,
            handler_cancellation=plain.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **plain._kwargs,  # the RequestHandler options aiohttp assembled (access log, debug...)
        )


class _GuardedServer(web.Server):
    """aiohttp's Server (the protocol factory) making `_GuardedHandler`s; owns the count of open
    connections."""

    def __init__(self, header_timeout_s: float, max_connections: int, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.open = 0
        self._refused = 0  # since the last log line
        self._last_log = -float("inf")
        body = json.dumps(error_body(f"too many open connections (max_connections={max_connections})", 503))
        self.refusal = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n{body}"
        ).encode()

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)

    def admit(self) -> bool:
        """Count a new connection in, or say it must be refused (and log that, rate-limited)."""
        if self.open < self.max_connections:
            self.open += 1
            return True
        self._refused += 1
        now = time.monotonic()
        if now - self._last_log >= REFUSAL_LOG_INTERVAL_S:
            logger.warning(
                "refused %d HTTP connection(s): max_connections=%d are open",
                self._refused,
                self.max_connections,
            )
            self._refused, self._last_log = 0, now
        return False

    def release(self) -> None:
        assert self.open > 0, "released more connections than were admitted"
        self.open -= 1


class _GuardedHandler(RequestHandler):
    """One connection: aiohttp's protocol plus the head timer and the admission check."""

    __slots__ = ("_guard", "_admitted", "_head_timer")

    def __init__(self, manager: _GuardedServer, **kwargs):
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._admitted = False
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not self._guard.admit():
            transport.write(self._guard.refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._disarm_head_timer()
        self._guard.release()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        heads = self._request_count
        super().data_received(data)
        if self._request_count != heads:  # a complete head was parsed (or a bad one, answered 400)
            self._disarm_head_timer()

    async def _handle_request(self, request, start_time, request_handler):
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:  # the response is written: the next head is due within header_timeout_s
            if not self._messages:
                self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        if self.transport is not None and not self._force_close:
            self._head_timer = self._loop.call_later(self._guard.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        logger.debug("closing %s: no request head within %g s", self.peername, self._guard.header_timeout_s)
        self.force_close()
