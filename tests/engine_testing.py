"""Driving an engine in tests, the way every step loop does: step and keep what finished."""

from __future__ import annotations

from engine.outputs import RequestOutput


def run_finished(core, steps: int | None = None) -> dict[str, RequestOutput]:
    """Step while the engine has work (at most `steps` times) -> request id -> final output of
    every request that finished meanwhile."""
    final: dict[str, RequestOutput] = {}
    n = 0
    while core.has_unfinished_requests() and (steps is None or n < steps):
        for out in core.step():
            if out.finished:
                final[out.request_id] = out
        n += 1
    return final
