"""Registry backed by Redis: one hash per worker rank, expired by TTL unless a heartbeat refreshes it."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from services.registry.base import Registry, WorkerRecord

logger = logging.getLogger(__name__)

URL_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes `RedisRegistry` accepts, e.g. `redis://host:port/db`."""

# What "Redis is unreachable" looks like: refused or reset connections, socket timeouts, DNS failures.
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_GLOB_SPECIALS = "\\*?[]"


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in _GLOB_SPECIALS else c for c in text)


def _redact(url: str) -> str:
    """The URL without credentials, for log lines and error messages."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    return parts._replace(netloc=netloc).geturl()


class RedisRegistry(Registry):
    """Each worker is the hash `prefix + endpoint` (fields of `WorkerRecord.to_hash`) with a TTL.

    `register` writes the hash and its expiry in one MULTI, so an entry never lives without a TTL
    and a worker whose heartbeats stop disappears within `ttl_s`. `list_workers` SCANs `prefix*`,
    skips (logging once per entry) hashes that do not parse, and serves the last list it read
    while Redis is unreachable (one warning per outage). Sockets time out after `socket_timeout_s`
    and a failed command is retried once (to replace a connection a Redis restart broke), so a
    dead Redis never hangs the caller for more than about twice that.

    With a `key` (the internal token), `register` signs every record (`WorkerRecord.to_hash(key)`)
    and `list_workers` skips, like malformed entries, records whose signature is missing or wrong:
    writing to Redis is then not enough to advertise a worker. Without a key, records are written
    and accepted unsigned (the explicitly insecure mode).
    """

    def __init__(
        self,
        url: str,
        prefix: str = "pdserve:worker:",
        socket_timeout_s: float = 1.0,
        key: str | None = None,
    ) -> None:
        if urlsplit(url).scheme not in URL_SCHEMES:
            raise ValueError(f"registry url must use one of the schemes {URL_SCHEMES}, got {_redact(url)!r}")
        if not prefix:
            raise ValueError("registry prefix must be non-empty (it namespaces the worker keys)")
        if socket_timeout_s <= 0:
            raise ValueError(f"registry socket_timeout_s must be > 0, got {socket_timeout_s}")
        if key is not None and not key:
            raise ValueError("registry key must be non-empty (or None for unsigned records)")
        self.url = _redact(url)
        self.prefix = prefix
        self._mac_key = key
        self._prefix_bytes = prefix.encode()
        self._match = _glob_escape(prefix) + "*"
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), retries=1),
        )
        self._last_known: list[WorkerRecord] = []
        self._in_outage = False
        self._malformed_keys: set[bytes] = set()  # logged already; forgotten once fixed or gone

    def _key(self, endpoint: str) -> str:
        return self.prefix + endpoint

    async def register(self, record: WorkerRecord, ttl_s: float) -> None:
        """Create or replace the worker's hash with a `ttl_s` expiry; ConnectionError if unreachable."""
        if not ttl_s > 0:
            raise ValueError(f"registry ttl_s must be > 0, got {ttl_s}")
        key = self._key(record.endpoint)
        try:
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(key)  # replace, never merge with a stale hash
                pipe.hset(key, mapping=record.to_hash(self._mac_key))
                pipe.pexpire(key, max(1, round(ttl_s * 1000)))
                await pipe.execute()
        except _UNREACHABLE as exc:
            raise ConnectionError(f"registry redis at {self.url} unreachable: {exc}") from exc

    async def deregister(self, endpoint: str) -> None:
        """Delete the worker's hash; ConnectionError if unreachable."""
        try:
            await self._client.delete(self._key(endpoint))
        except _UNREACHABLE as exc:
            raise ConnectionError(f"registry redis at {self.url} unreachable: {exc}") from exc

    async def list_workers(self) -> list[WorkerRecord]:
        try:
            records = await self._read()
        except _UNREACHABLE as exc:
            if not self._in_outage:
                self._in_outage = True
                logger.warning(
                    "registry redis at %s unreachable (%s); serving the last-known %d workers",
                    self.url,
                    exc,
                    len(self._last_known),
                )
            return list(self._last_known)
        if self._in_outage:
            self._in_outage = False
            logger.info("registry redis at %s reachable again; %d workers", self.url, len(records))
        self._last_known = records
        return list(records)

    async def _read(self) -> list[WorkerRecord]:
        # SCAN may return a key more than once; dict.fromkeys dedupes and keeps order.
        keys = list(
            dict.fromkeys(
                [key async for key in self._client.scan_iter(match=self._match, count=256, _type="hash")]
            )
        )
        if not keys:
            self._malformed_keys.clear()
            return []
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            hashes = await pipe.execute()
        records: list[WorkerRecord] = []
        malformed: set[bytes] = set()
        for key, raw in zip(keys, hashes, strict=True):
            if not raw:
                continue  # expired between SCAN and HGETALL
            try:
                record = self._parse(key, raw)
            except ValueError as exc:
                malformed.add(key)
                if key not in self._malformed_keys:
                    logger.warning("registry: skipping malformed or unsigned entry %r: %s", key, exc)
                continue
            records.append(record)
        self._malformed_keys = malformed
        records.sort(key=lambda record: record.endpoint)
        return records

    def _parse(self, key: bytes, raw: dict[bytes, bytes]) -> WorkerRecord:
        record = WorkerRecord.from_hash(raw, self._mac_key)
        key_endpoint = key[len(self._prefix_bytes) :].decode("utf-8", "replace")
        if record.endpoint != key_endpoint:
            raise ValueError(
                f"worker record: field 'endpoint' is {record.endpoint!r} but the key names {key_endpoint!r}"
            )
        return record

    async def close(self) -> None:
        await self._client.aclose()
