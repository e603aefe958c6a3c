"""KV blocks as bytes, one format for every way KV leaves or enters an engine.

A slab is cache slots [layer_start, layer_start + L) of one cache group (positions in the engine's
flat list of caches, spec.py: a group's layers together, so the same on both sides of equal specs)
x some engine blocks, laid out
as [L, num_blocks x sub_blocks, block_size, width] row-major in the group's dtype, little-endian
(an engine block is `spec.sub_blocks(g)` of the group's blocks; see spec.py). Two framings
carry slabs:

- a KV transfer chunk (services/kv_transfer/wire.py) puts the slab's header fields in a protobuf
  message; `check_slab` verifies them against our spec before anything is written;
- a KV transfer also sends each per-request state (DeepSeek-V4's compressor state) once, as the
  raw bytes of the request's [layers, *shape] slot (`read_state`, checked by `check_state`);
- an offload tier stores one block of one block table, every layer of its groups, as
  `encode_block`'s blob: a fixed header (magic, version, the spec's compatibility hash, payload
  length, CRC32) then each group's slab in group order; and a request's states at a block
  boundary as `encode_states`' (the same header, then the states' bytes). `decode_block` and
  `decode_states` write them back only if every header field matches and the CRC holds.

Bytes only: nothing is pickled, so bytes from the network or Redis can at worst be wrong numbers,
never code -- and wrong numbers are caught by the CRC32 before they reach the cache.
"""

from __future__ import annotations

import struct
import sys
import zlib
from dataclasses import dataclass

import torch

from engine.kv_cache.cache_group import DTYPE_NAMES
from engine.kv_cache.spec import KVCacheSpec

assert sys.byteorder == "little", "the KV byte format is little-endian"

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3, torch.float8_e4m3fn: 4}
"""Element dtype on the wire and in stored blocks (the values of pdserve.v1.KvDtype)."""
DTYPE_NAME_BY_CODE = {code: DTYPE_NAMES[dtype] for dtype, code in DTYPE_CODES.items()}

_MAGIC = b"PDKV"
_VERSION = 2
_BLOCK_HEADER = struct.Struct("<4sH2x8sQI")  # magic, version, compat hash (8 bytes), payload bytes, crc32
BLOCK_HEADER_BYTES = _BLOCK_HEADER.size


class KVCodecError(ValueError):
    """Bytes or header fields that do not fit this engine's spec; the message says which."""


def crc32(data: bytes | memoryview) -> int:
    return zlib.crc32(data)


@dataclass(frozen=True)
class Slab:
    """Cache slots [layer_start, +num_layers) of one cache group (the wire's field names) x blocks
    [block_start, +num_blocks) (block indices of a transfer, not block ids of either side)."""

    layer_start: int
    num_layers: int
    block_start: int
    num_blocks: int


def slab_shape(spec: KVCacheSpec, slab: Slab) -> list[int]:
    g = spec.group_at(slab.layer_start)
    return [slab.num_layers, slab.num_blocks * spec.sub_blocks(g), g.block_size, g.storage_width]


def read_slab(
    spec: KVCacheSpec, caches: list[torch.Tensor], block_ids: list[int], layer_start: int, num_layers: int
) -> bytes:
    """Copy out layers [layer_start, +num_layers) (one group) x the given engine blocks as bytes."""
    g = spec.group_at(layer_start)
    index = torch.tensor(
        spec.group_block_ids(g, block_ids), dtype=torch.long, device=caches[layer_start].device
    )
    slab = torch.stack(
        [caches[layer].index_select(0, index) for layer in range(layer_start, layer_start + num_layers)]
    )
    return _bytes(slab)


