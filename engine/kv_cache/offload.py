"""KV-cache offloading: full blocks evicted from the device cache go to a host-memory tier and,
written behind, to a Redis tier shared by every worker on the same Redis; a later request whose
prefix misses the device cache loads the longest run of blocks found there instead of
recomputing it.

Every tier addresses a block by `<compat>:<chained block hash>` (hashing.py), where `compat` is
the KV cache spec's compatibility hash (spec.py: model, every cache group's geometry, dtype and
layout), so incompatible engines never read each other's blocks. A hybrid spec's other block
tables store theirs under `<key>/<table>`, and evicted state snapshots go under `<key>/state`. A
stored block is the codec's blob (codec.py: a typed header with the compat hash and a CRC32, then
raw bytes) -- never pickle; a block whose header or checksum does not match is treated as missing
(and its run ends there, the rest is recomputed; a hybrid load is all or none, and a failed one
is admitted again, without what failed). A tier that fails (Redis down) is skipped: offloading can
only save work, never fail a request.

A hit of n blocks after the device's asks of the tiers what the KV cache manager's coordinator
asks of the device cache, in every table: all n blocks of the tables that keep the history, of a
window only those the first token computed after the hit reads, and the states after the hit
(stored, or a device snapshot still held).

The tiers are the engine's KV connector (connector.py): the scheduler asks `lookup` how many of
a request's prefix blocks they hold; a request whose blocks may be in Redis waits (in
RequestStatus.WAITING_FOR_REMOTE_KV) while one MGET fetches them on the fetch thread, and is
admitted with them once `poll` says the fetch is done.

Threads: the engine thread calls everything here except `KVOffloader._fetch` (the fetch thread)
and the Redis writer's own thread, which drains a bounded queue of pending writes (dropping the
oldest when full).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.kv_cache.codec import decode_block, decode_states, encode_block, encode_states
from engine.kv_cache.connector import NO_BLOCK, Gauge, KVConnector, KVLoad
from engine.kv_cache.hashing import REDIS_KEY_PREFIX, tier_key
from engine.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)

_BAD_KEPT = 4096
"""Failed keys remembered (KVOffloader._bad)."""


class HostTier:
    """A bounded LRU pool of encoded blocks in CPU memory."""

    name = "host"
    local = True

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError(f"kv_host_blocks must be >= 1, got {capacity_blocks}")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[str, bytes] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: str, blob: bytes) -> None:
        self._blocks[key] = blob
        self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
            self.evictions += 1

    def get(self, key: str) -> bytes | None:
        blob = self._blocks.get(key)
        if blob is not None:
            self._blocks.move_to_end(key)
        return blob

    def contains(self, keys: list[str]) -> list[bool]:
        return [k in self._blocks for k in keys]

    def clear(self) -> None:
        self._blocks.clear()

    def close(self) -> None:
        pass


class RedisTier:
    """Blocks in Redis under REDIS_KEY_PREFIX + key (hashing.py) with a TTL; writes go through a background thread."""

    name = "redis"
    local = False

    def __init__(
        self,
        url: str,
        ttl_s: int = 3600,
        max_pending: int = 1024,
        timeout_s: float = 0.5,
        backoff_s: float = 5.0,
    ):
        import redis  # a service dependency; the engine imports it only when this tier is on

        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self.errors = 0
        self.backoff_s = backoff_s
        self._down_until = 0.0  # after a failure reads skip Redis for a while instead of timing out each time
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-redis", daemon=True)
        self._writer.start()

    @staticmethod
    def _rkey(key: str) -> str:
        return REDIS_KEY_PREFIX + key

    @property
    def pending(self) -> int:
        return self._pending.qsize()

    def put(self, key: str, blob: bytes) -> None:
        """Queue a write-behind; when the queue is full the oldest pending write is dropped."""
        while True:
            try:
                self._pending.put_nowait((key, blob))
                return
            except queue.Full:
                try:
                    self._pending.get_nowait()
                except queue.Empty:
                    pass

    def _write_loop(self) -> None:
        while not self._stop.is_set():
            try:
                key, blob = self._pending.get(timeout=0.1)
            except queue.Empty:
                continue
            try:
                self.client.set(self._rkey(key), blob, ex=self.ttl_s, nx=False)
            except Exception as e:  # noqa: BLE001 - Redis down: the block is simply not shared
                self._failed("write to", e)
            finally:
                self._pending.task_done()

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until queued writes are done (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._pending.unfinished_tasks

    def _failed(self, what: str, e: Exception) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + self.backoff_s
        logger.debug("KV offload %s Redis failed: %s", what, e)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """One MGET (the fetch thread calls it; the engine thread never does)."""
        if not keys or not self.available:
            return [None] * len(keys)
        try:
            return self.client.mget([self._rkey(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            self._failed("read from", e)
            return [None] * len(keys)

    def close(self) -> None:
        self._stop.set()
        self._writer.join(timeout=2)
        try:
            self.client.close()
        except Exception:  # noqa: BLE001
            pass


@dataclass
class OffloadStats:
    stored_blocks: int = 0
    stored_bytes: int = 0
    loaded_blocks: dict[str, int] = field(default_factory=lambda: {"host": 0, "redis": 0})
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    checksum_failures: int = 0
    lookups: int = 0


class KVOffloader(KVConnector):
    """The offload tiers as the engine's KV connector. The engine thread calls everything except
    `_fetch`, which runs on the fetch thread: a request's remote lookup is one MGET there (the
    blocks come back with the answer), so no Redis round trip ever happens on the engine thread."""

    def __init__(self, spec: KVCacheSpec, caches: list[torch.Tensor], tiers: list):
        spec.check_caches(caches)
        self.spec = spec
        self.caches = caches
        self.compat = spec.compat_hash()
        self.tiers = tiers
        self.local = [t for t in tiers if t.local]
        self.remote = [t for t in tiers if not t.local]
        self.stats = OffloadStats()
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-fetch")
        self._fetches: dict[str, Future] = {}
        """request_id -> its remote lookup in flight on the fetch thread."""
        self._found: dict[str, dict[str, tuple[str, bytes]]] = {}
        """request_id -> what its finished remote lookup brought: key -> (tier name, blob). Kept
        until the request is admitted or ends (release), so a request waiting for free blocks
        does not look up again."""
        self._bad: OrderedDict[str, None] = OrderedDict()
        """Keys whose every copy failed its header or checksum: lookups no longer count them
        (until stored again), so a request is not planned onto them twice."""

    def key(self, block_hash: bytes, table: int | str = 0) -> str:
        """A block of block table `table` (the first table's key is the block's own: what the
        router looks for in Redis), or with table="state" the states after it."""
        key = tier_key(self.compat, block_hash)
        return key if table == 0 else f"{key}/{table}"

    def gauges(self) -> list[Gauge]:
        stats = self.stats
        return [
            Gauge(
                "pdserve_kv_offload_stored_bytes",
                "KV bytes copied out of the device cache",
                lambda: stats.stored_bytes,
            ),
            Gauge(
                "pdserve_kv_offload_loaded_bytes",
                "KV bytes loaded back from offload tiers",
                lambda: stats.loaded_bytes,
            ),
            Gauge(
                "pdserve_kv_offload_load_seconds",
                "Time spent loading offloaded blocks",
                lambda: stats.load_seconds,
            ),
            Gauge(
                "pdserve_kv_offload_checksum_failures",
                "Offloaded blocks rejected by checksum",
                lambda: stats.checksum_failures,
            ),
        ] + [
            Gauge(
                f"pdserve_kv_offload_hits_{tier.name}",
                f"Blocks loaded from the {tier.name} tier",
                lambda name=tier.name: stats.loaded_blocks.get(name, 0),
            )
            for tier in self.tiers
        ]

    @property
    def num_fetching(self) -> int:
        return len(self._fetches)

    # ---- scheduler side -------------------------------------------------------------------

    def lookup(
        self,
        request_id: str,
        block_hashes: list[bytes],
        first_block: int = 0,
        device_states: Callable[[bytes], bool] | None = None,
    ) -> int | None:
        fut = self._fetches.get(request_id)
        if fut is not None:
            if not fut.done():
                return None
            del self._fetches[request_id]
            try:
                self._found[request_id] = fut.result()
            except Exception as e:  # noqa: BLE001 - the request just recomputes
                logger.debug("KV offload fetch failed: %s", e)
                self._found[request_id] = {}
        keys = self._keys(block_hashes)
        found = self._found.get(request_id) or {}
        held = {k for k in keys if k in found and k not in self._bad}
        for tier in self.local:
            held.update(
                k for k, hit in zip(keys, tier.contains(keys), strict=True) if hit and k not in self._bad
            )
        run = self._longest(held, block_hashes, first_block, device_states)
        remote = [t for t in self.remote if t.available]
        if request_id not in self._found and run < len(block_hashes) and remote:
            self._fetches[request_id] = self._fetcher.submit(
                self._fetch, remote, [k for k in keys if k not in held]
            )
            return None
        self.stats.lookups += 1
        return run

    def _keys(self, block_hashes: list[bytes]) -> list[str]:
        """Every key a hit over these blocks may need: each table's blocks, and the states."""
        keys = [self.key(h, t) for t in range(len(self.spec.tables)) for h in block_hashes]
        if self.spec.states:
            keys += [self.key(h, "state") for h in block_hashes]
        return keys

    def _longest(
        self,
        held: set[str],
        block_hashes: list[bytes],
        first_block: int,
        device_states: Callable[[bytes], bool] | None = None,
    ) -> int:
        """The most blocks n a hit after first_block device blocks can load from `held`: the
        tables that keep the history need all n, a window table only the blocks the token after
        them reads, and the states after block n - 1 must be held (or be a device snapshot)."""
        spec, bs = self.spec, self.spec.block_size
        n = len(block_hashes)
        for t, table in enumerate(spec.tables):
            if not table.windowed:
                n = next((i for i, h in enumerate(block_hashes[:n]) if self.key(h, t) not in held), n)
        windows = [t for t, table in enumerate(spec.tables) if table.windowed]
        for m in range(n, 0, -1):
            if spec.states and self.key(block_hashes[m - 1], "state") not in held:
                if device_states is None or not device_states(block_hashes[m - 1]):
                    continue
            if all(
                self.key(block_hashes[i], t) in held
                for t in windows
                for i in range(
                    max(0, spec.tables[t].first_needed((first_block + m) * bs, bs) - first_block), m
                )
            ):
                return m
        return 0

    def on_evict(self, block_hash: bytes, block_id: int, table: int = 0) -> None:
        """A cached full block is about to be reused: keep its bytes in the tiers."""
        self._store(self.key(block_hash, table), encode_block(self.spec, self.caches, block_id, table))

    def on_evict_state(self, block_hash: bytes, states: tuple) -> None:
        """A state snapshot is about to be dropped: keep it in the tiers, for the hits it serves."""
        self._store(self.key(block_hash, "state"), encode_states(self.spec, states))

    def _store(self, key: str, blob: bytes) -> None:
        self._bad.pop(key, None)  # written again: intact
        for tier in self.tiers:
            tier.put(key, blob)
        self.stats.stored_blocks += 1
        self.stats.stored_bytes += len(blob)

    def release(self, request_id: str) -> None:
        fut = self._fetches.pop(request_id, None)
        if fut is not None:
            fut.cancel()
        self._found.pop(request_id, None)

    # ---- worker side ------------------------------------------------------------------------

    def load(self, request_id: str, load: KVLoad) -> int:
        start = time.perf_counter()
        try:
            loaded = 0
            for i, block_hash in enumerate(load.block_hashes):
                for t, ids in enumerate(load.tables):
                    if ids[i] != NO_BLOCK and not self._write(request_id, self.key(block_hash, t), ids[i], t):
                        return 0 if load.all_or_none else loaded
                loaded += 1
            if load.states and not self._write(
                request_id, self.key(load.block_hashes[-1], "state"), load.states
            ):
                return 0
            return loaded
        finally:
            self.stats.load_seconds += time.perf_counter() - start

    def _write(self, request_id: str, key: str, where: int | tuple, table: int = 0) -> bool:
        """Write the first intact copy of `key` (a block into block `where` of `table`, or states
        into the views `where`), promoting it to the host tier; a key with no intact copy is not
        counted by lookups any more."""
        sources = [(t.name, t.get(key)) for t in self.local]
        found = self._found.get(request_id, {})
        if key in found:
            sources.append(found[key])
        host = self.local[0] if self.local else None
        for name, blob in sources:
            if blob is None:
                continue
            if isinstance(where, tuple):
                ok = decode_states(self.spec, blob, where)
            else:
                ok = decode_block(self.spec, blob, self.caches, where, table)
            if ok:
                self.stats.loaded_blocks[name] = self.stats.loaded_blocks.get(name, 0) + 1
                self.stats.loaded_bytes += len(blob)
                if host is not None and name != host.name:
                    host.put(key, blob)  # promote to the host tier
                return True
            self.stats.checksum_failures += 1
        self._bad[key] = None
        while len(self._bad) > _BAD_KEPT:
            self._bad.popitem(last=False)
        return False

    def poll(self) -> set[str]:
        return {request_id for request_id, fut in self._fetches.items() if fut.done()}

    @staticmethod
    def _fetch(tiers: list, keys: list[str]) -> dict[str, tuple[str, bytes]]:
        got: dict[str, tuple[str, bytes]] = {}
        for tier in tiers:
            missing = [k for k in keys if k not in got]
            for k, blob in zip(missing, tier.get_many(missing), strict=True):
                if blob is not None:
                    got[k] = (tier.name, blob)
        return got

    def close(self) -> None:
        self._fetcher.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            tier.close()


def make_offloader(cfg, spec: KVCacheSpec, caches: list[torch.Tensor]) -> KVOffloader | None:
    """The tiers an EngineConfig asks for (kv_offload), or None."""
    names = cfg.offload_tiers
    if not names:
        return None
    tiers = []
    if "host" in names:
        tiers.append(HostTier(cfg.kv_host_blocks))
    if "redis" in names:
        tiers.append(RedisTier(cfg.kv_redis_url, ttl_s=cfg.kv_redis_ttl_s))
    return KVOffloader(spec, caches, tiers)
