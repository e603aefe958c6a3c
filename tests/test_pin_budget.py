"""services/router/pins.py: the prefill workers' pinned KV blocks metered at the router, shared fairly
among clients. Room is waited for, not refused; while several wait, the client holding the fewest
blocks goes first and the others wait until it fits (no starvation of a large request); a client
holding blocks holds at most half the budget; a wait past its timeout is RESOURCE_EXHAUSTED with
nothing held; blocks come back when a hold ends."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ResourceExhausted
from services.router.pins import PinBudget


async def _holding(budget: PinBudget, client: str, blocks: int, log: list, release: asyncio.Event, name=None):
    """Hold blocks until `release`; log `name` (default: the client) once they are held."""
    async with budget.hold(client, blocks, 5.0):
        log.append(name or client)
        await release.wait()


def test_the_client_holding_least_goes_first_within_its_share_and_a_large_request_is_not_starved():
    async def main():
        budget = PinBudget(lambda: 10)  # a client holding blocks holds at most 5 more
        names = ("a1", "a2", "b1", "c-big", "b2")
        log, gates, task = [], {name: asyncio.Event() for name in names}, {}
        for name, client, blocks in (
            ("a1", "a", 6),
            ("a2", "a", 4),
            ("b1", "b", 3),
            ("c-big", "c", 9),
            ("b2", "b", 1),
        ):
            task[name] = asyncio.ensure_future(_holding(budget, client, blocks, log, gates[name], name))
            await asyncio.sleep(0.01)
        # a1: a's first request, any size. a2 waits (a would hold 10, past half); b1 fits; c-big
        # (c holds nothing, so it is first in line) does not fit, and b2 waits behind it.
        assert log == ["a1", "b1"] and budget.held == {"a": 6, "b": 3} and budget.waiting == 3
        gates["a1"].set()  # a holds nothing again: a2 came before c-big
        await asyncio.sleep(0.01)
        assert log == ["a1", "b1", "a2"] and budget.in_use == 7
        gates["b1"].set()  # 6 free: not enough for c-big, which b2 (smaller, later) does not pass
        await asyncio.sleep(0.01)
        assert log == ["a1", "b1", "a2"] and budget.in_use == 4
        gates["a2"].set()
        await asyncio.sleep(0.01)
        assert log[3:] == ["c-big", "b2"] and budget.held == {"c": 9, "b": 1}
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*task.values())
        assert budget.in_use == 0 and budget.held == {} and budget.waiting == 0

    asyncio.run(main())


def test_a_wait_past_its_timeout_is_refused_holding_nothing_and_no_capacity_means_no_metering():
    async def main():
        budget = PinBudget(lambda: 4)
        release = asyncio.Event()
        holder = asyncio.ensure_future(_holding(budget, "a", 4, [], release))
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted, match=r"waited 0.1 s for 2 KV blocks .*\(4 of 4 pinned\)"):
            async with budget.hold("b", 2, 0.1):
                pass
        assert budget.waiting == 0 and budget.held == {"a": 4}
        waiting = asyncio.ensure_future(_holding(budget, "b", 2, [], release))
        await asyncio.sleep(0.01)
        waiting.cancel()  # a client gone while it waits
        await asyncio.sleep(0.01)
        assert budget.waiting == 0
        release.set()
        await holder
        assert budget.in_use == 0
        unmetered = PinBudget(lambda: 0)  # no prefill worker says what it pins
        async with unmetered.hold("a", 1000, 0.1) as waited:
            assert waited == 0 or waited < 0.01
        assert unmetered.in_use == 0

    asyncio.run(main())
