"""The decode side of a transfer: pull the blocks it lacks, verify every chunk, write them in."""

from __future__ import annotations

import asyncio
import functools

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
    """Pull what the import lacks through its sink: every layer's blocks from first_block on (a
    window group's from the first block its next token reads: KVCacheSpec.transfer_ranges; same
    indexing as the handle's blocks) and every per-request state; returns the bytes received.
    Every (layer, block) and state must arrive exactly once. Raises ServiceError with the failing
    status (DATA_LOSS for a corrupt or incomplete stream)."""
    spec = sink.spec
    assert sink.num_blocks == handle.num_blocks
    ranges = spec.transfer_ranges(handle.num_tokens, first_block)
    missing: set[tuple[int, int] | int] = {
        (layer, b)
        for layer in range(spec.num_caches)
        for b in range(*ranges[spec.table_index(spec.group_at(layer).kind)])
    }
    missing.update(range(len(spec.states)))  # a state is its index
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
            got = check_chunk(spec, chunk, ranges)
            if isinstance(got, int):
                cells, what, write = {got}, f"state {got}", functools.partial(sink.write_state, got)
            else:
                cells = {
                    (layer, b)
                    for layer in range(got.layer_start, got.layer_start + got.num_layers)
                    for b in range(got.block_start, got.block_start + got.num_blocks)
                }
                what = f"layers {got.layer_start}+{got.num_layers} blocks {got.block_start}+{got.num_blocks}"
                write = functools.partial(sink.write, got)
            if not cells <= missing:
                raise DataLoss(f"KV chunk {what} was sent twice")
            try:
                await asyncio.to_thread(write, chunk.data)
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
        raise DataLoss(f"KV stream ended with {len(missing)} (layer, block) slabs or states missing")
    return received
