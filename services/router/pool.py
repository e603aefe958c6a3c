"""The router's view of its workers: discovered from the registry, described by GetEngineInfo,
weighed by GetLoad, and remembered by the prompts routed to them (prefix affinity).

Only the router's event loop touches the pool. A worker that fails a probe or an RPC with
UNAVAILABLE is unhealthy until a probe succeeds again. When the registry cannot be read the
pool keeps the workers it knew (last-known state), and a worker missing from a listing is kept
(and probed) for `absent_grace_s` before it is dropped: a Redis restarted empty must not drop every
worker at once while their heartbeats are about to re-register them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.grpc_utils import channel
from services.common.security import Security
from services.registry import Registry
from services.router.subscription import DecodeSubscription

logger = logging.getLogger(__name__)

ROLE_NAMES = {
    wpb.WORKER_ROLE_PREFILL: "prefill",
    wpb.WORKER_ROLE_DECODE: "decode",
    wpb.WORKER_ROLE_COLOCATED: "colocated",
}
PROBE_TIMEOUT_S = 2.0
ABSENT_GRACE_S = 10.0
"""How long a worker missing from the registry stays in the pool: the workers' heartbeat TTL."""


class PrefixIndex:
    """Block hashes of prompts recently routed to one worker, most recent last (bounded LRU).
    An approximation of the worker's prefix cache: it may have evicted what we remember."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def match(self, hashes: list[bytes]) -> int:
        """Leading blocks of the prompt this worker probably holds."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n


class CircuitBreaker:
    """Stops traffic to a worker that keeps failing: after `threshold` failures in a row it opens
    for `cooldown_s`; then the next request (or a successful probe) tries it again, and one more
    failure opens it again at once."""

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0):
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self.failures = 0
        self.open_until = 0.0
        self.trips = 0

    @property
    def open(self) -> bool:
        return time.monotonic() < self.open_until

    def failure(self) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            if not self.open:
                self.trips += 1
                logger.warning(
                    "circuit breaker open for %.1f s after %d failures", self.cooldown_s, self.failures
                )
            self.open_until = time.monotonic() + self.cooldown_s

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0


@dataclass(eq=False)
class WorkerHandle:
    endpoint: str
    channel: grpc.aio.Channel
    worker: wgrpc.WorkerStub
    kv: kv_grpc.KvTransferStub
    info: wpb.EngineInfo | None = None
    load: wpb.Load = field(default_factory=wpb.Load)
    healthy: bool = False
    in_flight: int = 0
    """Requests the router has on this worker now (fresher than the polled load)."""
    prompt_tokens_in_flight: int = 0
    """Prompt tokens the router sent here to prefill whose first token has not come back: a
    prefill rank's queue, and a decode rank's colocated prompts."""
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    last_seen: float = 0.0
    last_listed: float = field(default_factory=time.monotonic)
    """When the registry last listed this endpoint (monotonic); dropped once absent past the grace."""
    subscription: DecodeSubscription = field(init=False)
    """The worker's Decode outputs, a message per step for all of this router's calls."""

    def __post_init__(self) -> None:
        self.subscription = DecodeSubscription(self.worker, self.endpoint)

    @property
    def role(self) -> str:
        return ROLE_NAMES.get(self.info.role, "") if self.info is not None else ""

    def can(self, stage: str) -> bool:
        return (
            self.healthy
            and self.info is not None
            and not self.load.draining
            and self.role in (stage, "colocated")
        )

    @property
    def score(self) -> float:
        """Lower is less loaded: requests on it (ours and its queue) plus KV pressure."""
        return self.in_flight + self.load.num_waiting + 4.0 * self.load.kv_usage


class WorkerPool:
    def __init__(
        self,
        registry: Registry,
        refresh_s: float = 1.0,
        probe_s: float = 0.5,
        security: Security | None = None,
        absent_grace_s: float = ABSENT_GRACE_S,
    ):
        if absent_grace_s < 0:
            raise ValueError(f"absent_grace_s must be >= 0, got {absent_grace_s}")
        self.registry = registry
        self.absent_grace_s = absent_grace_s
        self.security = security
        self.refresh_s = refresh_s
        self.probe_s = probe_s
        self.workers: dict[str, WorkerHandle] = {}
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for w in self.workers.values():
            await w.subscription.close()
            await w.channel.close()
        await self.registry.close()

    def healthy(self, stage: str) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.can(stage)]

    def mark_unhealthy(self, w: WorkerHandle, why: str) -> None:
        if w.healthy:
            logger.warning("worker %s unhealthy: %s", w.endpoint, why)
        w.healthy = False

    async def wait_for(self, predicate, timeout: float) -> bool:
        """Wait until predicate(pool) holds (checked after every probe round)."""
        deadline = time.monotonic() + timeout
        while not predicate(self):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return predicate(self)
        return True

    async def _run(self) -> None:
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(self.probe_s)
            if time.monotonic() - last_refresh >= self.refresh_s:
                last_refresh = time.monotonic()
                await self.refresh()
            else:
                await self.probe_all()

    async def refresh(self) -> None:
        """Re-read the registry: add new endpoints, drop ones absent from it for longer than
        `absent_grace_s`, then probe all (a dead worker kept through the grace fails its probes
        and is unhealthy, so nothing is routed to it)."""
        try:
            records = await self.registry.list_workers()
        except Exception as e:  # noqa: BLE001 - keep serving from what we know
            logger.warning("registry read failed (%s); keeping %d known workers", e, len(self.workers))
            records = None
        if records is not None:
            now = time.monotonic()
            listed = {r.endpoint for r in records}
            for endpoint in listed:
                w = self.workers.get(endpoint)
                if w is not None:
                    w.last_listed = now
                    continue
                ch = channel(endpoint, self.security)
                self.workers[endpoint] = WorkerHandle(
                    endpoint, ch, wgrpc.WorkerStub(ch), kv_grpc.KvTransferStub(ch), last_listed=now
                )
                logger.info("worker %s discovered", endpoint)
            for endpoint in self.workers.keys() - listed:
                if now - self.workers[endpoint].last_listed <= self.absent_grace_s:
                    continue  # maybe Redis lost it (restarted empty): its heartbeat re-registers it
                w = self.workers.pop(endpoint)
                logger.info("worker %s left the registry", endpoint)
                asyncio.ensure_future(w.channel.close(grace=30.0))
        await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(w) for w in list(self.workers.values())))
        self._changed.set()

    async def _probe(self, w: WorkerHandle) -> None:
        try:
            load = await w.worker.GetLoad(wpb.GetLoadRequest(), timeout=PROBE_TIMEOUT_S)
            if w.info is None or not w.healthy or load.num_total_blocks == 0:  # new, loading or back
                info = await w.worker.GetEngineInfo(wpb.GetEngineInfoRequest(), timeout=PROBE_TIMEOUT_S)
                if load.num_total_blocks == 0:  # still loading its model
                    return
                if w.info is not None and info.identity.epoch != w.info.identity.epoch:
                    logger.info("worker %s restarted (epoch %d)", w.endpoint, info.identity.epoch)
                    w.prefix = PrefixIndex()
                w.info = info
        except grpc.aio.AioRpcError as e:
            self.mark_unhealthy(w, f"probe failed: {e.code().name}")
            return
        if not w.healthy:
            logger.info("worker %s (%s) healthy", w.endpoint, w.role)
        w.load, w.healthy, w.last_seen = load, True, time.monotonic()
