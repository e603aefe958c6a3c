"""An EngineCore in its own thread, driven from an asyncio loop.

The engine thread is the only one that touches the core (scheduler, block manager, model). The
loop side sends commands (`call`) that run between two steps and get their result back as a
future, and reads each request's outputs from its own asyncio queue, so the gRPC loop never
waits on a forward pass. The thread steps while there is work and sleeps on the command queue
otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from engine.client import run_step_loop
from engine.engine_core import EngineCore
from engine.outputs import RequestOutput
from services.common.threads import name_os_thread

logger = logging.getLogger(__name__)

T = TypeVar("T")
_IDLE_WAIT_S = 0.1
_LOCKSTEP_IDLE_S = 0.002
"""How long an idle rank of a group waits for commands between two (empty) synchronised steps."""


class StepSink(Protocol):
    """Where a request's outputs go instead of a queue (services/worker/subscriptions.py)."""

    def put(self, item: RequestOutput | BaseException) -> None: ...

    def end_step(self) -> None: ...


class EngineDead(RuntimeError):
    """The engine thread stopped (a step failed or the engine was shut down)."""


FAULTS = ("engine_crash_after_steps", "engine_stall_after_steps")


def parse_fault(spec: str | None) -> tuple[str, int] | None:
    """ "engine_crash_after_steps=N" -> ("engine_crash_after_steps", N); for the reliability tests."""
    if not spec:
        return None
    name, _, value = spec.partition("=")
    if name not in FAULTS or not value.isdigit():
        raise ValueError(f"PDSERVE_FAULT must be one of {', '.join(f + '=N' for f in FAULTS)}, got {spec!r}")
    return name, int(value)


