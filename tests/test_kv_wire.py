"""KV transfer pieces without an engine or a network: slab planning, chunk building and checking
(with the KV codec underneath) and the KV cache spec on the wire. (The exports' lease state
machine is tested in test_kv_export.py.)

Legend: `per` is the bytes of one block of one layer (block_size * width * itemsize); a slab is
layers [layer_start, +num_layers) x blocks [block_start, +num_blocks) of a transfer.
"""

from __future__ import annotations

import functools
import random
import zlib
from collections import Counter

import pytest
import torch

from engine.kv_cache.cache_group import CacheGroupSpec, CacheKind, StateSpec
from engine.kv_cache.codec import DTYPE_CODES, read_slab, write_slab
from engine.kv_cache.spec import KVCacheSpec
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from services.common.errors import DataLoss
from services.kv_transfer.wire import (
    MAX_CHUNK_BYTES,
    Slab,
    check_chunk,
    make_chunk,
    plan,
    spec_from_proto,
    spec_to_proto,
)

# ---- plan ---------------------------------------------------------------------------------------


def _one_group(num_layers: int, block_size: int, width: int, dtype: torch.dtype) -> KVCacheSpec:
    """A spec of one latent cache group (what every engine without MTP has)."""
    group = CacheGroupSpec(CacheKind.LATENT, tuple(range(num_layers)), block_size, width, dtype)
    return KVCacheSpec((group,), "test-model")


def _blocks(spec: KVCacheSpec, first: int, end: int) -> tuple[tuple[int, int], ...]:
    """Blocks [first, end) of every block table."""
    return ((first, end),) * len(spec.tables)


def _per(spec: KVCacheSpec) -> int:
    """One engine block of one layer of the first group."""
    return spec.layer_bytes_per_block(spec.groups[0])


# A latent group and a test-only second group of another kind, block size, width and dtype (the
# shape DeepSeek-V3.2's indexer-key cache will have beside the latent cache). The engine block is
# 8 tokens: two of the latent group's 4-token blocks, one of the indexer group's.
TWO_GROUPS = KVCacheSpec(
    (
        CacheGroupSpec(
            CacheKind.LATENT, (0, 1, 2), 4, 80, torch.float32, rope_width=16, rotary_layout="halves"
        ),
        CacheGroupSpec(CacheKind.INDEXER_KEYS, (0, 2), 8, 12, torch.bfloat16),
    ),
    "test-model",
)
# The same with the indexer keys as V3.2's reference stores them: FP8 with a float32 scale per entry
# (132 bytes), the rotary part leading.
FP8_GROUPS = KVCacheSpec(
    (
        TWO_GROUPS.groups[0],
        CacheGroupSpec(
            CacheKind.INDEXER_KEYS, (0, 2), 8, 128, torch.float8_e4m3fn, rope_width=64, rotary_layout="halves",
            rope_offset=0, scale="float32_per_entry",
        ),
    ),
    "test-model",
)  # fmt: skip


DT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.float8_e4m3fn: "fp8+scale"}
GEOS = [
    _one_group(3, 4, 80, torch.float32),  # the tiny model: per = 1280
    _one_group(5, 3, 7, torch.float16),  # odd everything: per = 42
    _one_group(61, 64, 576, torch.bfloat16),  # DeepSeek-V3: per = 73728, all layers > MAX_CHUNK_BYTES
    TWO_GROUPS,  # per = 2 x 1280 (layers 0-2) and 192 (layers 0 and 2)
    FP8_GROUPS,  # per = 2 x 1280 and 8 x 132
]
# max_bytes as a function of the geometry: below one block-layer, exactly one, between, one block
# of all layers, just over it, several blocks, and far over the gRPC cap.
MAXES = {
    "half-block-layer": lambda g: _per(g) // 2,
    "block-layer": lambda g: _per(g),
    "2.5-block-layers": lambda g: _per(g) * 5 // 2,
    "block-all-layers": lambda g: g.num_caches * _per(g),
    "block-all-layers+1": lambda g: g.num_caches * _per(g) + 1,
    "3.5-blocks": lambda g: g.num_caches * _per(g) * 7 // 2,
    "huge": lambda g: 1 << 62,
}
RANGES = [(0, 1), (0, 5), (2, 7), (6, 7)]
PLAN_CASES = [(g, m(g), r) for g in GEOS for m in MAXES.values() for r in RANGES]


def _geo_id(g: KVCacheSpec) -> str:
    return "+".join(f"L{x.num_layers}-bs{x.block_size}-w{x.width}-{DT[x.dtype]}" for x in g.groups)


def _plan_id(case) -> str:
    g, max_bytes, (first, num) = case
    return f"{_geo_id(g)}-B{first}to{num}-max{max_bytes}"


