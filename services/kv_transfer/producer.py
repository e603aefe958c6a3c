"""`KvTransfer` service of a prefill worker: streams an export's pinned blocks (Pull) or hands
them to a NIXL reader (BeginRead: the block ids and checksums; the reader READs them itself),
releases them, renews leases. The exports and their leases are the engine's
(engine/kv_cache/export.py); this is their transport. A reader names an export and a first
block, never an address: what it is told to read is the export's own blocks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.kv_cache.export import ExportNotFound, ExportReleasing, ExportTable
from engine.kv_cache.transfer import KVPort, from_block, read_bytes
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.metrics import Metrics
from services.kv_transfer.wire import make_chunk, make_state_chunk, plan

logger = logging.getLogger(__name__)

READ_MARGIN_S = 1.0
"""A NIXL read is held this long past the reader's own deadline, by which the reader has
cancelled its READ (it polls every POLL_S): the blocks are never freed under a READ still allowed."""


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
        self.nixl = False
        """This worker serves KV over NIXL (its agent's metadata is in GetEngineInfo)."""

    def engine_ready(self, port: KVPort, nixl: bool = False) -> None:
        self.port, self.nixl = port, nixl

    def _check_epoch(self, transfer_id: str, epoch: int) -> None:
        if epoch != self.identity.epoch:
            raise FailedPrecondition(
                f"transfer {transfer_id!r} is from epoch {epoch}; this worker is at epoch {self.identity.epoch}"
            )

    async def Pull(self, request: kv_pb.PullRequest, context):
        if self.port is None:
            raise Unavailable("engine is not ready")
        self._check_epoch(request.transfer_id, request.epoch)
        with export_statuses():
            export = self.exports.begin_read(request.transfer_id)
        try:
            spec, num_blocks = self.port.spec, export.num_blocks
            if not 0 <= request.first_block <= num_blocks:
                raise InvalidArgument(f"first_block {request.first_block} outside [0, {num_blocks}]")
            max_bytes = request.max_chunk_bytes or 1 << 62
            sent = self.metrics.labels(self.metrics.kv_transfer_bytes, "sent")
            ranges = spec.transfer_ranges(export.num_tokens, request.first_block)
            for slab in plan(spec, ranges, max_bytes):
                # Inside a read the blocks stay pinned: reading them off the engine thread is safe.
                data = await asyncio.to_thread(self.port.read_exported, export, slab)
                export.bytes_sent += len(data)
                sent.inc(len(data))
                yield make_chunk(spec, slab, data)
            for index in range(len(spec.states)):  # the states after the prompt, whatever the consumer holds
                data = self.port.read_exported_state(export, index)
                export.bytes_sent += len(data)
                sent.inc(len(data))
                yield make_state_chunk(spec, index, data)
        finally:
            self.exports.end_read(export)

    async def BeginRead(self, request: kv_pb.BeginReadRequest, context) -> kv_pb.BeginReadResponse:
        if self.port is None:
            raise Unavailable("engine is not ready")
        if not self.nixl:
            raise FailedPrecondition("this worker does not serve KV over NIXL; pull it with KvTransfer.Pull")
        self._check_epoch(request.transfer_id, request.epoch)
        if request.read_timeout_ms <= 0:
            raise InvalidArgument(f"read_timeout_ms must be > 0, got {request.read_timeout_ms}")
        with export_statuses():
            num_blocks = self.exports.get(request.transfer_id).num_blocks
            if not 0 <= request.first_block <= num_blocks:
                raise InvalidArgument(f"first_block {request.first_block} outside [0, {num_blocks}]")
            export = self.exports.begin_remote_read(
                request.transfer_id, request.read_timeout_ms / 1000 + READ_MARGIN_S
            )
        spec, first = self.port.spec, request.first_block
        digests = (
            from_block(spec, export.num_tokens, export.block_checksums, first)
            if export.block_checksums is not None
            else []
        )
        nbytes = read_bytes(spec, spec.transfer_ranges(export.num_tokens, first))
        export.bytes_sent += nbytes
        self.metrics.labels(self.metrics.kv_transfer_bytes, "sent").inc(nbytes)
        until = export.remote_read_until
        return kv_pb.BeginReadResponse(
            block_ids=self.port.exported_blocks(export, first),
            block_checksums=digests,
            read_deadline_unix_ms=int(until * 1000),
            read_hold_ms=max(0, int((until - time.time()) * 1000)),
        )

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
