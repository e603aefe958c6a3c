"""Admission control and the per-worker circuit breaker, in isolation."""

from __future__ import annotations

import asyncio

import pytest

from services.common.errors import ResourceExhausted
from services.router import pool as pool_module
from services.router.admission import Admission
from services.router.pool import CircuitBreaker


def test_slots_queue_and_refusal():
    async def main():
        adm = Admission(max_in_flight=2, max_queued=1, queue_timeout_s=5.0)
        release = asyncio.Event()
        order = []

        async def hold(name):
            async with adm.slot() as queued:
                order.append((name, queued > 0))
                await release.wait()

        holders = [asyncio.ensure_future(hold(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0.05)
        assert (adm.in_flight, adm.queued) == (2, 1)
        with pytest.raises(ResourceExhausted) as err:  # the queue is full: refused at once
            async with adm.slot():
                pass
        assert "max_in_flight 2" in str(err.value) and err.value.retry_after_s > 0
        release.set()
        await asyncio.gather(*holders)
        assert [n for n, _ in order] == ["a", "b", "c"] and order[2][1]  # c waited, in arrival order
        assert (adm.in_flight, adm.queued, adm.refused) == (0, 0, 1)

    asyncio.run(main())


def test_queue_timeout_and_a_cancelled_waiter_leave_no_trace():
    async def main():
        adm = Admission(max_in_flight=1, max_queued=4, queue_timeout_s=0.1)
        gate = asyncio.Event()

        async def hold():
            async with adm.slot():
                await gate.wait()

        holder = asyncio.ensure_future(hold())
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted, match="queue_timeout_s"):
            async with adm.slot():
                pass
        waiter = asyncio.ensure_future(adm.slot().__aenter__())
        await asyncio.sleep(0.01)
        assert adm.queued == 1
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
        assert adm.queued == 0
        gate.set()
        await holder
        assert adm.in_flight == 0
        async with adm.slot() as queued:  # free again, no wait
            assert queued < 0.05

    asyncio.run(main())


def test_circuit_breaker_opens_after_repeated_failures_and_closes_on_success(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    breaker = CircuitBreaker(threshold=3, cooldown_s=5.0)
    breaker.failure()
    breaker.failure()
    assert not breaker.open
    breaker.failure()
    assert breaker.open and breaker.trips == 1
    now[0] += 4.9
    assert breaker.open
    now[0] += 0.2  # half-open: one more try is let through
    assert not breaker.open
    breaker.failure()  # and fails: open again at once
    assert breaker.open and breaker.trips == 2
    now[0] += 6
    breaker.success()
    assert not breaker.open and breaker.failures == 0


def test_a_request_weighs_its_generations_and_cannot_take_every_slot():
    """Audit 8: one request of 64 prompts x n = 16 took all 256 slots. Admission counts
    generations; a heavy request waits whole, in arrival order, and a light one behind it waits too
    (no starvation of the heavy one); room comes back on release."""

    async def main():
        adm = Admission(max_in_flight=8, max_queued=10, queue_timeout_s=5.0)
        release = {name: asyncio.Event() for name in ("a", "b", "c")}
        order = []

        async def hold(name, weight):
            async with adm.slot(weight) as queued:
                order.append((name, queued > 0))
                await release[name].wait()

        a = asyncio.ensure_future(hold("a", 6))
        await asyncio.sleep(0.01)
        b = asyncio.ensure_future(hold("b", 4))  # does not fit next to a: waits
        await asyncio.sleep(0.01)
        c = asyncio.ensure_future(hold("c", 1))  # would fit, but b is first in line
        await asyncio.sleep(0.01)
        assert (adm.in_flight, adm.queued) == (6, 5) and [n for n, _ in order] == ["a"]
        with pytest.raises(ValueError, match="max_in_flight 8"):
            async with adm.slot(9):
                pass
        with pytest.raises(ResourceExhausted, match="max_queued 10"):  # 5 queued + 8 > 10
            async with adm.slot(8) as _:
                pass
        release["a"].set()
        await a
        await asyncio.sleep(0.01)
        assert [n for n, _ in order] == ["a", "b", "c"] and adm.in_flight == 5
        release["b"].set()
        release["c"].set()
        await asyncio.gather(b, c)
        assert (adm.in_flight, adm.queued) == (0, 0)

    asyncio.run(main())


def test_a_cancelled_heavy_waiter_at_the_head_lets_the_next_one_in():
    async def main():
        adm = Admission(max_in_flight=4, max_queued=8, queue_timeout_s=5.0)
        gate = asyncio.Event()

        async def hold(weight):
            async with adm.slot(weight):
                await gate.wait()

        holder = asyncio.ensure_future(hold(3))
        await asyncio.sleep(0.01)
        heavy = asyncio.ensure_future(hold(4))
        await asyncio.sleep(0.01)
        light = asyncio.ensure_future(hold(1))
        await asyncio.sleep(0.01)
        assert adm.in_flight == 3 and adm.queued == 5
        heavy.cancel()
        await asyncio.gather(heavy, return_exceptions=True)
        await asyncio.sleep(0.01)
        assert adm.in_flight == 4 and adm.queued == 0  # light went in as soon as heavy left the line
        gate.set()
        await asyncio.gather(holder, light)
        assert adm.in_flight == 0

    asyncio.run(main())
