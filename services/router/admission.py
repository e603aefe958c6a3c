"""Admission control: at most `max_in_flight` requests run through the router; up to `max_queued`
more wait (each at most `queue_timeout_s`) for a slot, first come first served. Beyond that a
request is refused at once with RESOURCE_EXHAUSTED and a retry hint, so overload costs neither
memory nor latency for the requests already admitted."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from contextlib import asynccontextmanager

from services.errors import ResourceExhausted


class Admission:
    """Only the router's event loop uses it."""

    def __init__(self, max_in_flight: int, max_queued: int, queue_timeout_s: float):
        if max_in_flight < 1 or max_queued < 0:
            raise ValueError(
                f"max_in_flight must be >= 1 and max_queued >= 0, got {max_in_flight}, {max_queued}"
            )
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.refused = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _retry_hint(self) -> float:
        return min(1.0 + 0.1 * len(self._waiters), 30.0)

    @asynccontextmanager
    async def slot(self, timeout: float | None = None):
        """Hold one in-flight slot for the body; yields the seconds spent queued."""
        start = time.monotonic()
        if self.in_flight < self.max_in_flight and not self._waiters:
            self.in_flight += 1
        elif len(self._waiters) >= self.max_queued:
            self.refused += 1
            raise ResourceExhausted(
                f"server busy: {self.in_flight} requests in flight (max_in_flight {self.max_in_flight}) and "
                f"{len(self._waiters)} queued (max_queued {self.max_queued})",
                retry_after_s=self._retry_hint(),
            )
        else:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            wait = self.queue_timeout_s if timeout is None else min(self.queue_timeout_s, timeout)
            try:
                await asyncio.wait_for(asyncio.shield(fut), wait)
            except (TimeoutError, asyncio.CancelledError) as e:
                if fut.done() and not fut.cancelled():  # the slot was handed over just now: pass it on
                    self._release()
                else:
                    fut.cancel()
                    self._waiters.remove(fut)
                if isinstance(e, TimeoutError):
                    self.refused += 1
                    raise ResourceExhausted(
                        f"request waited {wait:.1f} s (queue_timeout_s) for one of {self.max_in_flight} slots",
                        retry_after_s=self._retry_hint(),
                    ) from None
                raise
        try:
            yield time.monotonic() - start
        finally:
            self._release()

    def _release(self) -> None:
        """Hand the slot to the oldest waiter, or free it."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot moves over: in_flight unchanged
                return
        self.in_flight -= 1
