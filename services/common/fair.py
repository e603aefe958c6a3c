"""Blocking work shared fairly among clients: one client's backlog delays only itself.

The router prepares requests (parses JSON, renders chat templates, tokenizes, checks grammars) on
threads, off its event loop. With one FIFO queue, a client that sends many expensive requests puts
every other client behind all of them (12 schemas that each took 0.85 s to check held an unrelated
request for 12 s). Here each client has its own queue and runs one job at a time, and the clients
with work waiting take turns for the threads: another client's job waits at most for the jobs
already running, whatever one client has queued.

A client is named by the caller (`client_id`: its API key's digest where the key was checked,
else its address).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.common.errors import ResourceExhausted
from services.common.threads import named_pool

T = TypeVar("T")


def client_id(api_key: str | None, address: str | None) -> str:
    """Who a request comes from, for fairness and per-client limits: the digest of an API key the
    server checked (never the key), else the peer's address without its port (a client's
    connections share it), else "unknown"."""
    if api_key:
        return "key:" + hashlib.sha256(api_key.encode()).hexdigest()[:16]
    if address:
        return "addr:" + _host(address)
    return "unknown"


def _host(address: str) -> str:
    """`ipv4:1.2.3.4:5678` (gRPC), `[::1]:5678`, `1.2.3.4` (aiohttp's remote) -> the host."""
    for scheme in ("ipv4:", "ipv6:", "unix:"):
        address = address.removeprefix(scheme)
    if address.startswith("["):
        return address[1 : address.find("]")] if "]" in address else address
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and host.count(":") == 0:  # an IPv6 address without brackets keeps its colons
        return host
    return address


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple
    future: asyncio.Future


@dataclass(eq=False)
class _Client:
    jobs: deque[_Job] = field(default_factory=deque)
    running: bool = False


class FairExecutor:
    """Runs blocking calls on `threads` threads, fairly among clients. Only the event loop calls it.

    Each client runs one job at a time (in the order it submitted them); clients with a job
    waiting are served in turn, so while another client's backlog grows, a new client's job starts
    as soon as a thread is free. A client with `max_waiting` jobs queued gets RESOURCE_EXHAUSTED
    for the next. A caller cancelled while its job waits takes the job out of the queue; one
    cancelled while its job runs lets it finish and drops the result."""

    def __init__(self, threads: int, name: str, max_waiting: int = 256):
        if threads < 1 or max_waiting < 1:
            raise ValueError(f"threads and max_waiting must be >= 1, got {threads} and {max_waiting}")
        self.threads = threads
        self.name = name
        self.max_waiting = max_waiting
        self._pool: ThreadPoolExecutor | None = None
        self._clients: dict[str, _Client] = {}
        self._turns: deque[str] = deque()  # clients with a job waiting and none running, in turn order
        self._running = 0

    @property
    def waiting(self) -> int:
        """Jobs queued, every client's."""
        return sum(len(c.jobs) for c in self._clients.values())

    async def run(self, client: str, fn: Callable[..., T], *args) -> T:
        """fn(*args) on one of the threads, in `client`'s turn; its result or exception."""
        state = self._clients.setdefault(client, _Client())
        if len(state.jobs) >= self.max_waiting:
            raise ResourceExhausted(
                f"{len(state.jobs)} requests from this client wait to be prepared ({self.name}); "
                f"the limit is {self.max_waiting} a client",
                retry_after_s=1.0,
            )
        job = _Job(fn, args, asyncio.get_running_loop().create_future())
        job.future.add_done_callback(_retrieve)  # a caller that left never reads it
        state.jobs.append(job)
        if not state.running and client not in self._turns:
            self._turns.append(client)
        self._dispatch()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            if job in state.jobs:  # still waiting: never runs
                state.jobs.remove(job)
                job.future.cancel()
                self._forget_if_idle(client)
            raise

    def _dispatch(self) -> None:
        """Start the next clients' jobs while threads are free."""
        while self._running < self.threads and self._turns:
            client = self._turns.popleft()
            state = self._clients[client]
            if state.running or not state.jobs:
                continue
            job = state.jobs.popleft()
            state.running = True
            self._running += 1
            if self._pool is None:
                self._pool = named_pool(self.threads, self.name)
            done = asyncio.wrap_future(self._pool.submit(job.fn, *job.args))
            done.add_done_callback(lambda f, client=client, job=job: self._finished(client, job, f))

    def _finished(self, client: str, job: _Job, done: asyncio.Future) -> None:
        state = self._clients[client]
        state.running = False
        self._running -= 1
        if done.cancelled():  # the pool shut down
            job.future.cancel()
        elif done.exception() is not None:
            job.future.set_exception(done.exception())
        else:
            job.future.set_result(done.result())
        if state.jobs:
            self._turns.append(client)  # to the back: the others waiting go first
        else:
            self._forget_if_idle(client)
        self._dispatch()

    def _forget_if_idle(self, client: str) -> None:
        state = self._clients.get(client)
        if state is not None and not state.running and not state.jobs:
            del self._clients[client]
            if client in self._turns:
                self._turns.remove(client)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
