"""`KvTransfer` service of a prefill worker: streams pinned blocks, releases them, renews leases."""

from __future__ import annotations

import asyncio
import logging

from engine.kv_cache.transfer import KVPort
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from services.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from services.common.metrics import Metrics
from services.kv_transfer.transfer import TransferTable
from services.kv_transfer.wire import make_chunk, plan

logger = logging.getLogger(__name__)


class KvTransferService(kv_grpc.KvTransferServicer):
    def __init__(self, table: TransferTable, identity: kv_pb.KvProducer, metrics: Metrics):
        self.table = table
        self.identity = identity
        self.metrics = metrics
        self.port: KVPort | None = None

    def engine_ready(self, port: KVPort) -> None:
        self.port = port

    async def Pull(self, request: kv_pb.PullRequest, context):
        if self.port is None:
            raise Unavailable("engine is not ready")
        if request.epoch != self.identity.epoch:
            raise FailedPrecondition(
                f"transfer {request.transfer_id!r} is from epoch {request.epoch}; this worker is at epoch {self.identity.epoch}"
            )
        t = self.table.begin_pull(request.transfer_id)
        try:
            num_blocks = len(t.block_ids)
            if not 0 <= request.first_block <= num_blocks:
                raise InvalidArgument(f"first_block {request.first_block} outside [0, {num_blocks}]")
            max_bytes = request.max_chunk_bytes or 1 << 62
            sent = self.metrics.labels(self.metrics.kv_transfer_bytes, "sent")
            for slab in plan(self.port.spec, request.first_block, num_blocks, max_bytes):
                # Exported blocks are pinned: reading them off the engine thread is safe (transfer.py).
                data = await asyncio.to_thread(self.port.read_exported, t.block_ids, slab)
                t.bytes_sent += len(data)
                sent.inc(len(data))
                yield make_chunk(self.port.spec, slab, data)
        finally:
            self.table.end_pull(t)

    async def Release(self, request: kv_pb.ReleaseRequest, context) -> kv_pb.ReleaseResponse:
        self.table.release(request.transfer_id, done=request.reason != kv_pb.RELEASE_REASON_ABORT)
        return kv_pb.ReleaseResponse()

    async def RenewLease(self, request: kv_pb.RenewLeaseRequest, context) -> kv_pb.RenewLeaseResponse:
        if request.lease_ms <= 0:
            raise InvalidArgument(f"lease_ms must be > 0, got {request.lease_ms}")
        expiry = self.table.renew(request.transfer_id, request.lease_ms / 1000)
        return kv_pb.RenewLeaseResponse(lease_expiry_unix_ms=int(expiry * 1000))
