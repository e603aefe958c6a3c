"""The decode side of a transfer: pull the blocks it lacks, verify every chunk, write them in."""

from __future__ import annotations

import asyncio

import grpc

from engine.kv_cache.transfer import ImportClosed, ImportSink
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from services.common.errors import DataLoss, ServiceError
from services.kv_transfer.wire import check_chunk


async def pull(
    stub: kv_grpc.KvTransferStub,
    handle: kv_pb.KvHandle,
    sink: ImportSink,
    first_block: int,
    max_chunk_bytes: int,
    timeout: float | None,
) -> int:
    """Pull blocks [first_block, handle.num_blocks) through the import's sink (same indexing as
    the handle's blocks); returns the bytes received. Every (layer, block) must arrive exactly once.
    Raises ServiceError with the failing status (DATA_LOSS for a corrupt or incomplete stream)."""
    num_blocks = handle.num_blocks
    assert sink.num_blocks == num_blocks
    missing = {(layer, b) for layer in range(sink.spec.num_caches) for b in range(first_block, num_blocks)}
    received = 0
    request = kv_pb.PullRequest(
        transfer_id=handle.transfer_id,
        epoch=handle.producer.epoch,
        first_block=first_block,
        max_chunk_bytes=max_chunk_bytes,
    )
    call = stub.Pull(request, timeout=timeout)
    try:
        async for chunk in call:
            slab = check_chunk(sink.spec, chunk, first_block, num_blocks)
            cells = {
                (layer, b)
                for layer in range(slab.layer_start, slab.layer_start + slab.num_layers)
                for b in range(slab.block_start, slab.block_start + slab.num_blocks)
            }
            if not cells <= missing:
                raise DataLoss(
                    f"KV chunk layers {slab.layer_start}+{slab.num_layers} blocks {slab.block_start}+{slab.num_blocks} was sent twice"
                )
            try:
                await asyncio.to_thread(sink.write, slab, chunk.data)
            except ImportClosed as e:
                raise ServiceError(str(e), grpc.StatusCode.CANCELLED) from None
            missing -= cells
            received += len(chunk.data)
    except grpc.aio.AioRpcError as e:
        raise ServiceError(
            f"KV pull from {handle.producer.endpoint} failed: {e.details()}", e.code()
        ) from None
    finally:
        call.cancel()  # a no-op when the stream completed; ends it on the producer when we stop early
    if missing:
        raise DataLoss(f"KV stream ended with {len(missing)} (layer, block) slabs missing")
    return received
