"""KV chunks on the wire: planning slabs under the message cap, building and verifying chunks.

A chunk is a raw-bytes slab of [layers, blocks, block_size, width] with a typed header (layer and
block ranges, dtype, shape) and a CRC32. The consumer checks every header field against its own
geometry and the checksum against the bytes before writing anything.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from pdserve.v1 import kv_transfer_pb2 as kv_pb
from services.errors import DataLoss

MAX_CHUNK_BYTES = 4 * 2**20 - 64 * 2**10
"""Largest slab payload: under gRPC's 4 MiB default message cap with room for the header."""

DTYPES = {
    torch.float32: kv_pb.KV_DTYPE_FLOAT32,
    torch.bfloat16: kv_pb.KV_DTYPE_BFLOAT16,
    torch.float16: kv_pb.KV_DTYPE_FLOAT16,
}


@dataclass(frozen=True)
class Geometry:
    """The paged KV cache of one engine: [num_layers][num_blocks, block_size, width] of dtype."""

    num_layers: int
    block_size: int
    width: int
    dtype: torch.dtype

    @property
    def block_layer_bytes(self) -> int:
        return self.block_size * self.width * self.dtype.itemsize


@dataclass(frozen=True)
class Slab:
    layer_start: int
    num_layers: int
    block_start: int
    num_blocks: int


def plan(geo: Geometry, first_block: int, num_blocks: int, max_bytes: int) -> list[Slab]:
    """Cover layers x blocks [first_block, num_blocks) with slabs of at most max_bytes each
    (whole layers of several blocks when they fit, else layer ranges of one block)."""
    per = geo.block_layer_bytes
    max_bytes = max(min(max_bytes, MAX_CHUNK_BYTES), per)
    layers = min(geo.num_layers, max_bytes // per)
    blocks = max(1, max_bytes // (layers * per))
    out = []
    for b in range(first_block, num_blocks, blocks):
        nb = min(blocks, num_blocks - b)
        for layer in range(0, geo.num_layers, layers):
            out.append(Slab(layer, min(layers, geo.num_layers - layer), b, nb))
    return out


def make_chunk(geo: Geometry, slab: Slab, data: bytes) -> kv_pb.KvChunk:
    return kv_pb.KvChunk(
        layer_start=slab.layer_start,
        num_layers=slab.num_layers,
        block_start=slab.block_start,
        num_blocks=slab.num_blocks,
        dtype=DTYPES[geo.dtype],
        shape=[slab.num_layers, slab.num_blocks, geo.block_size, geo.width],
        data=data,
        crc32=zlib.crc32(data),
    )


def check_chunk(geo: Geometry, chunk: kv_pb.KvChunk, first_block: int, num_blocks: int) -> Slab:
    """Validate a received chunk against our geometry and the requested range; DataLoss if not."""
    if zlib.crc32(chunk.data) != chunk.crc32:
        raise DataLoss(
            f"KV chunk layers {chunk.layer_start}+{chunk.num_layers} blocks {chunk.block_start}+"
            f"{chunk.num_blocks}: checksum mismatch"
        )
    if chunk.dtype != DTYPES[geo.dtype]:
        raise DataLoss(
            f"KV chunk dtype {kv_pb.KvDtype.Name(chunk.dtype)} != {kv_pb.KvDtype.Name(DTYPES[geo.dtype])}"
        )
    shape = [chunk.num_layers, chunk.num_blocks, geo.block_size, geo.width]
    if list(chunk.shape) != shape:
        raise DataLoss(f"KV chunk shape {list(chunk.shape)} != expected {shape}")
    if not (
        0 <= chunk.layer_start
        and chunk.num_layers > 0
        and chunk.layer_start + chunk.num_layers <= geo.num_layers
    ):
        raise DataLoss(
            f"KV chunk layers [{chunk.layer_start}, +{chunk.num_layers}) outside [0, {geo.num_layers})"
        )
    if not (
        first_block <= chunk.block_start
        and chunk.num_blocks > 0
        and chunk.block_start + chunk.num_blocks <= num_blocks
    ):
        raise DataLoss(
            f"KV chunk blocks [{chunk.block_start}, +{chunk.num_blocks}) outside [{first_block}, {num_blocks})"
        )
    if len(chunk.data) != chunk.num_layers * chunk.num_blocks * geo.block_layer_bytes:
        raise DataLoss(f"KV chunk has {len(chunk.data)} bytes, its header says {shape}")
    return Slab(chunk.layer_start, chunk.num_layers, chunk.block_start, chunk.num_blocks)
