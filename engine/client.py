"""What drives an engine: the EngineClient interface and the one step loop.

`EngineClient` is the interface the offline `LLM` (and anything else that steps an engine from
one thread) uses; `EngineCore` implements it, and so does `DPEngineClient`, which puts N rank
processes behind it. `step_outputs` is the one loop every driver runs -- the offline `LLM`, the
worker's engine thread (services/worker/async_engine.py, through `run_step_loop`) and each DP
rank process (engine/parallel/dp_engine.py): take the commands that arrived, step, hand the
outputs over, until told to stop. `EngineCore.step()` stays the only place a step happens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol, runtime_checkable

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer


@runtime_checkable
class EngineClient(Protocol):
    tokenizer: Tokenizer
    max_model_len: int
    group: object | None
    """The DP/EP group when this is one rank of it (steps in lockstep); None otherwise."""

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


def step_outputs(
    core,
    *,
    stopping: Callable[[], bool],
    take_commands: Callable[[float], None] | None = None,
    idle_wait_s: float = 0.0,
    step: Callable[[bool], list[RequestOutput]] | None = None,
) -> Iterator[list[RequestOutput]]:
    """The one step loop: yields each step's outputs until told to stop.

    Each iteration runs `take_commands(timeout)` (which waits up to `timeout` seconds for the
    first command only when the engine is idle), then one step. A lone engine (or a DP client)
    steps only while it has work and returns as soon as `stopping()` is true. A rank of a DP/EP
    group (`core.group`) steps every iteration -- the step agrees with the other ranks whether
    any has work, an idle rank runs a dummy batch -- and returns once every rank asked to stop
    (`core.stop_requested`), so no rank is left in a collective. `step(stop)` replaces
    `core.step` (the worker counts steps and injects faults there)."""
    lockstep = core.group is not None
    step = step or (lambda stop: core.step(stop=stop) if lockstep else core.step())
    while True:
        if take_commands is not None:
            idle = not core.has_unfinished_requests() and not stopping()
            take_commands(idle_wait_s if idle else 0.0)
        stop = stopping()
        if lockstep:
            outputs = step(stop)
            yield outputs
            if core.stop_requested:
                return
            continue
        if stop:
            return
        yield step(False) if core.has_unfinished_requests() else []


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
    """`step_outputs` for the long-running drivers: `deliver(outputs)` and `after_step()` after
    every step."""
    for outputs in step_outputs(
        core, stopping=stopping, take_commands=take_commands, idle_wait_s=idle_wait_s, step=step
    ):
        deliver(outputs)
        if after_step is not None:
            after_step()
