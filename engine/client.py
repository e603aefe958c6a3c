"""What drives an engine: the EngineClient interface and the one step loop.

`EngineClient` is the interface the offline `LLM` (and anything else that steps an engine from
one thread) uses; `EngineCore` implements it, and so does `DPEngineClient`, which puts N rank
processes behind it. `run_step_loop` is the loop every long-running driver runs -- the worker's
engine thread (services/worker/async_engine.py) and each DP rank process
(engine/parallel/dp_engine.py): take the commands that arrived, step, hand the outputs over,
until told to stop. `EngineCore.step()` stays the only place a step happens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; changes nothing."""

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None
    ) -> object:
        """Queue a request (ValueError for a bad one or a request_id in use)."""

    def abort_request(self, request_id: str) -> object:
        """End a request wherever it is; a no-op for an unknown or finished one."""

    def has_request(self, request_id: str) -> bool:
        """The request is known and not finished yet."""

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]:
        """Advance: an output for every request that produced a token or finished."""


def run_step_loop(
    core,
    *,
    take_commands: Callable[[float], None],
    deliver: Callable[[list[RequestOutput]], None],
    stopping: Callable[[], bool],
    idle_wait_s: float,
    step: Callable[[bool], list[RequestOutput]] | None = None,
    after_step: Callable[[], None] | None = None,
) -> None:
    """Drive an EngineCore until told to stop.

    Each iteration runs `take_commands(timeout)` (which waits up to `timeout` seconds for the
    first command only when the engine is idle), then one step, then `deliver(outputs)` and
    `after_step()`. A lone engine steps only while it has work and returns as soon as `stopping()`
    is true. A rank of a DP/EP group (`core.group`) steps every iteration -- the step agrees with
    the other ranks whether any has work, an idle rank runs a dummy batch -- and returns once
    every rank asked to stop (`core.stop_requested`), so no rank is left in a collective.
    `step(stop)` replaces `core.step` (the worker counts steps and injects faults there)."""
    lockstep = core.group is not None
    step = step or (lambda stop: core.step(stop=stop) if lockstep else core.step())
    while True:
        idle = not core.has_unfinished_requests() and not stopping()
        take_commands(idle_wait_s if idle else 0.0)
        stop = stopping()
        if lockstep:
            outputs = step(stop)
            if core.stop_requested:
                deliver(outputs)
                return
        else:
            if stop:
                return
            outputs = step(False) if core.has_unfinished_requests() else []
        deliver(outputs)
        if after_step is not None:
            after_step()
