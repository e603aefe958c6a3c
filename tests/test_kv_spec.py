"""The KV cache spec: geometry, the compatibility hash, what the engine refuses to run, and the
codec's stored-block format checked against it."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from engine.kv_cache.cache_group import CacheGroupSpec, CacheKind, StateSpec
from engine.kv_cache.codec import BLOCK_HEADER_BYTES, decode_block, encode_block
from engine.kv_cache.spec import KVCacheSpec, mla_spec

LATENT = CacheGroupSpec(
    CacheKind.LATENT, (0, 1, 2), 4, 80, torch.float32, rope_width=16, rotary_layout="halves"
)
MTP = dataclasses.replace(LATENT, kind=CacheKind.MTP_LATENT, layers=(3,))
SPEC = KVCacheSpec((LATENT, MTP), "model-a")
WINDOW = CacheGroupSpec(CacheKind.SLIDING_WINDOW, (4,), 4, 128, torch.bfloat16, window=8)
STATE = StateSpec("compressor", (4,), (2, 16), torch.float32)


def test_geometry():
    assert SPEC.num_caches == 4
    assert SPEC.block_size == 4
    assert LATENT.block_bytes == 4 * 80 * 4
    assert SPEC.bytes_per_block == 4 * 4 * 80 * 4
    assert [SPEC.group_at(i).kind for i in range(4)] == [CacheKind.LATENT] * 3 + [CacheKind.MTP_LATENT]
    with pytest.raises(ValueError, match=r"cache slot 4 outside \[0, 4\)"):
        SPEC.group_at(4)


def test_mla_spec_is_the_model_group_then_the_mtp_group():
    geometry = dict(num_layers=3, block_size=4, kv_lora_rank=64, rope_dim=16, dtype=torch.float32)
    assert mla_spec(num_mtp_layers=1, fingerprint="model-a", **geometry) == SPEC
    no_mtp = mla_spec(num_mtp_layers=0, fingerprint="m", **geometry)
    assert [g.kind for g in no_mtp.groups] == [CacheKind.LATENT]


def _changed(field: str, value) -> KVCacheSpec:
    return KVCacheSpec((dataclasses.replace(LATENT, **{field: value}), MTP), SPEC.model_fingerprint)


CHANGES = {
    "kind": lambda: _changed("kind", CacheKind.COMPRESSED),
    "window": lambda: KVCacheSpec((LATENT, MTP, WINDOW), "model-a"),
    "window-size": lambda: KVCacheSpec((LATENT, MTP, dataclasses.replace(WINDOW, window=16)), "model-a"),
    "states": lambda: KVCacheSpec(SPEC.groups, "model-a", (STATE,)),
    "block_size": lambda: KVCacheSpec(
        (dataclasses.replace(LATENT, block_size=8), dataclasses.replace(MTP, block_size=8)), "model-a"
    ),
    "width": lambda: _changed("width", 96),
    "dtype": lambda: _changed("dtype", torch.bfloat16),
    "rope_width": lambda: _changed("rope_width", 8),
    "rotary_layout": lambda: _changed("rotary_layout", "interleaved"),
    "tokens_per_entry": lambda: _changed("tokens_per_entry", 4),
    "rope_offset": lambda: _changed("rope_offset", 0),
    "scale": lambda: KVCacheSpec(
        (dataclasses.replace(LATENT, dtype=torch.float8_e4m3fn, scale="float32_per_entry"), MTP), "model-a"
    ),
    "layers": lambda: KVCacheSpec(
        (dataclasses.replace(LATENT, layers=(0, 1)), dataclasses.replace(MTP, layers=(2,))), "model-a"
    ),
    "mtp-group-dropped": lambda: KVCacheSpec((LATENT,), "model-a"),
    "model": lambda: dataclasses.replace(SPEC, model_fingerprint="model-b"),
}


@pytest.mark.parametrize("field", CHANGES)
def test_compat_hash_changes_with_every_field(field):
    other = CHANGES[field]()
    assert other != SPEC
    assert other.compat_hash() != SPEC.compat_hash()


def test_compat_hash_is_stable_and_describes_the_spec():
    same = KVCacheSpec((dataclasses.replace(LATENT), dataclasses.replace(MTP)), "model-a")
    assert same.compat_hash() == SPEC.compat_hash()
    assert len(SPEC.compat_hash()) == 16 and int(SPEC.compat_hash(), 16) >= 0
    assert KVCacheSpec.from_description(SPEC.describe()) == SPEC
    hybrid = KVCacheSpec((LATENT, MTP, WINDOW), "model-a", (STATE,))
    assert KVCacheSpec.from_description(hybrid.describe()) == hybrid


INVALID_GROUPS = {
    "width-zero": (dict(width=0), r"width must be >= 1, got 0"),
    "layout-unknown": (dict(rotary_layout="zigzag"), r"rotary_layout must be one of"),
    "rope-wider-than-entry": (dict(rope_width=81), r"rope_width 81 with rotary_layout 'halves'"),
    "layout-without-rope": (dict(rope_width=0), r"rope_width 0 with rotary_layout 'halves'"),
    "dtype": (dict(dtype=torch.int8), r"dtype must be one of"),
    "layers-empty": (dict(layers=()), r"non-empty and strictly ascending"),
    "layers-not-ascending": (dict(layers=(2, 0)), r"non-empty and strictly ascending, got \(2, 0\)"),
    "layers-twice": (dict(layers=(1, 1)), r"non-empty and strictly ascending, got \(1, 1\)"),
    "layers-negative": (dict(layers=(-1, 0)), r"layers must be >= 0"),
    "rope-offset-past-the-entry": (
        dict(rope_offset=65),
        r"rope_offset 65: a rotary part of width 16 starts in \[0, 64\]",
    ),
    "rope-offset-negative": (dict(rope_offset=-1), r"rope_offset -1"),
    "rope-offset-without-rope": (
        dict(rope_offset=0, rope_width=0, rotary_layout="none"),
        r"rope_offset 0: a rotary part of width 0",
    ),
    "scale-unknown": (dict(scale="int8"), r"scale must be one of"),
    "fp8-without-scale": (dict(dtype=torch.float8_e4m3fn), r"dtype float8_e4m3fn with scale 'none'"),
    "scale-without-fp8": (dict(scale="float32_per_entry"), r"dtype float32 with scale 'float32_per_entry'"),
    "window-on-a-full-group": (
        dict(window=8),
        r"a latent group with window 8: sliding-window groups, and only",
    ),
    "window-missing": (dict(kind=CacheKind.SLIDING_WINDOW), r"sliding_window group with window 0"),
}


@pytest.mark.parametrize("case", INVALID_GROUPS)
def test_an_invalid_group_is_refused_naming_the_field(case):
    fields, message = INVALID_GROUPS[case]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(LATENT, **fields)


def test_the_engine_refuses_what_it_cannot_run_yet():
    SPEC.check_runnable()
    indexer = CacheGroupSpec(
        CacheKind.INDEXER_KEYS, (0, 1, 2), 4, 128, torch.bfloat16, 64, "halves", rope_offset=0
    )
    KVCacheSpec((LATENT, MTP, indexer), "m").check_runnable()  # DeepSeek-V3.2's
    fp8 = dataclasses.replace(indexer, dtype=torch.float8_e4m3fn, scale="float32_per_entry")
    with pytest.raises(
        NotImplementedError, match="FP8 entries with a float32_per_entry scale is described but not run"
    ):
        KVCacheSpec((LATENT, MTP, fp8), "m").check_runnable()
    KVCacheSpec((LATENT, MTP, WINDOW), "m", (STATE,)).check_runnable()  # DeepSeek-V4's kinds run
    mixed = KVCacheSpec((LATENT, dataclasses.replace(MTP, block_size=8)), "m")
    with pytest.raises(
        NotImplementedError, match="latent group of 4-entry blocks under 8-token engine blocks"
    ):
        mixed.check_runnable()
    with pytest.raises(ValueError, match="block holds 3 tokens, which does not divide the engine block of 4"):
        KVCacheSpec((LATENT, dataclasses.replace(MTP, block_size=3)), "m")


def test_allocate_follows_the_groups_and_check_caches_holds_to_them():
    """The engine block is the largest group block (8 tokens): the latent group's 4-token blocks
    come two to an engine block, so its tensors have twice the rows."""
    mixed = KVCacheSpec((LATENT, CacheGroupSpec(CacheKind.INDEXER_KEYS, (3,), 8, 12, torch.bfloat16)), "m")
    assert mixed.block_size == 8 and [mixed.sub_blocks(g) for g in mixed.groups] == [2, 1]
    assert mixed.group_block_ids(LATENT, [3, 0]) == [6, 7, 0, 1]
    assert mixed.bytes_per_block == 3 * 2 * LATENT.block_bytes + 8 * 12 * 2
    caches = mixed.allocate(5, "cpu")
    assert [tuple(c.shape) for c in caches] == [(10, 4, 80)] * 3 + [(5, 8, 12)]
    assert [c.dtype for c in caches] == [torch.float32] * 3 + [torch.bfloat16]
    assert all(not c.any() for c in caches)
    mixed.check_caches(caches)
    with pytest.raises(
        ValueError,
        match=r"the indexer_keys cache of layer 3 is \(10, 4, 80\) torch.float32, the spec says \[5, 8, 12\]",
    ):
        mixed.check_caches(caches[:3] + [caches[0]])
    with pytest.raises(ValueError, match=r"3 caches, the spec has 4 \(group, layer\) caches"):
        mixed.check_caches(caches[:3])


def test_groups_name_model_layers_and_caches_are_found_by_kind_and_layer():
    """A V3.2-like spec: the indexer's keys on some of the latent cache's layers (any set), the
    MTP layer's cache numbered after the model's. Each (kind, layer) names its own tensor; the
    flat order (the slots transfers address) is a group's layers together, in group order."""
    indexer = CacheGroupSpec(CacheKind.INDEXER_KEYS, (0, 2), 4, 12, torch.bfloat16)
    spec = KVCacheSpec((LATENT, indexer, MTP), "m")
    assert spec.num_caches == 6 and [spec.slot_start(g) for g in spec.groups] == [0, 3, 5]
    assert [spec.slot(CacheKind.LATENT, n) for n in (0, 1, 2)] == [0, 1, 2]
    assert [spec.slot(CacheKind.INDEXER_KEYS, n) for n in (0, 2)] == [3, 4]
    assert spec.slot(CacheKind.MTP_LATENT, 3) == 5 and spec.group_at(4) is indexer
    caches = spec.allocate(2, "cpu")
    assert caches.layer(CacheKind.INDEXER_KEYS, 2) is caches[4] and caches[4].shape == (2, 4, 12)
    assert caches.layer(CacheKind.LATENT, 2) is caches[2] and caches[2].shape == (2, 4, 80)
    assert [c.shape[-1] for c in caches.group(CacheKind.INDEXER_KEYS)] == [12, 12]
    assert caches.group(CacheKind.MTP_LATENT) == [caches[5]]
    with pytest.raises(KeyError, match=r"'indexer_keys' cache group holds no layer 1 \(it holds \[0, 2\]\)"):
        caches.layer(CacheKind.INDEXER_KEYS, 1)
    with pytest.raises(KeyError, match="no 'compressed' group"):
        caches.group(CacheKind.COMPRESSED)
    with pytest.raises(ValueError, match=r"one group of each kind, got \['latent', 'latent'\]"):
        KVCacheSpec((LATENT, dataclasses.replace(LATENT, layers=(3,))), "m")


