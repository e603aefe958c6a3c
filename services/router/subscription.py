"""The router's end of a decode worker's subscription (services/worker/subscriptions.py): one
Subscribe stream per worker carries every step's outputs of the router's Decode calls to it, in one
message, and this hands each output to the generation that is waiting for it.

A generation joins under its Decode call's request_id (the router's own id, unique), makes the
call with the subscription's id and reads its outputs from its queue; the call itself only ends,
so its error (a deadline, the worker's) is put in the same queue. When the stream ends every
member's queue gets UNAVAILABLE and the next join opens a new one. A worker that does not know
Subscribe (an older one) is remembered, and its generations stream on their calls as before."""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wgrpc
from services.common.errors import Unavailable

logger = logging.getLogger(__name__)

Item = pb.GenerateResponse | BaseException


class DecodeSubscription:
    def __init__(self, stub: wgrpc.WorkerStub, endpoint: str):
        self._stub = stub
        self._endpoint = endpoint
        self._opening: asyncio.Future | None = None
        """Resolves to the open stream's id (shared by the joins that wait for it)."""
        self._members: dict[str, asyncio.Queue[Item]] = {}
        self._reader: asyncio.Task | None = None
        self.supported = True
        """False once the worker answered Subscribe with UNIMPLEMENTED."""

    async def join(self, request_id: str) -> tuple[str, asyncio.Queue[Item]] | None:
        """-> (the subscription's id, the queue request_id's outputs arrive on), or None when the
        worker has no subscriptions. Raises the worker's error (grpc.aio.AioRpcError) when the
        stream cannot be opened."""
        if not self.supported:
            return None
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        opening = self._opening
        try:
            subscription_id = await asyncio.shield(opening)
        except Exception as e:
            if self._opening is opening:
                self._opening = None  # the next join tries again
            if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                self.supported = False
                return None
            raise
        queue: asyncio.Queue[Item] = asyncio.Queue()
        self._members[request_id] = queue
        return subscription_id, queue

    def leave(self, request_id: str) -> None:
        self._members.pop(request_id, None)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()

    async def _open(self) -> str:
        call = self._stub.Subscribe(wpb.SubscribeRequest())
        try:
            first = await call.read()
        except BaseException:
            call.cancel()
            raise
        if first is grpc.aio.EOF or not first.subscription_id:
            call.cancel()
            raise Unavailable(
                f"{self._endpoint}: the subscription ended before it began", endpoint=self._endpoint
            )
        self._reader = asyncio.ensure_future(self._read(call))
        return first.subscription_id

    async def _read(self, call) -> None:
        error: BaseException = Unavailable(
            f"{self._endpoint}: the decode subscription ended", endpoint=self._endpoint
        )
        try:
            async for msg in call:
                for out in msg.outputs:
                    queue = self._members.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            call.cancel()
            raise
        finally:
            self._opening = None  # joins from now on open a new stream
            members, self._members = self._members, {}
            for queue in members.values():
                queue.put_nowait(error)
            logger.info("decode subscription to %s ended: %s", self._endpoint, error)
