"""Admission control, counted in generations: at most `max_in_flight` generations (one per prompt
and sample: a request for 4 prompts with n = 2 weighs 8) run through the router; up to
`max_queued` more wait (each request at most `queue_timeout_s`) for room, first come first
served. Beyond that a request is refused at once with RESOURCE_EXHAUSTED and a retry hint, so
overload costs neither memory nor latency for the requests already admitted.

A request is admitted whole or not at all, and the oldest waiter goes first even when a lighter
one behind it would fit: a heavy request is never starved by a stream of light ones.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from services.common.errors import ResourceExhausted


async def wait_for_room(
    admitted: asyncio.Future, timeout: float, *, release: Callable[[], None], withdraw: Callable[[], None]
) -> None:
    """Waits up to `timeout` for `admitted` (a waiter's future, resolved when it is given room).
    On the timeout (TimeoutError) or a cancel (re-raised), gives back the room when it was given
    just then (`release`), else cancels the future and takes the waiter out of line (`withdraw`).
    The router's admission and its KV pin budget (services/router/pins.py) both wait this way."""
    try:
        async with asyncio.timeout(timeout):  # not wait_for: 3.11's can swallow a cancel
            await asyncio.shield(admitted)
    except (TimeoutError, asyncio.CancelledError):
        if admitted.done() and not admitted.cancelled():
            release()  # admitted just now: give the room back
        else:
            admitted.cancel()
            withdraw()
        raise


@dataclass(eq=False)
class _Waiter:
    weight: int
    future: asyncio.Future


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
        """Generations admitted and not yet finished."""
        self._waiters: deque[_Waiter] = deque()
        self.refused = 0

    @property
    def queued(self) -> int:
        """Generations waiting for room."""
        return sum(w.weight for w in self._waiters)

    def _retry_hint(self) -> float:
        return min(1.0 + 0.1 * len(self._waiters), 30.0)

    def _refuse(self, message: str) -> ResourceExhausted:
        self.refused += 1
        return ResourceExhausted(message, retry_after_s=self._retry_hint())

    @asynccontextmanager
    async def slot(self, weight: int = 1, timeout: float | None = None):
        """Hold room for `weight` generations for the body; yields the seconds spent queued."""
        if not 1 <= weight <= self.max_in_flight:
            raise ValueError(
                f"a request of {weight} generations can never fit in max_in_flight {self.max_in_flight}"
            )
        start = time.monotonic()
        if not self._waiters and self.in_flight + weight <= self.max_in_flight:
            self.in_flight += weight
        elif self.queued + weight > self.max_queued:
            raise self._refuse(
                f"server busy: {self.in_flight} generations in flight (max_in_flight {self.max_in_flight}) and "
                f"{self.queued} queued (max_queued {self.max_queued})"
            )
        else:
            waiter = _Waiter(weight, asyncio.get_running_loop().create_future())
            self._waiters.append(waiter)
            wait = self.queue_timeout_s if timeout is None else min(self.queue_timeout_s, timeout)

            def withdraw() -> None:
                self._waiters.remove(waiter)
                self._admit_waiters()  # the head may have changed

            try:
                await wait_for_room(
                    waiter.future, wait, release=lambda: self._release(weight), withdraw=withdraw
                )
            except TimeoutError:
                raise self._refuse(
                    f"request waited {wait:.1f} s (queue_timeout_s) for room among {self.max_in_flight} "
                    "in-flight generations"
                ) from None
        try:
            yield time.monotonic() - start
        finally:
            self._release(weight)

    def _release(self, weight: int) -> None:
        self.in_flight -= weight
        self._admit_waiters()

    def _admit_waiters(self) -> None:
        """Admit waiters from the head of the queue while they fit."""
        while self._waiters and self.in_flight + self._waiters[0].weight <= self.max_in_flight:
            waiter = self._waiters.popleft()
            self.in_flight += waiter.weight
            waiter.future.set_result(None)