class AsyncEngine:
    def __init__(self, core_factory: Callable[[], EngineCore], fault: str | None = None):
        self._factory = core_factory
        self._fault = parse_fault(fault)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._retrying: list[tuple[Callable[[EngineCore], Any], asyncio.Future]] = []
        self._streams: dict[str, asyncio.Queue | StepSink] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = asyncio.Event()
        self._stopping = False
        self.core: EngineCore | None = None
        """Set once loaded. Read-only outside the engine thread (stable attributes only)."""
        self.error: BaseException | None = None
        self.lockstep = False
        """A DP/EP rank: steps in lockstep with its group (set once the engine is built)."""
        self.last_step_time = time.monotonic()
        self.step_count = 0

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> EngineCore:
        await self._ready.wait()
        if self.core is None:
            raise EngineDead(f"engine failed to start: {self.error}")
        return self.core

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop(self) -> None:
        """End the engine thread. A rank of a group steps on until every rank asked to stop (a
        peer may still be draining), so it waits as long as a collective may take."""
        self._stopping = True
        self._commands.put(None)
        if self._thread is None:
            return
        self._thread.join(timeout=self.core.group.cfg.timeout_s + 10 if self.lockstep else 10)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop; exiting with it still running")

    # ---- the loop side -----------------------------------------------------------------------

    async def call(self, fn: Callable[[EngineCore], T], retry_until_set: bool = False) -> T:
        """Run fn(core) on the engine thread between steps. retry_until_set: while fn returns None,
        run it again after every step (waiting for free KV blocks, say)."""
        if not self.alive:
            raise EngineDead(f"engine is not running: {self.error}")
        fut = asyncio.get_running_loop().create_future()
        self._commands.put((fn, fut, retry_until_set))
        return await fut

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """The queue the request's RequestOutputs arrive on; register it before adding the request."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def open_sink(self, request_id: str, sink: StepSink) -> None:
        """As open_stream, but the request's outputs go to sink.put on the loop, and every sink
        that got one hears end_step once the step's outputs are all handed over (a subscription
        sends the step's messages as one)."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._streams[request_id] = sink

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def stalled_for(self) -> float:
        """Seconds since the last step while work is pending (0 when idle or progressing)."""
        if self.core is None or (not self._streams and not self.core.has_unfinished_requests()):
            return 0.0
        return time.monotonic() - self.last_step_time

    # ---- the engine thread -------------------------------------------------------------------

    def _resolve(self, fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
        def done() -> None:
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._loop.call_soon_threadsafe(done)

    def _run_command(self, fn, fut, retry: bool) -> None:
        try:
            result = fn(self.core)
        except Exception as e:  # noqa: BLE001 - returned to the caller
            self._resolve(fut, exc=e)
            return
        if result is None and retry:
            self._retrying.append((fn, fut))
        else:
            self._resolve(fut, result)

    def _run(self) -> None:
        name_os_thread()
        try:
            self.core = self._factory()
            self.lockstep = self.core.group is not None
        except BaseException as e:  # noqa: BLE001 - reported through wait_ready
            logger.exception("engine failed to load")
            self.error = e
            self._loop.call_soon_threadsafe(self._ready.set)
            return
        self._loop.call_soon_threadsafe(self._ready.set)
        try:
            run_step_loop(
                self.core,
                take_commands=self._drain_commands,
                deliver=self._deliver_all,
                stopping=lambda: self._stopping,
                idle_wait_s=_LOCKSTEP_IDLE_S if self.lockstep else _IDLE_WAIT_S,
                step=self._step,
                after_step=self._after_step,
            )
        except BaseException as e:  # noqa: BLE001 - the worker reports it through liveness
            logger.exception("engine thread died")
            self.error = e
        finally:
            self._fail_all(self.error or EngineDead("engine stopped"))
            if self.lockstep:  # the thread that ran the collectives ends the group, before exit
                self.core.group.close()

    def _drain_commands(self, wait_s: float) -> None:
        """Run every queued command, waiting up to wait_s for the first one when there is none."""
        ran = False
        try:
            item = self._commands.get(timeout=wait_s) if wait_s > 0 else None
            while True:
                if item is not None:
                    self._run_command(*item)
                    ran = True
                item = self._commands.get_nowait()
        except queue.Empty:
            pass
        if ran:  # commands add, abort, import and release: what other threads read must follow
            self.core.publish_stats()

    def _step(self, stop: bool) -> list[RequestOutput]:
        if self._fault is not None and self.step_count >= self._fault[1]:
            if self._fault[0] == "engine_crash_after_steps":
                raise RuntimeError(f"injected fault: engine crash after {self.step_count} steps")
            logger.error("injected fault: engine stalls after %d steps", self.step_count)
            while not self._stopping:  # a hung kernel, say: no progress, no error
                time.sleep(0.1)
            return []
        outputs = self.core.step(stop=stop) if self.lockstep else self.core.step()
        self.step_count += 1
        self.last_step_time = time.monotonic()
        return outputs

    def _after_step(self) -> None:
        if not self.core.has_unfinished_requests():
            self.last_step_time = time.monotonic()  # idle is healthy
        if self._retrying:
            retrying, self._retrying = self._retrying, []
            for fn, fut in retrying:
                self._run_command(fn, fut, True)

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs in one hand-over: one write to the loop's self-pipe a step, not one per
        request."""
        if outputs:
            self._loop.call_soon_threadsafe(self._put_all, outputs)

    def _put_all(self, outputs: list[RequestOutput]) -> None:  # on the loop
        sinks: dict[int, StepSink] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if isinstance(target, asyncio.Queue):
                target.put_nowait(out)
            elif target is not None:
                target.put(out)
                sinks[id(target)] = target
        for sink in sinks.values():
            sink.end_step()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if isinstance(target, asyncio.Queue):
            self._loop.call_soon_threadsafe(target.put_nowait, item)
        elif target is not None:
            self._loop.call_soon_threadsafe(self._put_one, target, item)

    @staticmethod
    def _put_one(sink: StepSink, item: RequestOutput | BaseException) -> None:  # on the loop
        sink.put(item)
        sink.end_step()

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self._deliver(request_id, EngineDead(str(exc)))
        while True:
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self._resolve(item[1], exc=EngineDead(str(exc)))
        for _, fut in self._retrying:
            self._resolve(fut, exc=EngineDead(str(exc)))