def write_slab(
    spec: KVCacheSpec,
    caches: list[torch.Tensor],
    block_ids: list[int],
    layer_start: int,
    data: bytes | memoryview,
) -> None:
    """Write a slab produced by read_slab into the given engine blocks; its layer count follows
    from its length. KVCodecError (nothing written) if it is not whole layers of one group."""
    g = _group_at(spec, layer_start)
    per_layer = len(block_ids) * spec.layer_bytes_per_block(g)
    if not block_ids or len(data) % per_layer:
        raise KVCodecError(
            f"KV slab has {len(data)} bytes, not a whole number of layers of {len(block_ids)} blocks"
        )
    num_layers = len(data) // per_layer
    if layer_start + num_layers > spec.slot_start(g) + g.num_layers:
        raise KVCodecError(
            f"KV slab layers [{layer_start}, {layer_start + num_layers}) cross the end of their cache group "
            f"[{spec.slot_start(g)}, {spec.slot_start(g) + g.num_layers})"
        )
    slab = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(g.storage_dtype)
    ids = spec.group_block_ids(g, block_ids)
    slab = slab.view(num_layers, len(ids), g.block_size, g.storage_width)
    index = torch.tensor(ids, dtype=torch.long, device=caches[layer_start].device)
    for i in range(num_layers):
        cache = caches[layer_start + i]
        cache.index_copy_(0, index, slab[i].to(cache.device))


def check_slab(
    spec: KVCacheSpec,
    slab: Slab,
    *,
    dtype_code: int,
    shape: list[int],
    data: bytes,
    crc: int,
    ranges: tuple[tuple[int, int], ...],
) -> None:
    """A received slab's header and bytes against our spec and the requested blocks, [start, end)
    per block table (KVCacheSpec.transfer_ranges); KVCodecError naming what differs."""
    where = f"layers {slab.layer_start}+{slab.num_layers} blocks {slab.block_start}+{slab.num_blocks}"
    if crc32(data) != crc:
        raise KVCodecError(f"KV chunk {where}: checksum mismatch")
    if not (
        0 <= slab.layer_start
        and slab.num_layers > 0
        and slab.layer_start + slab.num_layers <= spec.num_caches
    ):
        raise KVCodecError(
            f"KV chunk layers [{slab.layer_start}, +{slab.num_layers}) outside [0, {spec.num_caches})"
        )
    g = spec.group_at(slab.layer_start)
    if slab.layer_start + slab.num_layers > spec.slot_start(g) + g.num_layers:
        raise KVCodecError(
            f"KV chunk layers [{slab.layer_start}, +{slab.num_layers}) cross the end of their cache group "
            f"[{spec.slot_start(g)}, {spec.slot_start(g) + g.num_layers})"
        )
    if dtype_code != DTYPE_CODES[g.dtype]:
        raise KVCodecError(
            f"KV chunk dtype {DTYPE_NAME_BY_CODE.get(dtype_code, dtype_code)} != {DTYPE_NAMES[g.dtype]}"
        )
    expected = slab_shape(spec, slab)
    if list(shape) != expected:
        raise KVCodecError(f"KV chunk shape {list(shape)} != expected {expected}")
    first_block, end_block = ranges[spec.table_index(g.kind)]
    if not (
        first_block <= slab.block_start
        and slab.num_blocks > 0
        and slab.block_start + slab.num_blocks <= end_block
    ):
        raise KVCodecError(
            f"KV chunk blocks [{slab.block_start}, +{slab.num_blocks}) outside [{first_block}, {end_block}) "
            f"(its {g.kind.value} group's)"
        )
    if len(data) != slab.num_layers * slab.num_blocks * spec.layer_bytes_per_block(g):
        raise KVCodecError(f"KV chunk has {len(data)} bytes, its header says {expected}")


def state_shape(spec: KVCacheSpec, index: int) -> list[int]:
    """Per-request state `index` of one request: [layers, *shape]."""
    state = spec.states[index]
    return [len(state.layers), *state.shape]


def read_state(state: torch.Tensor) -> bytes:
    """One request's state (a [layers, *shape] view of its slot) as bytes."""
    return _bytes(state)


def write_state(spec: KVCacheSpec, index: int, state: torch.Tensor, data: bytes | memoryview) -> None:
    """Write read_state's bytes into a request's state `index`; KVCodecError (nothing written)
    when they are not its size."""
    if len(data) != spec.states[index].slot_bytes:
        raise KVCodecError(
            f"state {spec.states[index].name!r} has {len(data)} bytes, one request's is {spec.states[index].slot_bytes}"
        )
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(state.dtype).view(state.shape)
    state.copy_(values.to(state.device))


