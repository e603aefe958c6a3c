"""`KvTransfer` service of a prefill worker: streams an export's pinned blocks, releases them,
renews leases. The exports and their leases are the engine's (engine/kv_cache/export.py); this
is their transport."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from engine.kv_cache.export import ExportNotFound, ExportReleasing, ExportTable
from engine.kv_cache.transfer import KVPort
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.metrics import Metrics
from services.kv_transfer.wire import make_chunk, plan

logger = logging.getLogger(__name__)


@contextmanager
def export_statuses() -> Iterator[None]:
    """The export table's refusals as gRPC statuses."""
    try:
        yield
    except ExportNotFound as e:
        raise NotFound(str(e)) from None
    except ExportReleasing as e:
        raise FailedPrecondition(str(e)) from None


class KvTransferService(kv_grpc.KvTransferServicer):
    def __init__(self, exports: ExportTable, identity: kv_pb.KvProducer, metrics: Metrics):
        self.exports = exports
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
        with export_statuses():
            export = self.exports.begin_read(request.transfer_id)
        try:
            num_blocks = len(export.block_ids)
            if not 0 <= request.first_block <= num_blocks:
                raise InvalidArgument(f"first_block {request.first_block} outside [0, {num_blocks}]")
            max_bytes = request.max_chunk_bytes or 1 << 62
            sent = self.metrics.labels(self.metrics.kv_transfer_bytes, "sent")
            for slab in plan(self.port.spec, request.first_block, num_blocks, max_bytes):
                # Inside a read the blocks stay pinned: reading them off the engine thread is safe.
                data = await asyncio.to_thread(self.port.read_exported, export, slab)
                export.bytes_sent += len(data)
                sent.inc(len(data))
                yield make_chunk(self.port.spec, slab, data)
        finally:
            self.exports.end_read(export)

    async def Release(self, request: kv_pb.ReleaseRequest, context) -> kv_pb.ReleaseResponse:
        with export_statuses():
            self.exports.release(request.transfer_id, done=request.reason != kv_pb.RELEASE_REASON_ABORT)
        return kv_pb.ReleaseResponse()

    async def RenewLease(self, request: kv_pb.RenewLeaseRequest, context) -> kv_pb.RenewLeaseResponse:
        if request.lease_ms <= 0:
            raise InvalidArgument(f"lease_ms must be > 0, got {request.lease_ms}")
        with export_statuses():
            expiry = self.exports.renew(request.transfer_id, request.lease_ms / 1000)
        return kv_pb.RenewLeaseResponse(lease_expiry_unix_ms=int(expiry * 1000))
