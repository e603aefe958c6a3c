"""services.worker.async_engine: the engine thread hands each step's outputs to the loop."""

from __future__ import annotations

import asyncio

from engine.outputs import RequestOutput
from services.worker.async_engine import AsyncEngine

STEPS = 4


class _Core:
    """Three requests that each get a token a step for STEPS steps."""

    group = None

    def __init__(self) -> None:
        self.steps = 0

    def has_unfinished_requests(self) -> bool:
        return self.steps < STEPS

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        return [
            RequestOutput(rid, None, [], [], "", new_token_ids=[self.steps], finished=self.steps == STEPS)
            for rid in ("a", "b", "gone")
        ]


def test_each_stream_gets_its_own_outputs_in_order_in_one_hand_over_a_step(monkeypatch):
    hand_overs = []
    put_all = AsyncEngine._put_all
    monkeypatch.setattr(
        AsyncEngine, "_put_all", lambda self, outs: hand_overs.append(len(outs)) or put_all(self, outs)
    )

    async def scenario() -> dict[str, list[int]]:
        engine = AsyncEngine(_Core)
        streams = {rid: engine.open_stream(rid) for rid in ("a", "b")}  # "gone" has none: dropped
        engine.start()
        await engine.wait_ready()
        got: dict[str, list[int]] = {}
        for rid, q in streams.items():
            while not (out := await asyncio.wait_for(q.get(), 10)).finished:
                got.setdefault(rid, []).extend(out.new_token_ids)
            got[rid].extend(out.new_token_ids)
        engine.stop()
        return got

    got = asyncio.run(scenario())
    assert got == {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}
    assert hand_overs == [3] * STEPS  # one wake-up of the loop per step, every output in it