def check_state(
    spec: KVCacheSpec, index: int, *, dtype_code: int, shape: list[int], data: bytes, crc: int
) -> None:
    """A received state's header and bytes against our spec; KVCodecError naming what differs."""
    if crc32(data) != crc:
        raise KVCodecError(f"KV state chunk {index}: checksum mismatch")
    if not 0 <= index < len(spec.states):
        raise KVCodecError(f"KV state chunk {index} outside the spec's {len(spec.states)} states")
    state = spec.states[index]
    if dtype_code != DTYPE_CODES[state.dtype]:
        raise KVCodecError(
            f"KV state {state.name!r} dtype {DTYPE_NAME_BY_CODE.get(dtype_code, dtype_code)} != {DTYPE_NAMES[state.dtype]}"
        )
    if list(shape) != state_shape(spec, index):
        raise KVCodecError(
            f"KV state {state.name!r} shape {list(shape)} != expected {state_shape(spec, index)}"
        )
    if len(data) != state.slot_bytes:
        raise KVCodecError(
            f"KV state {state.name!r} has {len(data)} bytes, its shape says {state.slot_bytes}"
        )


def encode_block(spec: KVCacheSpec, caches: list[torch.Tensor], block_id: int, table: int = 0) -> bytes:
    """One engine block of block table `table` (the only one of a V2/V3 spec) over every layer of
    its groups -> header + each group's [layers, sub_blocks, block_size, width] slab."""
    payload = b"".join(
        read_slab(spec, caches, [block_id], spec.slot_start(g), g.num_layers)
        for g in spec.tables[table].groups
    )
    return _framed(spec, payload)


def decode_block(
    spec: KVCacheSpec, blob: bytes, caches: list[torch.Tensor], block_id: int, table: int = 0
) -> bool:
    """Write a stored block of table `table` into block `block_id`; False (nothing written) if its
    header is not this spec's and table's or its bytes fail the checksum."""
    payload = _payload(spec, blob, spec.table_bytes_per_block(spec.tables[table]))
    if payload is None:
        return False
    offset = 0
    for g in spec.tables[table].groups:
        n = g.num_layers * spec.layer_bytes_per_block(g)
        write_slab(spec, caches, [block_id], spec.slot_start(g), payload[offset : offset + n])
        offset += n
    return True


def encode_states(spec: KVCacheSpec, states: tuple[torch.Tensor, ...]) -> bytes:
    """One request's per-request states (a slot or a snapshot: one [layers, *shape] view per
    StateSpec) -> header + their bytes in the spec's order."""
    return _framed(spec, b"".join(read_state(s) for s in states))


def decode_states(spec: KVCacheSpec, blob: bytes, states: tuple[torch.Tensor, ...]) -> bool:
    """Write encode_states' blob into a request's state views; False (nothing written) if its
    header is not this spec's or its bytes fail the checksum."""
    payload = _payload(spec, blob, sum(s.slot_bytes for s in spec.states))
    if payload is None:
        return False
    offset = 0
    for i, state in enumerate(spec.states):
        write_state(spec, i, states[i], payload[offset : offset + state.slot_bytes])
        offset += state.slot_bytes
    return True


def _framed(spec: KVCacheSpec, payload: bytes) -> bytes:
    header = _BLOCK_HEADER.pack(
        _MAGIC, _VERSION, bytes.fromhex(spec.compat_hash()), len(payload), crc32(payload)
    )
    return header + payload


def _payload(spec: KVCacheSpec, blob: bytes, size: int) -> memoryview | None:
    """A stored blob's payload of `size` bytes, or None when its header or checksum is not ours."""
    if len(blob) < _BLOCK_HEADER.size:
        return None
    magic, version, compat, length, crc = _BLOCK_HEADER.unpack_from(blob)
    payload = memoryview(blob)[_BLOCK_HEADER.size :]
    if (magic, version, compat.hex(), length) != (_MAGIC, _VERSION, spec.compat_hash(), size):
        return None
    if len(payload) != size or crc32(payload) != crc:
        return None
    return payload


def _bytes(t: torch.Tensor) -> bytes:
    """A tensor's elements as little-endian bytes, in row-major order."""
    return t.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def _group_at(spec: KVCacheSpec, layer_start: int):
    try:
        return spec.group_at(layer_start)
    except ValueError as e:
        raise KVCodecError(f"KV slab: {e}") from None
