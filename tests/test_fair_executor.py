"""services/common/fair.py: blocking work shared fairly among clients. A client's backlog delays only
itself; each client runs one job at a time and in order; a job whose caller leaves while it waits
never runs; a client's queue is bounded; clients are named by a checked key's digest or an address."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.common.errors import ResourceExhausted
from services.common.fair import FairExecutor, client_id


def _sleeper(log: list, lock: threading.Lock, name: str, seconds: float):
    def job():
        with lock:
            log.append(("start", name, time.monotonic()))
        time.sleep(seconds)
        with lock:
            log.append(("end", name, time.monotonic()))
        return name

    return job


@pytest.mark.parametrize("threads", [1, 2])
def test_a_clients_backlog_delays_only_itself(threads):
    log, lock = [], threading.Lock()

    async def main():
        fair = FairExecutor(threads, "test-fair")
        hog = [asyncio.ensure_future(fair.run("hog", _sleeper(log, lock, f"hog{i}", 0.1))) for i in range(10)]
        await asyncio.sleep(0.02)
        start = time.monotonic()
        assert await fair.run("victim", _sleeper(log, lock, "victim", 0.0)) == "victim"
        victim_s = time.monotonic() - start
        assert [await h for h in hog] == [f"hog{i}" for i in range(10)]
        fair.shutdown()
        return victim_s

    victim_s = asyncio.run(main())
    # One thread: the victim waits for the hog's running job only (0.1 s), not its 9 queued ones.
    # Two: a thread is free for it at once (the hog runs one job at a time).
    assert victim_s < (0.25 if threads == 1 else 0.08), victim_s
    starts = [name for kind, name, _ in log if kind == "start" and name.startswith("hog")]
    assert starts == [f"hog{i}" for i in range(10)]  # the client's own order
    running, most = 0, 0  # the hog never had two jobs running at once
    for kind, name, _ in sorted(log, key=lambda e: e[2]):
        if name.startswith("hog"):
            running += 1 if kind == "start" else -1
            most = max(most, running)
    assert most == 1


def test_turns_go_round_among_waiting_clients():
    order = []

    async def main():
        fair = FairExecutor(1, "test-fair")
        block = threading.Event()
        first = asyncio.ensure_future(fair.run("a", block.wait))
        await asyncio.sleep(0.01)
        jobs = [
            asyncio.ensure_future(fair.run(c, order.append, f"{c}{i}"))
            for c in ("a", "b", "c")
            for i in range(2)
        ]
        await asyncio.sleep(0.01)
        block.set()
        await asyncio.gather(first, *jobs)
        fair.shutdown()

    asyncio.run(main())
    assert order == ["b0", "c0", "a0", "b1", "c1", "a1"]  # a had just run: it goes to the back


def test_a_job_whose_caller_leaves_while_waiting_never_runs_and_errors_come_back():
    ran = []

    async def main():
        fair = FairExecutor(1, "test-fair", max_waiting=2)
        block = threading.Event()
        busy = asyncio.ensure_future(fair.run("a", block.wait))
        await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(fair.run("a", ran.append, "left"))
        kept = asyncio.ensure_future(fair.run("a", ran.append, "kept"))
        await asyncio.sleep(0.01)
        with pytest.raises(ResourceExhausted, match="2 requests from this client wait.*limit is 2"):
            await fair.run("a", ran.append, "refused")
        waiting.cancel()
        await asyncio.sleep(0.01)
        assert fair.waiting == 1
        block.set()
        await asyncio.gather(busy, kept)
        with pytest.raises(ZeroDivisionError):
            await fair.run("b", lambda: 1 / 0)
        assert fair.waiting == 0 and not fair._clients  # nothing kept for idle clients
        fair.shutdown()

    asyncio.run(main())
    assert ran == ["kept"]


def test_clients_are_named_by_a_key_digest_or_their_host():
    assert client_id("sk-secret", "ipv4:10.0.0.1:5555").startswith("key:")
    assert "sk-secret" not in client_id("sk-secret", None)
    assert client_id("sk-a", None) != client_id("sk-b", None)
    assert client_id(None, "ipv4:10.0.0.1:5555") == client_id(None, "ipv4:10.0.0.1:6666") == "addr:10.0.0.1"
    assert client_id(None, "10.0.0.1") == "addr:10.0.0.1"
    assert client_id(None, "ipv6:[::1]:5555") == "addr:::1"
    assert client_id(None, "::1") == "addr:::1"
    assert client_id(None, None) == "unknown"
