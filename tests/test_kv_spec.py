"""The KV cache spec: geometry, the compatibility hash, what the engine refuses to run, and the
codec's stored-block format checked against it."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from engine.kv_cache.codec import BLOCK_HEADER_BYTES, decode_block, encode_block
from engine.kv_cache.spec import CacheGroupSpec, CacheKind, KVCacheSpec, mla_spec

LATENT = CacheGroupSpec(
    CacheKind.LATENT, (0, 1, 2), 4, 80, torch.float32, rope_width=16, rotary_layout="halves"
)
MTP = dataclasses.replace(LATENT, kind=CacheKind.MTP_LATENT, layers=(3,))
SPEC = KVCacheSpec((LATENT, MTP), "model-a")


def test_geometry():
    assert SPEC.num_layers == 4
    assert SPEC.block_size == 4
    assert LATENT.block_bytes == 4 * 80 * 4
    assert SPEC.bytes_per_block == 4 * 4 * 80 * 4
    assert [SPEC.group_of(i).kind for i in range(4)] == [CacheKind.LATENT] * 3 + [CacheKind.MTP_LATENT]
    with pytest.raises(ValueError, match=r"layer 4 outside \[0, 4\)"):
        SPEC.group_of(4)


def test_mla_spec_is_the_model_group_then_the_mtp_group():
    geometry = dict(num_layers=3, block_size=4, kv_lora_rank=64, rope_dim=16, dtype=torch.float32)
    assert mla_spec(num_mtp_layers=1, fingerprint="model-a", **geometry) == SPEC
    no_mtp = mla_spec(num_mtp_layers=0, fingerprint="m", **geometry)
    assert [g.kind for g in no_mtp.groups] == [CacheKind.LATENT]


def _changed(field: str, value) -> KVCacheSpec:
    return KVCacheSpec((dataclasses.replace(LATENT, **{field: value}), MTP), SPEC.model_fingerprint)


CHANGES = {
    "kind": lambda: _changed("kind", CacheKind.SLIDING_WINDOW),
    "block_size": lambda: KVCacheSpec(
        (dataclasses.replace(LATENT, block_size=8), dataclasses.replace(MTP, block_size=8)), "model-a"
    ),
    "width": lambda: _changed("width", 96),
    "dtype": lambda: _changed("dtype", torch.bfloat16),
    "rope_width": lambda: _changed("rope_width", 8),
    "rotary_layout": lambda: _changed("rotary_layout", "interleaved"),
    "tokens_per_entry": lambda: _changed("tokens_per_entry", 4),
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


INVALID_GROUPS = {
    "width-zero": (dict(width=0), r"width must be >= 1, got 0"),
    "layout-unknown": (dict(rotary_layout="zigzag"), r"rotary_layout must be one of"),
    "rope-wider-than-entry": (dict(rope_width=81), r"rope_width 81 with rotary_layout 'halves'"),
    "layout-without-rope": (dict(rope_width=0), r"rope_width 0 with rotary_layout 'halves'"),
    "dtype": (dict(dtype=torch.int8), r"dtype must be one of"),
    "layers-empty": (dict(layers=()), r"non-empty ascending range"),
    "layers-not-ascending": (dict(layers=(0, 2)), r"non-empty ascending range, got \(0, 2\)"),
}


@pytest.mark.parametrize("case", INVALID_GROUPS)
def test_an_invalid_group_is_refused_naming_the_field(case):
    fields, message = INVALID_GROUPS[case]
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(LATENT, **fields)


def test_the_engine_refuses_what_it_cannot_run_yet():
    SPEC.check_runnable()
    indexer = CacheGroupSpec(CacheKind.INDEXER_KEYS, (4,), 4, 128, torch.bfloat16)
    with pytest.raises(NotImplementedError, match="'indexer_keys' is described but not run yet"):
        KVCacheSpec((LATENT, MTP, indexer), "m").check_runnable()
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
        ValueError, match=r"layer 3 cache is \(10, 4, 80\) torch.float32, the spec says \[5, 8, 12\]"
    ):
        mixed.check_caches(caches[:3] + [caches[0]])
    with pytest.raises(ValueError, match="3 layer caches, the spec has 4 layers"):
        mixed.check_caches(caches[:3])


# ---- stored blocks (offload tiers) ------------------------------------------------------------


def _filled(spec: KVCacheSpec, num_blocks: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = spec.allocate(num_blocks, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    return caches


TWO = KVCacheSpec((LATENT, CacheGroupSpec(CacheKind.INDEXER_KEYS, (3, 4), 8, 12, torch.bfloat16)), "m")


@pytest.mark.parametrize("spec", [SPEC, TWO], ids=["latent+mtp", "latent+indexer"])
def test_a_stored_block_round_trips_every_group(spec):
    src, dst = _filled(spec, 4, seed=0), _filled(spec, 4, seed=1)
    before = [c.clone() for c in dst]
    blob = encode_block(spec, src, 2)
    assert len(blob) == BLOCK_HEADER_BYTES + spec.bytes_per_block
    assert decode_block(spec, blob, dst, 1)
    for layer, (s, d, b) in enumerate(zip(src, dst, before, strict=True)):
        rows = functools.partial(spec.group_block_ids, spec.group_of(layer))  # engine -> group blocks
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
