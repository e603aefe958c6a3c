"""KV-cache offloading: full blocks evicted from the device cache go to a host-memory tier and,
written behind, to a Redis tier shared by every worker on the same Redis; a later request whose
prefix misses the device cache loads the longest run of blocks found there instead of
recomputing it.

Every tier addresses a block by `<compat>:<chained block hash>` (hashing.py), where `compat` is
the KV cache spec's compatibility hash (spec.py: model, every cache group's geometry, dtype and
layout), so incompatible engines never read each other's blocks. A stored block is the codec's
blob (codec.py: a typed header with the compat hash and a CRC32, then raw bytes) -- never pickle;
a block whose header or checksum does not match is treated as missing (and its run ends there,
the rest is recomputed). A tier that fails (Redis down) is skipped: offloading can only save work,
never fail a request.

Threads: the engine thread calls everything here except the Redis writer's own thread, which
drains a bounded queue of pending writes (dropping the oldest when full).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from engine.kv_cache.codec import decode_block, encode_block
from engine.kv_cache.spec import KVCacheSpec

logger = logging.getLogger(__name__)


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
    """Blocks in Redis under `pdkv:<key>` with a TTL; writes go through a background thread."""

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
        return f"pdkv:{key}"

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

    def get(self, key: str) -> bytes | None:
        if not self.available:
            return None
        try:
            return self.client.get(self._rkey(key))
        except Exception as e:  # noqa: BLE001
            self._failed("read from", e)
            return None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys or not self.available:
            return [None] * len(keys)
        try:
            return self.client.mget([self._rkey(k) for k in keys])
        except Exception as e:  # noqa: BLE001
            self._failed("read from", e)
            return [None] * len(keys)

    def contains(self, keys: list[str]) -> list[bool]:
        if not keys or not self.available:
            return [False] * len(keys)
        try:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._rkey(k))
            return [bool(x) for x in pipe.execute()]
        except Exception as e:  # noqa: BLE001
            self._failed("lookup in", e)
            return [False] * len(keys)

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


class KVOffloader:
    """Owned by the engine (its thread): copies evicted blocks out, finds and loads prefixes."""

    def __init__(self, spec: KVCacheSpec, caches: list[torch.Tensor], tiers: list):
        spec.check_caches(caches)
        self.spec = spec
        self.caches = caches
        self.compat = spec.compat_hash()
        self.tiers = tiers
        self.stats = OffloadStats()
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="kv-offload-fetch")
        self._fetches: dict[str, Future] = {}
        """request_id -> background fetch of its remote blocks."""
        self._staged: dict[str, tuple[str, bytes]] = {}
        self._fetched: set[str] = set()
        """Requests whose fetch finished and that are waiting to be admitted."""
        """Fetched remote blocks waiting for their request's admission: key -> (tier name, blob)."""

    # ---- remote blocks are fetched off the engine thread; the request waits meanwhile ---------

    def needs_fetch(self, request_id: str, block_hashes: list[bytes]) -> bool:
        """Some of these blocks are only in a remote tier and the request has not been fetched for
        yet (one fetch per admission: what it did not bring is recomputed)."""
        if request_id in self._fetched:
            return False
        keys = [self.key(h) for h in block_hashes if self.key(h) not in self._staged]
        local = [t for t in self.tiers if t.local]
        for tier in local:
            keys = [k for k, hit in zip(keys, tier.contains(keys), strict=True) if not hit]
        return bool(keys)

    def start_fetch(self, request_id: str, block_hashes: list[bytes]) -> None:
        if request_id in self._fetches:
            return
        keys = [self.key(h) for h in block_hashes]
        remote = [t for t in self.tiers if not t.local]
        self._fetches[request_id] = self._fetcher.submit(self._fetch, remote, keys)

    @staticmethod
    def _fetch(tiers: list, keys: list[str]) -> dict[str, tuple[str, bytes]]:
        got: dict[str, tuple[str, bytes]] = {}
        for tier in tiers:
            missing = [k for k in keys if k not in got]
            blobs = tier.get_many(missing) if hasattr(tier, "get_many") else [tier.get(k) for k in missing]
            for k, blob in zip(missing, blobs, strict=True):
                if blob is not None:
                    got[k] = (tier.name, blob)
        return got

    def fetch_done(self, request_id: str) -> bool:
        """True once the request's fetch finished; its blocks are then staged for load()."""
        fut = self._fetches.get(request_id)
        if fut is None or not fut.done():
            return fut is None
        del self._fetches[request_id]
        self._fetched.add(request_id)
        try:
            self._staged.update(fut.result())
        except Exception as e:  # noqa: BLE001 - the request just recomputes
            logger.debug("KV offload fetch failed: %s", e)
        return True

    def cancel_fetch(self, request_id: str) -> None:
        fut = self._fetches.pop(request_id, None)
        if fut is not None:
            fut.cancel()
        self._fetched.discard(request_id)

    def admitted(self, request_id: str) -> None:
        self._fetched.discard(request_id)

    @property
    def num_fetching(self) -> int:
        return len(self._fetches)

    def key(self, block_hash: bytes) -> str:
        return f"{self.compat}:{block_hash.hex()}"

    def on_evict(self, block_hash: bytes, block_id: int) -> None:
        """A cached full block is about to be reused: keep its bytes in the tiers."""
        blob = encode_block(self.spec, self.caches, block_id)
        key = self.key(block_hash)
        for tier in self.tiers:
            tier.put(key, blob)
        self.stats.stored_blocks += 1
        self.stats.stored_bytes += len(blob)

    def stage(self, blobs: dict[str, tuple[str, bytes]]) -> None:
        """Blocks fetched from a remote tier off the engine thread (see fetch), for load()."""
        self._staged.update(blobs)

    def unstage(self, block_hashes: list[bytes]) -> None:
        for h in block_hashes:
            self._staged.pop(self.key(h), None)

    def fetch(self, block_hashes: list[bytes]) -> dict[str, tuple[str, bytes]]:
        """Read these blocks from the remote tiers (any thread; blocking)."""
        return self._fetch([t for t in self.tiers if not t.local], [self.key(h) for h in block_hashes])

    def find(self, block_hashes: list[bytes]) -> int:
        """How many of these (consecutive) blocks some tier (or the staged fetches) holds, from
        the first on."""
        self.stats.lookups += 1
        keys = [self.key(h) for h in block_hashes]
        found = [k in self._staged for k in keys]
        for tier in self.tiers:
            missing = [i for i, f in enumerate(found) if not f]
            for i, hit in zip(missing, tier.contains([keys[i] for i in missing]), strict=True):
                found[i] = hit
        run = 0
        while run < len(found) and found[run]:
            run += 1
        return run

    def load(self, block_hashes: list[bytes], block_ids: list[int]) -> int:
        """Load blocks into the given device blocks, in order; stops at the first block no tier
        can give intact. Returns how many were loaded."""
        start = time.perf_counter()
        loaded = 0
        host = next((t for t in self.tiers if t.local), None)
        for block_hash, block_id in zip(block_hashes, block_ids, strict=True):
            key = self.key(block_hash)
            ok = False
            sources = [(t.name, t.get(key)) for t in self.tiers if t.local]
            if key in self._staged:
                sources.append(self._staged.pop(key))
            for name, blob in sources:
                if blob is None:
                    continue
                if decode_block(self.spec, blob, self.caches, block_id):
                    ok = True
                    self.stats.loaded_blocks[name] = self.stats.loaded_blocks.get(name, 0) + 1
                    self.stats.loaded_bytes += len(blob)
                    if host is not None and name != host.name:
                        host.put(key, blob)  # promote to the host tier
                    break
                self.stats.checksum_failures += 1
            if not ok:
                break
            loaded += 1
        for block_hash in block_hashes[loaded:]:
            self._staged.pop(self.key(block_hash), None)
        self.stats.load_seconds += time.perf_counter() - start
        return loaded

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