@pytest.mark.parametrize("case", PLAN_CASES, ids=[_plan_id(c) for c in PLAN_CASES])
def test_plan_covers_every_layer_block_once_within_the_cap(case):
    geo, max_bytes, (first, num) = case
    slabs = plan(geo, _blocks(geo, first, num), max_bytes)
    cells = Counter(
        (layer, b)
        for s in slabs
        for layer in range(s.layer_start, s.layer_start + s.num_layers)
        for b in range(s.block_start, s.block_start + s.num_blocks)
    )
    expected = {(layer, b) for layer in range(geo.num_caches) for b in range(first, num)}
    assert set(cells) == expected
    assert set(cells.values()) == {1}
    limit = min(max_bytes, MAX_CHUNK_BYTES)
    for s in slabs:
        assert s.num_layers >= 1 and s.num_blocks >= 1
        group = geo.group_at(s.layer_start)
        assert s.layer_start + s.num_layers <= geo.slot_start(group) + group.num_layers, "a slab spans groups"
        per = geo.layer_bytes_per_block(group)
        size = s.num_layers * s.num_blocks * per
        if limit >= per:
            assert size <= limit, s
        else:  # one block of one layer cannot be split: it is the smallest slab
            assert size == per, s


@pytest.mark.parametrize("geo", GEOS, ids=_geo_id)
def test_plan_of_an_empty_range_is_empty(geo):
    assert plan(geo, _blocks(geo, 4, 4), 1 << 20) == []


G3 = _one_group(3, 4, 80, torch.float32)  # per = 1280, one block of all layers = 3840
EXACT_PLANS = {
    "below-block-layer": (100, 2, 4, [Slab(layer, 1, b, 1) for b in (2, 3) for layer in range(3)]),
    "two-block-layers": (2560, 0, 2, [Slab(0, 2, b, 1) for b in (0, 1)] + [Slab(2, 1, b, 1) for b in (0, 1)]),
    "one-block-all-layers": (3840, 1, 4, [Slab(0, 3, b, 1) for b in (1, 2, 3)]),
    "two-blocks-all-layers": (7681, 0, 5, [Slab(0, 3, 0, 2), Slab(0, 3, 2, 2), Slab(0, 3, 4, 1)]),
    "huge": (1 << 62, 1, 6, [Slab(0, 3, 1, 5)]),
}


@pytest.mark.parametrize("name", EXACT_PLANS)
def test_plan_exact_slabs(name):
    max_bytes, first, num, expected = EXACT_PLANS[name]
    got = plan(G3, _blocks(G3, first, num), max_bytes)
    # The order within a plan does not matter to the consumer; the set of slabs does.
    assert sorted(got, key=lambda s: (s.block_start, s.layer_start)) == sorted(
        expected, key=lambda s: (s.block_start, s.layer_start)
    )


def test_plan_caps_slabs_at_the_grpc_message_limit():
    geo = GEOS[2]  # 61 layers of 73728 bytes: 56 block-layers fit under MAX_CHUNK_BYTES
    assert MAX_CHUNK_BYTES // _per(geo) == 56
    assert plan(geo, _blocks(geo, 0, 2), 1 << 62) == [
        Slab(0, 56, 0, 1),
        Slab(56, 5, 0, 1),
        Slab(0, 56, 1, 1),
        Slab(56, 5, 1, 1),
    ]


# ---- make_chunk / check_chunk with the codec --------------------------------------------------------


