"""Decode subscriptions: one stream per caller that carries the outputs of many Decode calls, one
message per engine step (worker.proto Subscribe).

Streaming each request's tokens on its own Decode call costs a gRPC message, an asyncio wake-up
and a write on both sides per token per request; at 32 streams the decode worker's loop and the
router spent more on that than on anything else they do per token. A caller (the router, one
subscription per decode worker) opens a subscription, then names it in its Decode calls: each
call's messages join the subscription's message for the step they were made in, and the call
itself only ends (OK once its request finished, or with the request's error), so cancellation,
deadlines and errors stay per call.

A subscription belongs to the caller host that opened it (services/common/grpc_utils.caller_key)
and is named by 128 random bits; another host's Decode cannot name it. A caller holds at most
MAX_PER_CALLER, and each holds at most one call per request_id at a time. What a subscription
buffers is bounded by its calls' tokens, as a call's own stream is: a reader that stops reading
stalls only its own calls' messages."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from engine.outputs import RequestOutput
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

MAX_PER_CALLER = 8
"""Subscriptions one caller host holds at once (a router needs one per decode worker)."""


def _retrieved(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()


class Member:
    """One Decode call's place in a subscription: the engine thread's outputs for its request go
    here (services/worker/async_engine.py hands them over per step), each turned into the call's
    message by `build` and added to the subscription's message for the step."""

    def __init__(self, subscription: Subscription, label: str):
        self.subscription = subscription
        self.label = label
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        """Set once the request finished; its exception (Unavailable) if the engine failed."""
        self.done.add_done_callback(_retrieved)  # a call cancelled first never awaits it
        self._build: Callable[[list], tuple[pb.GenerateResponse, bool]] | None = None
        self._early: list[RequestOutput | BaseException] = []

    def start(self, build: Callable[[list], tuple[pb.GenerateResponse, bool]]) -> None:
        """build([output]) -> (the call's message, finished): from now on outputs become messages
        (those that came before, at once)."""
        self._build = build
        early, self._early = self._early, []
        for item in early:
            self.put(item)
        self.end_step()

    def put(self, item: RequestOutput | BaseException) -> None:
        if self.done.done():
            return
        if self._build is None:
            self._early.append(item)
            return
        try:
            msg, finished = self._build([item])
        except Exception as e:  # noqa: BLE001 - the engine failed (Unavailable): the call's error
            self.done.set_exception(e)
            return
        self.subscription.pending.append(msg)
        if finished:
            self.done.set_result(None)

    def end_step(self) -> None:
        self.subscription.flush()

    def fail(self, exc: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(exc)


class Subscription:
    def __init__(self, caller: str):
        self.id = secrets.token_hex(16)
        self.caller = caller
        self.queue: asyncio.Queue[wpb.DecodeOutputs | None] = asyncio.Queue()
        """Messages for the Subscribe stream; None ends it."""
        self.pending: list[pb.GenerateResponse] = []
        """This step's messages so far."""
        self.members: dict[str, Member] = {}
        self.closed = False

    def join(self, label: str) -> Member:
        if not label:
            raise InvalidArgument("request_id must be set on a Decode call that names a subscription")
        if label in self.members:
            raise FailedPrecondition(f"request_id {label!r} is already in use on this subscription")
        member = self.members[label] = Member(self, label)
        return member

    def leave(self, member: Member) -> None:
        if self.members.get(member.label) is member:
            del self.members[member.label]

    def flush(self) -> None:
        """The step's messages as one (nothing when there are none)."""
        if self.pending and not self.closed:
            self.queue.put_nowait(wpb.DecodeOutputs(outputs=self.pending))
        self.pending = []

    def close(self) -> None:
        """The Subscribe stream ended: its calls fail (their requests are aborted by their handlers)."""
        if self.closed:
            return
        self.closed = True
        self.queue.put_nowait(None)
        for member in list(self.members.values()):
            member.fail(Unavailable("the subscription this call named has ended"))


class Subscriptions:
    """A worker's open subscriptions."""

    def __init__(self) -> None:
        self._by_id: dict[str, Subscription] = {}

    def open(self, caller: str) -> Subscription:
        if sum(s.caller == caller for s in self._by_id.values()) >= MAX_PER_CALLER:
            raise ResourceExhausted(f"a caller holds at most {MAX_PER_CALLER} subscriptions")
        sub = Subscription(caller)
        self._by_id[sub.id] = sub
        return sub

    def close(self, sub: Subscription) -> None:
        self._by_id.pop(sub.id, None)
        sub.close()

    def get(self, subscription_id: str, caller: str) -> Subscription:
        sub = self._by_id.get(subscription_id)
        if sub is None or sub.caller != caller:  # another caller's looks like none at all
            raise NotFound("subscription_id names no subscription of this caller")
        return sub

    def all(self) -> list[Subscription]:
        return list(self._by_id.values())
