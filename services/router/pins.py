"""The KV blocks prefill workers pin for hand-overs, metered at the router and shared fairly among
clients.

A prompt handed over pins its blocks on its prefill worker from the prefill until the decode worker
has pulled them; a worker holds at most --max-pinned-fraction of its blocks that way and refuses
more (RESOURCE_EXHAUSTED). Sent straight through, one client's batches (60 x 800-token prompts, four
at once) filled that budget and the other clients' requests got 429s. Here every generation that
is handed over first holds its prompt's blocks in the router's budget (the healthy prefill
workers' limits together), and waits for room instead of being refused; while several wait, the
client holding the fewest blocks goes first (its requests in their order), and the others wait
until it fits, so a client with nothing pinned is never queued behind a heavy one's backlog and a
large request is never starved by small ones. The blocks are held while the worker pins them.

Only the router's event loop uses it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from services.common.errors import ResourceExhausted
from services.router.admission import wait_for_room

CLIENT_SHARE = 0.5
"""The most of the budget one client holds while it holds anything (its first request is never
held back by it): a client alone keeps the prefill workers busy with half, and another arriving
finds the other half."""


@dataclass(eq=False)
class _Waiter:
    client: str
    blocks: int
    order: int
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class PinBudget:
    def __init__(self, capacity: Callable[[], int]):
        """capacity() -> the blocks the prefill workers pin together now (0: unknown, no metering)."""
        self.capacity = capacity
        self.in_use = 0
        self.held: dict[str, int] = {}
        """Blocks each client holds now."""
        self._waiters: list[_Waiter] = []
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @asynccontextmanager
    async def hold(self, client: str, blocks: int, timeout: float):
        """Hold `blocks` for `client` while the body runs; yields the seconds waited. Waits for room
        (see the module docstring) up to `timeout`, then RESOURCE_EXHAUSTED."""
        start = time.monotonic()
        if self.capacity() > 0:
            waiter = _Waiter(client, blocks, next(self._order))
            self._waiters.append(waiter)
            self._admit()

            def withdraw() -> None:
                self._waiters.remove(waiter)
                self._admit()  # the first in line may have changed

            try:
                await wait_for_room(
                    waiter.future, timeout, release=lambda: self._release(waiter), withdraw=withdraw
                )
            except TimeoutError:
                raise ResourceExhausted(
                    f"waited {timeout:.1f} s for {blocks} KV blocks to pin for the hand-over "
                    f"({self.in_use} of {self.capacity()} pinned)",
                    retry_after_s=1.0,
                ) from None
        else:
            waiter = None
        try:
            yield time.monotonic() - start
        finally:
            if waiter is not None:
                self._release(waiter)

    def _release(self, waiter: _Waiter) -> None:
        self.in_use -= waiter.blocks
        left = self.held[waiter.client] - waiter.blocks
        if left:
            self.held[waiter.client] = left
        else:
            del self.held[waiter.client]
        self._admit()

    def _admit(self) -> None:
        """Admit waiters, the client holding the fewest blocks first (then the oldest), while the
        first in line fits. One that does not fit stops the rest: room freed goes to it. A client
        holding blocks may hold up to CLIENT_SHARE of the budget (its first request any size): the
        rest stays for the others, so a newcomer waits for at most that much of its work."""
        capacity = self.capacity()
        while self._waiters:
            eligible = [
                w
                for w in self._waiters
                if not self.held.get(w.client) or self.held[w.client] + w.blocks <= CLIENT_SHARE * capacity
            ]
            if not eligible:
                return
            first = min(eligible, key=lambda w: (self.held.get(w.client, 0), w.order))
            # A request larger than the whole budget waits for all of it (the router refuses
            # one that could never fit before it gets here: RouterCore.check_fits).
            if self.in_use + first.blocks > capacity and self.in_use > 0:
                return
            self._waiters.remove(first)
            self.in_use += first.blocks
            self.held[first.client] = self.held.get(first.client, 0) + first.blocks
            first.future.set_result(None)
