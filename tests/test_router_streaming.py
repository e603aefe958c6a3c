"""The router's end of a Decode call (RouterCore._decode), on a worker's subscription or on the
call, against a fake worker: steps that queued up while the router was busy go out as one message,
the router's stream_interval gathers tokens into fewer, larger messages (a colocated request's
first and every request's last at once), and either way the client sees every token, its text,
logprobs, usage and the finish, and the tokens before a worker's error or a call's early end."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import ServiceError
from services.common.metrics import Metrics
from services.router.api import Timings, Usage
from services.router.core import RouterCore, RouterSettings


class _Call:
    """A Decode call on a subscription: it says nothing and ends when cancelled."""

    def __init__(self):
        self.cancelled = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.cancelled.wait()
        raise StopAsyncIteration

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


class _Decode:
    """The worker's handle as _decode uses it: its subscription hands out one queue."""

    endpoint = "decode:1"

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()
        self.calls: list[_Call] = []
        self.left: list[str] = []
        self.subscription = self
        self.worker = self

    async def join(self, request_id: str):
        return "subscription", self.queue

    def leave(self, request_id: str) -> None:
        self.left.append(request_id)

    def Decode(self, req, timeout):  # noqa: N802 - the stub's name
        self.calls.append(_Call())
        return self.calls[-1]


def _step(i: int, last: bool = False) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id="r", token_ids=[100 + i], text=f"<{i}>")
    msg.logprobs.add(token_ids=[100 + i], logprobs=[-0.5 * i])
    if last:
        msg.finish_reason = pb.FINISH_REASON_LENGTH
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=5, completion_tokens=i + 1, kv_transfer_bytes=77))
        msg.timings.CopyFrom(pb.Timings(kv_transfer_ns=3_000_000, queue_ns=1_000_000))
    return msg


def _core(interval: int) -> RouterCore:
    return RouterCore(RouterSettings("m", stream_interval=interval), None, None, Metrics("router"))


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _run(interval: int, steps: int, prefilled: bool, at_once: bool = False):
    """Feed `steps` step messages (one at a time, the router keeping up, or all before it reads)
    -> (the deltas, how many deltas had come after each step, usage, timings, the fake worker)."""
    core, worker = _core(interval), _Decode()
    usage, timings = Usage(prompt_tokens=5), Timings()
    req = wpb.DecodeRequest(request_id="r")
    deltas, seen_after = [], []

    async def read():
        async for delta in core._decode(worker, req, 1e9, usage, timings, prefilled):
            deltas.append(delta)

    msgs = [_step(i, last=i == steps - 1) for i in range(steps)]
    if at_once:
        for msg in msgs:
            worker.queue.put_nowait(msg)
    reader = asyncio.ensure_future(read())
    await _settle()
    if not at_once:
        for msg in msgs:
            worker.queue.put_nowait(msg)
            await _settle()
            seen_after.append(len(deltas))
    await asyncio.wait_for(reader, 5)
    return deltas, seen_after, usage, timings, worker


def _check_whole(deltas, steps: int, usage: Usage, timings: Timings) -> None:
    assert [t for d in deltas for t in d.token_ids] == [100 + i for i in range(steps)]
    assert "".join(d.text for d in deltas) == "".join(f"<{i}>" for i in range(steps))
    assert [lp for d in deltas for lp in d.logprobs] == [{100 + i: -0.5 * i} for i in range(steps)]
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + ["length"]
    assert usage.completion_tokens == steps and usage.kv_transfer_bytes == 77
    assert timings.kv_transfer == pytest.approx(0.003) and timings.queue == pytest.approx(0.001)


def test_interval_one_sends_every_step_as_it_comes():
    deltas, seen_after, usage, timings, worker = asyncio.run(_run(1, 5, prefilled=True))
    assert seen_after == [1, 2, 3, 4, 5]
    _check_whole(deltas, 5, usage, timings)
    assert worker.left == ["r"] and worker.calls[0].cancelled.is_set()


@pytest.mark.parametrize("prefilled", [True, False])
def test_interval_gathers_tokens_and_sends_the_last_at_once(prefilled):
    deltas, seen_after, usage, timings, _ = asyncio.run(_run(3, 8, prefilled))
    if prefilled:  # the first token went out from the prefill rank: every message gathers
        assert [len(d.token_ids) for d in deltas] == [3, 3, 2]
        assert seen_after == [0, 0, 1, 1, 1, 2, 2, 3]
    else:  # colocated: the request's first token goes out at once
        assert [len(d.token_ids) for d in deltas] == [1, 3, 3, 1]
        assert seen_after == [1, 1, 1, 2, 2, 2, 3, 4]
    _check_whole(deltas, 8, usage, timings)


def test_steps_that_queued_while_the_router_was_busy_go_out_as_one():
    deltas, _, usage, timings, _ = asyncio.run(_run(1, 6, prefilled=True, at_once=True))
    assert [len(d.token_ids) for d in deltas] == [6]
    _check_whole(deltas, 6, usage, timings)


def test_tokens_before_a_worker_error_still_reach_the_client():
    async def run():
        core, worker = _core(1), _Decode()
        for i in range(2):
            worker.queue.put_nowait(_step(i))
        error = grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), "too slow"
        )
        worker.queue.put_nowait(error)
        deltas = []
        req = wpb.DecodeRequest(request_id="r")
        with pytest.raises(ServiceError) as caught:
            async for delta in core._decode(worker, req, 1e9, Usage(), Timings(), False):
                deltas.append(delta)
        return deltas, caught.value

    deltas, error = asyncio.run(run())
    assert [t for d in deltas for t in d.token_ids] == [100, 101]
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED and "too slow" in str(error)


class _StreamingDecode(_Decode):
    """A worker without subscriptions: the messages come on the Decode call, which then ends."""

    def __init__(self, msgs: list[pb.GenerateResponse]):
        super().__init__()
        self.msgs = msgs

    async def join(self, request_id: str):
        return None

    def Decode(self, req, timeout):  # noqa: N802 - the stub's name
        msgs = self.msgs

        class Call:
            async def __aiter__(self):
                for msg in msgs:
                    yield msg

            def cancel(self) -> bool:
                return False

        return Call()


def test_tokens_gathered_when_a_call_ends_without_its_last_message_still_go_out():
    async def run():
        worker = _StreamingDecode([_step(0), _step(1), _step(2), _step(3)])
        req = wpb.DecodeRequest(request_id="r")
        return [d async for d in _core(3)._decode(worker, req, 1e9, Usage(), Timings(), True)]

    assert [d.token_ids for d in asyncio.run(run())] == [[100, 101, 102], [103]]


def test_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be >= 1, got 0"):
        RouterSettings("m", stream_interval=0)
