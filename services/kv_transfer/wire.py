"""KV chunks on the wire: planning slabs under the message cap, framing them as protobuf chunks,
and the KV cache spec as a protobuf message.

A chunk is a slab (engine/kv_cache/codec.py: layers of one cache group x blocks, raw bytes), or
one per-request state, with its header fields and CRC32 in a `KvChunk`. The consumer checks every field against its own spec
and the checksum against the bytes (codec.check_slab) before writing anything.
"""

from __future__ import annotations

from engine.kv_cache.codec import (
    DTYPE_CODES,
    DTYPE_NAME_BY_CODE,
    KVCodecError,
    Slab,
    check_slab,
    check_state,
    crc32,
    slab_shape,
    state_shape,
)
from engine.kv_cache.spec import KVCacheSpec
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from services.common.errors import DataLoss

MAX_CHUNK_BYTES = 4 * 2**20 - 64 * 2**10
"""Largest slab payload: under gRPC's 4 MiB default message cap with room for the header."""

__all__ = [
    "MAX_CHUNK_BYTES",
    "Slab",
    "check_chunk",
    "make_chunk",
    "make_state_chunk",
    "plan",
    "spec_from_proto",
    "spec_to_proto",
]


def plan(spec: KVCacheSpec, ranges: tuple[tuple[int, int], ...], max_bytes: int) -> list[Slab]:
    """Cover every layer x its table's blocks [start, end) (`ranges`, per block table:
    KVCacheSpec.transfer_ranges) with slabs of at most max_bytes each: per cache group, whole
    layer runs of several blocks when they fit, else layer ranges of one block (one block of one
    layer is the smallest slab)."""
    out = []
    for g in spec.groups:
        first_block, end_block = ranges[spec.table_index(g.kind)]
        per = spec.layer_bytes_per_block(g)  # one engine block of one layer
        cap = max(min(max_bytes, MAX_CHUNK_BYTES), per)
        layers = min(g.num_layers, cap // per)
        blocks = max(1, cap // (layers * per))
        for b in range(first_block, end_block, blocks):
            nb = min(blocks, end_block - b)
            start = spec.slot_start(g)
            for layer in range(start, start + g.num_layers, layers):
                out.append(Slab(layer, min(layers, start + g.num_layers - layer), b, nb))
    return out


def make_chunk(spec: KVCacheSpec, slab: Slab, data: bytes) -> kv_pb.KvChunk:
    return kv_pb.KvChunk(
        layer_start=slab.layer_start,
        num_layers=slab.num_layers,
        block_start=slab.block_start,
        num_blocks=slab.num_blocks,
        dtype=DTYPE_CODES[spec.group_at(slab.layer_start).dtype],
        shape=slab_shape(spec, slab),
        data=data,
        crc32=crc32(data),
    )


def make_state_chunk(spec: KVCacheSpec, index: int, data: bytes) -> kv_pb.KvChunk:
    """A request's per-request state `index` (codec.read_state's bytes)."""
    return kv_pb.KvChunk(
        state=index,
        dtype=DTYPE_CODES[spec.states[index].dtype],
        shape=state_shape(spec, index),
        data=data,
        crc32=crc32(data),
    )


def check_chunk(spec: KVCacheSpec, chunk: kv_pb.KvChunk, ranges: tuple[tuple[int, int], ...]) -> Slab | int:
    """Validate a received chunk against our spec and the requested blocks (per block table)
    -> its slab, or the index of the state it carries; DataLoss if it does not fit."""
    fields = dict(dtype_code=chunk.dtype, shape=list(chunk.shape), data=chunk.data, crc=chunk.crc32)
    try:
        if chunk.HasField("state"):
            check_state(spec, chunk.state, **fields)
            return chunk.state
        slab = Slab(chunk.layer_start, chunk.num_layers, chunk.block_start, chunk.num_blocks)
        check_slab(spec, slab, ranges=ranges, **fields)
    except KVCodecError as e:
        raise DataLoss(str(e)) from None
    return slab


def spec_to_proto(spec: KVCacheSpec) -> kv_pb.KvCacheSpec:
    return kv_pb.KvCacheSpec(
        model_fingerprint=spec.model_fingerprint,
        groups=[
            kv_pb.KvCacheGroup(
                kind=g.kind.value,
                layers=g.layers,
                block_size=g.block_size,
                width=g.width,
                dtype=DTYPE_CODES[g.dtype],
                rope_width=g.rope_width,
                rotary_layout=g.rotary_layout,
                tokens_per_entry=g.tokens_per_entry,
                rope_offset=g.rope_start,
                scale=g.scale,
                window=g.window,
            )
            for g in spec.groups
        ],
        states=[
            kv_pb.KvState(name=s.name, layers=s.layers, shape=s.shape, dtype=DTYPE_CODES[s.dtype])
            for s in spec.states
        ],
    )


def spec_from_proto(msg: kv_pb.KvCacheSpec) -> KVCacheSpec:
    """ValueError naming the field when the message does not describe a valid spec."""
    groups = [
        {
            "kind": g.kind,
            "layers": list(g.layers),
            "block_size": g.block_size,
            "width": g.width,
            "dtype": _dtype_name(g.dtype, f"groups[{i}]"),
            "rope_width": g.rope_width,
            "rotary_layout": g.rotary_layout,
            "tokens_per_entry": g.tokens_per_entry,
            "rope_offset": g.rope_offset,
            "scale": g.scale,
            "window": g.window,
        }
        for i, g in enumerate(msg.groups)
    ]
    states = [
        {
            "name": st.name,
            "layers": list(st.layers),
            "shape": list(st.shape),
            "dtype": _dtype_name(st.dtype, f"states[{i}]"),
        }
        for i, st in enumerate(msg.states)
    ]
    return KVCacheSpec.from_description({"model": msg.model_fingerprint, "groups": groups, "states": states})


def _dtype_name(code: int, where: str) -> str:
    if code not in DTYPE_NAME_BY_CODE:
        raise ValueError(f"kv_cache_spec.{where}.dtype {code} is not a known KvDtype")
    return DTYPE_NAME_BY_CODE[code]
