"""The decode side's channels to producers: a bounded LRU, and the checks a KvHandle passes before
any of them is dialed.

A handle comes from the router inside a DecodeRequest; its producer endpoint is dialed and the
bytes pulled become the prompt's KV (and enter the prefix cache). So before a connection is
opened: with an internal token, the handle must carry the router's HMAC over every field
(`services.common.security.handle_mac`), and with a list of known producers, its endpoint must be on it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import grpc

from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.errors import ServiceError
from services.common.grpc_utils import channel
from services.common.security import Security, verify_handle_mac

logger = logging.getLogger(__name__)

DEFAULT_MAX_CHANNELS = 32
CLOSE_GRACE_S = 60.0
"""An evicted or forgotten channel takes no new calls; ones already on it get this long."""


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


class PeerStubs:
    """At most `max_channels` channels to producer endpoints, least recently used evicted first.

    A channel leaves the cache when it is evicted or `forget`-ten and is then closed in the
    background (calls already on it get CLOSE_GRACE_S), so endpoints that are gone (restarted,
    dead, or never real) do not keep reconnecting forever. Only the event loop calls this."""

    def __init__(
        self,
        security: Security | None = None,
        max_channels: int = DEFAULT_MAX_CHANNELS,
        connect: Callable[[str, Security | None], grpc.aio.Channel] = channel,
    ) -> None:
        if max_channels < 1:
            raise ValueError(f"max_channels must be >= 1, got {max_channels}")
        self.security = security
        self.max_channels = max_channels
        self._connect = connect
        self._open: OrderedDict[str, tuple[grpc.aio.Channel, kv_grpc.KvTransferStub, wgrpc.WorkerStub]] = (
            OrderedDict()
        )
        self._closing: dict[grpc.aio.Channel, asyncio.Task] = {}  # evicted, in their grace

    def __len__(self) -> int:
        return len(self._open)

    def kv(self, endpoint: str) -> kv_grpc.KvTransferStub:
        return self._entry(endpoint)[1]

    def worker(self, endpoint: str) -> wgrpc.WorkerStub:
        """The producer's Worker service (GetEngineInfo: its NIXL agent), on the same channel."""
        return self._entry(endpoint)[2]

    def _entry(self, endpoint: str):
        entry = self._open.get(endpoint)
        if entry is not None:
            self._open.move_to_end(endpoint)
            return entry
        while len(self._open) >= self.max_channels:
            _, (old, *_) = self._open.popitem(last=False)
            self._close_later(old)
        ch = self._connect(endpoint, self.security)
        entry = (ch, kv_grpc.KvTransferStub(ch), wgrpc.WorkerStub(ch))
        self._open[endpoint] = entry
        return entry

    def forget(self, endpoint: str) -> None:
        """Drop and close the channel to a peer that failed (it may have restarted: the next call
        reconnects at once instead of waiting out the old channel's backoff)."""
        entry = self._open.pop(endpoint, None)
        if entry is not None:
            self._close_later(entry[0])

    def _close_later(self, ch: grpc.aio.Channel) -> None:
        task = asyncio.ensure_future(ch.close(CLOSE_GRACE_S))
        self._closing[ch] = task
        task.add_done_callback(lambda _: self._closing.pop(ch, None))

    async def close(self) -> None:
        """Close every channel at once (shutdown), the ones still in their grace too."""
        channels = [ch for ch, *_ in self._open.values()]
        self._open.clear()
        for ch, task in list(self._closing.items()):
            task.cancel()  # ends the grace wait before the channel is closed; closed below
            channels.append(ch)
        self._closing.clear()
        for ch in channels:
            await ch.close()


def check_handle(
    handle: kv_pb.KvHandle,
    mac: bytes,
    token: str | None,
    known_producers: tuple[str, ...] | None,
) -> None:
    """PermissionDenied unless this worker may pull from the handle's producer: with a token, mac
    must be handle_mac(token, handle); with known_producers, the endpoint must be one of them."""
    endpoint = handle.producer.endpoint
    if token:
        if not mac:
            raise PermissionDenied("kv_handle_mac is missing; this worker requires signed KV handles")
        if not verify_handle_mac(token, handle, mac):
            raise PermissionDenied("kv_handle_mac does not match kv_handle")
    if known_producers is not None and endpoint not in known_producers:
        raise PermissionDenied(f"KV producer {endpoint!r} is not one of this worker's --kv-producers")