# ---- stored blocks (offload tiers) ------------------------------------------------------------


def _filled(spec: KVCacheSpec, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = spec.allocate(num_blocks, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    return caches


TWO = KVCacheSpec((LATENT, CacheGroupSpec(CacheKind.INDEXER_KEYS, (0, 2), 8, 12, torch.bfloat16)), "m")
FP8_KEYS = CacheGroupSpec(
    CacheKind.INDEXER_KEYS, (0, 2), 4, 128, torch.float8_e4m3fn, rope_width=64, rotary_layout="halves",
    rope_offset=0, scale="float32_per_entry",
)  # fmt: skip
"""V3.2's indexer keys as its reference stores them: 128 FP8 values (the rotary part leading), then
their float32 scale."""


def test_an_fp8_entry_with_its_scale_is_132_bytes_and_described_in_full():
    assert FP8_KEYS.entry_bytes == 132 and FP8_KEYS.block_bytes == 4 * 132 and FP8_KEYS.rope_start == 0
    spec = KVCacheSpec((LATENT, FP8_KEYS), "m")
    caches = spec.allocate(3, "cpu")
    assert caches.layer(CacheKind.INDEXER_KEYS, 2).shape == (3, 4, 132)
    assert caches.layer(CacheKind.INDEXER_KEYS, 2).dtype == torch.uint8
    spec.check_caches(caches)
    described = spec.describe()["groups"][1]
    assert (described["dtype"], described["scale"], described["rope_offset"]) == (
        "float8_e4m3fn",
        "float32_per_entry",
        0,
    )
    assert spec.describe()["groups"][0]["rope_offset"] == 64  # MLA's: the entry's end
    assert KVCacheSpec.from_description(spec.describe()) == spec
    bf16_keys = dataclasses.replace(
        FP8_KEYS, dtype=torch.bfloat16, scale="none"
    )  # the default layout: the other side of a transfer may hold this one
    assert KVCacheSpec((LATENT, bf16_keys), "m").compat_hash() != spec.compat_hash()


@pytest.mark.parametrize(
    "spec",
    [SPEC, TWO, KVCacheSpec((LATENT, FP8_KEYS), "m")],
    ids=["latent+mtp", "latent+indexer", "latent+fp8-indexer"],
)
def test_a_stored_block_round_trips_every_group(spec):
    src, dst = _filled(spec, 4, seed=0), _filled(spec, 4, seed=1)
    before = [c.clone() for c in dst]
    blob = encode_block(spec, src, 2)
    assert len(blob) == BLOCK_HEADER_BYTES + spec.bytes_per_block
    assert decode_block(spec, blob, dst, 1)
    for layer, (s, d, b) in enumerate(zip(src, dst, before, strict=True)):
        rows = functools.partial(spec.group_block_ids, spec.group_at(layer))  # engine -> group blocks
        assert torch.equal(d[rows([1])], s[rows([2])]), layer
        assert torch.equal(d[rows([0, 2, 3])], b[rows([0, 2, 3])]), layer


def _flip(blob: bytes, at: int) -> bytes:
    out = bytearray(blob)
    out[at] ^= 0x10
    return bytes(out)


REFUSED_BLOBS = {
    "payload-byte": lambda blob, spec: _flip(blob, len(blob) - 3),
    "magic": lambda blob, spec: _flip(blob, 0),
    "version": lambda blob, spec: _flip(blob, 4),
    "compat-hash": lambda blob, spec: _flip(blob, 9),
    "truncated": lambda blob, spec: blob[:-1],
    "header-only": lambda blob, spec: blob[:BLOCK_HEADER_BYTES],
    "short": lambda blob, spec: blob[:10],
    "other-spec": lambda blob, spec: encode_block(
        dataclasses.replace(spec, model_fingerprint="x"), _filled(spec, 1, 5), 0
    ),
}


@pytest.mark.parametrize("case", REFUSED_BLOBS)
def test_a_damaged_or_foreign_stored_block_writes_nothing(case):
    dst = _filled(TWO, 3, seed=1)
    before = [c.clone() for c in dst]
    blob = REFUSED_BLOBS[case](encode_block(TWO, _filled(TWO, 3, seed=0), 0), TWO)
    assert not decode_block(TWO, blob, dst, 1)
    assert all(torch.equal(d, b) for d, b in zip(dst, before, strict=True))


def test_groups_that_live_alike_share_a_block_table():
    """Full-attention groups (latent, MTP, indexer keys) share one table, first; a sliding-window
    and a compressed group each hold their own, and their caches are sized by their table."""
    compressed = CacheGroupSpec(CacheKind.COMPRESSED, (0, 2), 1, 96, torch.bfloat16, tokens_per_entry=4)
    spec = KVCacheSpec((WINDOW, LATENT, compressed, MTP), "m", (STATE,))
    assert [(t.manager, t.kinds) for t in spec.tables] == [
        ("full", (CacheKind.LATENT, CacheKind.MTP_LATENT)),
        ("sliding_window", (CacheKind.SLIDING_WINDOW,)),
        ("compressed", (CacheKind.COMPRESSED,)),
    ]
    assert [spec.table_index(k) for k in (CacheKind.MTP_LATENT, CacheKind.SLIDING_WINDOW)] == [0, 1]
    assert spec.tables[1].window == 8 and spec.tables[2].tokens_per_entry == 4
    assert spec.table_bytes_per_block(spec.tables[2]) == 2 * 1 * 96 * 2
    caches = spec.allocate((6, 3, 5), "cpu")
    assert [c.shape[0] for c in caches] == [3, 6, 6, 6, 5, 5, 6]  # window, latent x3, compressed x2, MTP
    spec.check_caches(caches)
    with pytest.raises(ValueError, match=r"\(6, 3\) blocks: the spec has 3 block tables"):
        spec.allocate((6, 3), "cpu")
    assert STATE.slot_bytes == 2 * 16 * 4
