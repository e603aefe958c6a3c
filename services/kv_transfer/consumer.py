"""The decode side of a transfer: pull the blocks it lacks, verify every chunk, write them in."""

from __future__ import annotations

import asyncio

import grpc

from engine.kv_cache.codec import write_slab
from engine.kv_cache.spec import KVCacheSpec
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import kv_transfer_pb2_grpc as kv_grpc
from services.errors import DataLoss, ServiceError
from services.kv_transfer.wire import check_chunk


async def pull(
    stub: kv_grpc.KvTransferStub,
    handle: kv_pb.KvHandle,
    spec: KVCacheSpec,
    caches,
    local_block_ids: list[int],
    first_block: int,
    max_chunk_bytes: int,
    timeout: float | None,
) -> int:
    """Pull blocks [first_block, handle.num_blocks) into local_block_ids (same indexing as the
    handle's blocks); returns the bytes received. Every (layer, block) must arrive exactly once.
    Raises ServiceError with the failing status (DATA_LOSS for a corrupt or incomplete stream)."""
    num_blocks = handle.num_blocks
    assert len(local_block_ids) == num_blocks
    missing = {(layer, b) for layer in range(spec.num_layers) for b in range(first_block, num_blocks)}
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
            slab = check_chunk(spec, chunk, first_block, num_blocks)
            cells = {
                (layer, b)
                for layer in range(slab.layer_start, slab.layer_start + slab.num_layers)
                for b in range(slab.block_start, slab.block_start + slab.num_blocks)
            }
            if not cells <= missing:
                raise DataLoss(
                    f"KV chunk layers {slab.layer_start}+{slab.num_layers} blocks {slab.block_start}+{slab.num_blocks} was sent twice"
                )
            ids = local_block_ids[slab.block_start : slab.block_start + slab.num_blocks]
            await asyncio.to_thread(write_slab, spec, caches, ids, slab.layer_start, chunk.data)
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
