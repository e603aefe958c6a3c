"""Keeps one worker's registry entry alive: re-registers it every interval until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from services.registry.base import Registry, WorkerRecord

logger = logging.getLogger(__name__)


class Heartbeat:
    """An asyncio task that calls `registry.register(record_fn(), ttl_s)` now and every `interval_s`.

    `interval_s` defaults to `ttl_s / 3`, so two beats may be lost before the entry expires, and an
    entry lost with Redis (restarted empty) comes back within one interval. Errors from `record_fn`
    or `register` are logged (a warning when a failure streak starts, info when it ends) and the
    next beat retries; each beat is bounded by `interval_s`. `start` and `stop` are called from the
    event loop that runs the task.
    """

    def __init__(
        self,
        registry: Registry,
        record_fn: Callable[[], WorkerRecord],
        ttl_s: float = 10.0,
        interval_s: float | None = None,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"heartbeat ttl_s must be > 0, got {ttl_s}")
        interval_s = ttl_s / 3 if interval_s is None else interval_s
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"heartbeat interval_s must be in (0, ttl_s={ttl_s}), got {interval_s}")
        self.registry = registry
        self.record_fn = record_fn
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._endpoint: str | None = None  # of the last record built, for deregistering on stop
        self._failing = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start beating (the first beat runs right away). Must be called with an event loop running."""
        if self._task is not None:
            raise RuntimeError("heartbeat already started")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="registry-heartbeat")

    async def beat(self) -> None:
        """Register once; raises what `record_fn` or `register` raise (or TimeoutError)."""
        record = self.record_fn()
        self._endpoint = record.endpoint
        await asyncio.wait_for(self.registry.register(record, self.ttl_s), timeout=self.interval_s)

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except Exception as exc:  # any failure is retried on the next beat
                if not self._failing:
                    logger.warning(
                        "registry heartbeat failed (%r); retrying every %.2fs", exc, self.interval_s
                    )
                else:
                    logger.debug("registry heartbeat still failing: %r", exc)
                self._failing = True
            else:
                if self._failing:
                    logger.info("registry heartbeat recovered")
                self._failing = False
            await asyncio.sleep(self.interval_s)

    async def stop(self, deregister: bool = True) -> None:
        """Cancel the task and, if `deregister`, remove the entry (errors logged, not raised). Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not deregister:
            return
        try:
            endpoint = self._endpoint if self._endpoint is not None else self.record_fn().endpoint
            await asyncio.wait_for(self.registry.deregister(endpoint), timeout=self.interval_s)
        except Exception as exc:  # the TTL removes the entry anyway
            logger.warning("registry deregister on stop failed (%r); the entry expires within its TTL", exc)