def _caches(geo: KVCacheSpec, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # [num_blocks, block_size, width] per layer, each layer of its group's geometry
    caches = geo.allocate(num_blocks, "cpu")
    for c in caches:  # random values, or random bytes where entries are stored as bytes
        c.copy_(
            torch.randint(0, 256, c.shape, generator=gen)
            if c.dtype == torch.uint8
            else torch.randn(c.shape, generator=gen)
        )
    return caches


ROUND_TRIPS = [
    (_one_group(3, 4, 80, torch.float32), 1280),
    (_one_group(3, 4, 80, torch.float32), 3840 * 2),
    (_one_group(5, 3, 7, torch.bfloat16), 100),
    (_one_group(5, 3, 7, torch.float16), 1 << 62),
    (TWO_GROUPS, 1000),
    (TWO_GROUPS, 1 << 62),
    (FP8_GROUPS, 1000),
    (FP8_GROUPS, 1 << 62),
]


@pytest.mark.parametrize("geo, max_bytes", ROUND_TRIPS, ids=[f"{_geo_id(g)}-max{m}" for g, m in ROUND_TRIPS])
def test_chunks_round_trip_through_the_wire(geo, max_bytes):
    """Producer blocks [7, 2, 9, 4, 0] -> consumer blocks [1, 3, 5, 6, 8]; block 0 of the
    transfer was a consumer prefix hit (first_block = 1), so it is not sent."""
    src, dst = _caches(geo, 10, seed=0), _caches(geo, 10, seed=1)
    dst_before = [c.clone() for c in dst]
    src_ids, dst_ids, first = [7, 2, 9, 4, 0], [1, 3, 5, 6, 8], 1
    for slab in plan(geo, _blocks(geo, first, len(src_ids)), max_bytes):
        blocks = slice(slab.block_start, slab.block_start + slab.num_blocks)
        data = read_slab(geo, src, src_ids[blocks], slab.layer_start, slab.num_layers)
        wire = make_chunk(geo, slab, data).SerializeToString()
        chunk = kv_pb.KvChunk.FromString(wire)
        assert check_chunk(geo, chunk, _blocks(geo, first, len(src_ids))) == slab
        write_slab(geo, dst, dst_ids[blocks], slab.layer_start, chunk.data)
    for layer in range(geo.num_caches):
        rows = functools.partial(geo.group_block_ids, geo.group_at(layer))  # engine -> group blocks
        for s, d in zip(src_ids[first:], dst_ids[first:], strict=True):
            assert torch.equal(dst[layer][rows([d])], src[layer][rows([s])]), (layer, d)
        untouched = rows([b for b in range(10) if b not in dst_ids[first:]])  # incl. the hit block 1
        assert torch.equal(dst[layer][untouched], dst_before[layer][untouched])


def _valid_chunk() -> tuple[kv_pb.KvChunk, int, int]:
    """Layers [1, 3) x blocks [2, 4) of G3, for a transfer of 5 blocks pulled from block 1."""
    data = random.Random(0).randbytes(2 * 2 * _per(G3))
    return make_chunk(G3, Slab(1, 2, 2, 2), data), 1, 5


def _flip(c):
    data = bytearray(c.data)
    data[100] ^= 0x01
    c.data = bytes(data)  # crc32 left as sent


def _set(**fields):
    def mutate(c):
        for name, value in fields.items():
            if name == "shape":
                del c.shape[:]
                c.shape.extend(value)
            else:
                setattr(c, name, value)

    return mutate


def _resize(n):
    def mutate(c):
        c.data = c.data[:n] if n < len(c.data) else c.data + bytes(n - len(c.data))
        c.crc32 = zlib.crc32(c.data)  # a consistent checksum over the wrong length

    return mutate


REJECTED_CHUNKS = {
    "data-byte-flipped": (_flip, r"layers 1\+2 blocks 2\+2: checksum mismatch"),
    "dtype": (_set(dtype=kv_pb.KV_DTYPE_BFLOAT16), r"dtype bfloat16 != float32"),
    "dtype-unknown": (_set(dtype=9), r"dtype 9 != float32"),
    "shape-width": (_set(shape=[2, 2, 4, 81]), r"shape \[2, 2, 4, 81\] != expected \[2, 2, 4, 80\]"),
    "shape-block-size": (_set(shape=[2, 2, 8, 80]), r"shape \[2, 2, 8, 80\] != expected \[2, 2, 4, 80\]"),
    "shape-disagrees-with-header": (_set(num_layers=1), r"shape \[2, 2, 4, 80\] != expected \[1, 2, 4, 80\]"),
    "layers-past-the-end": (_set(layer_start=2), r"layers \[2, \+2\) outside \[0, 3\)"),
    "layer-negative": (_set(layer_start=-1), r"layers \[-1, \+2\) outside \[0, 3\)"),
    "zero-layers": (_set(num_layers=0, shape=[0, 2, 4, 80]), r"layers \[1, \+0\) outside \[0, 3\)"),
    "blocks-before-first-block": (_set(block_start=0), r"blocks \[0, \+2\) outside \[1, 5\)"),
    "blocks-past-the-end": (_set(block_start=4), r"blocks \[4, \+2\) outside \[1, 5\)"),
    "zero-blocks": (_set(num_blocks=0, shape=[2, 0, 4, 80]), r"blocks \[2, \+0\) outside \[1, 5\)"),
    "data-short": (_resize(5116), r"KV chunk has 5116 bytes, its header says \[2, 2, 4, 80\]"),
    "data-long": (_resize(5124), r"KV chunk has 5124 bytes, its header says \[2, 2, 4, 80\]"),
}


def test_valid_chunk_passes():
    chunk, first, num = _valid_chunk()
    assert check_chunk(G3, chunk, _blocks(G3, first, num)) == Slab(1, 2, 2, 2)


@pytest.mark.parametrize("case", REJECTED_CHUNKS)
def test_check_chunk_rejects(case):
    mutate, message = REJECTED_CHUNKS[case]
    chunk, first, num = _valid_chunk()
    mutate(chunk)
    with pytest.raises(DataLoss, match=message):
        check_chunk(G3, chunk, _blocks(G3, first, num))


def test_a_chunk_crossing_a_cache_group_is_rejected():
    data = bytes(2 * 1 * _per(TWO_GROUPS))
    chunk = make_chunk(_one_group(5, 4, 80, torch.float32), Slab(2, 2, 0, 1), data)
    with pytest.raises(DataLoss, match=r"layers \[2, \+2\) cross the end of their cache group \[0, 3\)"):
        check_chunk(TWO_GROUPS, chunk, _blocks(TWO_GROUPS, 0, 1))


def test_a_chunk_of_the_second_group_is_checked_against_its_geometry():
    slab = Slab(3, 2, 0, 2)
    chunk = make_chunk(TWO_GROUPS, slab, bytes(2 * 2 * 8 * 12 * 2))
    assert list(chunk.shape) == [2, 2, 8, 12] and chunk.dtype == kv_pb.KV_DTYPE_BFLOAT16
    assert check_chunk(TWO_GROUPS, chunk, _blocks(TWO_GROUPS, 0, 2)) == slab
    del chunk.shape[:]
    chunk.shape.extend([2, 2, 4, 80])  # the first group's geometry
    with pytest.raises(DataLoss, match=r"shape \[2, 2, 4, 80\] != expected \[2, 2, 8, 12\]"):
        check_chunk(TWO_GROUPS, chunk, _blocks(TWO_GROUPS, 0, 2))


# ---- the KV cache spec on the wire ----------------------------------------------------------------


def test_dtype_codes_are_the_proto_enum():
    assert DTYPE_CODES == {
        torch.float32: kv_pb.KV_DTYPE_FLOAT32,
        torch.bfloat16: kv_pb.KV_DTYPE_BFLOAT16,
        torch.float16: kv_pb.KV_DTYPE_FLOAT16,
        torch.float8_e4m3fn: kv_pb.KV_DTYPE_FLOAT8_E4M3,
    }


HYBRID = KVCacheSpec(
    (
        CacheGroupSpec(CacheKind.LATENT, (0, 1), 4, 8, torch.float32),
        CacheGroupSpec(CacheKind.SLIDING_WINDOW, (0, 1), 4, 8, torch.bfloat16, window=10),
        CacheGroupSpec(CacheKind.COMPRESSED, (0,), 1, 8, torch.float32, tokens_per_entry=4),
    ),
    "hybrid",
    (StateSpec("compressor", (0,), (2, 3), torch.float32),),
)


@pytest.mark.parametrize("spec", [GEOS[0], TWO_GROUPS, FP8_GROUPS, HYBRID], ids=_geo_id)
def test_spec_round_trips_through_the_wire(spec):
    """Every group (a window's width included) and every state: a hybrid spec too."""
    wire = spec_to_proto(spec).SerializeToString()
    back = spec_from_proto(kv_pb.KvCacheSpec.FromString(wire))
    assert back == spec
    assert back.compat_hash() == spec.compat_hash()


BAD_SPECS = {
    "unknown-kind": (
        lambda m: setattr(m.groups[0], "kind", "paged_banana"),
        r"'paged_banana' is not a valid CacheKind",
    ),
    "unknown-dtype": (
        lambda m: setattr(m.groups[1], "dtype", 7),
        r"groups\[1\]\.dtype 7 is not a known KvDtype",
    ),
    "zero-block-size": (lambda m: setattr(m.groups[0], "block_size", 0), r"block_size must be >= 1, got 0"),
    "layers-twice": (
        lambda m: m.groups[1].layers.__setitem__(0, 2),
        r"non-empty and strictly ascending, got \(2, 2\)",
    ),
    "kind-twice": (lambda m: setattr(m.groups[1], "kind", "latent"), r"one group of each kind"),
    "rope-offset-past-the-entry": (
        lambda m: setattr(m.groups[0], "rope_offset", 70),
        r"rope_offset 70: a rotary part of width 16 starts in \[0, 64\]",
    ),
    "scale-unknown": (lambda m: setattr(m.groups[1], "scale", "per-banana"), r"scale must be one of"),
    "no-groups": (lambda m: m.ClearField("groups"), r"at least one cache group"),
    "rope-without-layout": (
        lambda m: setattr(m.groups[0], "rotary_layout", "none"),
        r"rope_width 16 with rotary_layout 'none'",
    ),
}


@pytest.mark.parametrize("case", BAD_SPECS)
def test_a_malformed_spec_from_the_wire_is_refused_naming_the_field(case):
    mutate, message = BAD_SPECS[case]
    msg = spec_to_proto(TWO_GROUPS)
    mutate(msg)
    with pytest.raises(ValueError, match=message):
        spec_from_proto(msg)
