"""Two cache groups with different block sizes move together, block for block.

The spec: a latent group with 4-token blocks (three layers, float32, a rotary part) and a test-only
indexer-key group with 8-token blocks (two layers, bfloat16), the shape DeepSeek-V3.2's indexer
cache takes beside the latent cache. The engine block is 8 tokens: two latent blocks and one
indexer block. Through the engine's own pieces -- the block manager (allocation, prefix cache,
eviction), the offload connector with a host tier (evicted blocks stored and loaded back), and a
KV transfer (the producer's port, the wire plan and chunk check, the consumer's import sink) --
every group's rows of a block arrive where that block's ids say, and nothing else changes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from engine.kv_cache.cache_group import CacheGroupSpec, CacheKind
from engine.kv_cache.connector import KVLoad
from engine.kv_cache.export import Export
from engine.kv_cache.manager import KVCacheManager
from engine.kv_cache.offload import HostTier, KVOffloader
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import KVPort
from engine.request import Request
from engine.sampling_params import SamplingParams
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from services.kv_transfer.wire import check_chunk, make_chunk, plan

LATENT = CacheGroupSpec(
    CacheKind.LATENT, (0, 1, 2), 4, 80, torch.float32, rope_width=16, rotary_layout="halves"
)
INDEXER = CacheGroupSpec(CacheKind.INDEXER_KEYS, (3, 4), 8, 12, torch.bfloat16)
SPEC = KVCacheSpec((LATENT, INDEXER), "hybrid-test")
BS = SPEC.block_size
NUM_BLOCKS = 8


def _filled(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    caches = SPEC.allocate(NUM_BLOCKS, "cpu")
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=gen))
    return caches


def _rows(caches: list[torch.Tensor], block_ids: list[int]) -> list[torch.Tensor]:
    """Every layer's rows of these engine blocks, each group through its own block table."""
    return [
        cache[SPEC.group_block_ids(SPEC.group_at(layer), block_ids)].clone()
        for layer, cache in enumerate(caches)
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1))


def test_the_spec_gives_each_group_its_block_table():
    assert BS == 8 and [SPEC.sub_blocks(g) for g in SPEC.groups] == [2, 1]
    caches = SPEC.allocate(NUM_BLOCKS, "cpu")
    assert [c.shape[0] for c in caches] == [2 * NUM_BLOCKS] * 3 + [NUM_BLOCKS] * 2
    assert SPEC.group_block_ids(LATENT, [5, 2]) == [10, 11, 4, 5]
    assert SPEC.group_block_ids(INDEXER, [5, 2]) == [5, 2]


def test_allocated_prefix_cached_evicted_and_offloaded_together():
    caches = _filled(seed=0)
    offload = KVOffloader(SPEC, caches, [HostTier(capacity_blocks=16)])
    bm = KVCacheManager(SPEC, NUM_BLOCKS, enable_prefix_caching=True, on_evict=offload.on_evict)
    prompt = list(range(100, 100 + 3 * BS + 1))  # 3 full blocks and one token
    a = _request("a", prompt)
    assert bm.get_computed_blocks(a).num_tokens == 0 and bm.allocate_slots(a, len(prompt))
    blocks = list(a.block_ids[0][:3])
    written = _rows(caches, blocks)  # what "a" computed into its full blocks, in both groups
    hashes = list(a.block_hashes[:3])
    bm.free(a)

    # Prefix-cached: the same prompt finds the three blocks again, with both groups' rows.
    b = _request("b", prompt)
    hits = bm.get_computed_blocks(b)
    assert [h.block_id for h in hits.blocks[0]] == blocks and hits.num_tokens == 3 * BS
    bm.allocate_slots(b, len(prompt) - hits.num_tokens, hits)
    bm.free(b)

    # Evicted: other prompts take every block; each cached block is stored, all groups in one blob.
    for i in range(2):
        other = _request(f"o{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + NUM_BLOCKS * BS // 2)))
        assert bm.allocate_slots(other, other.num_tokens)
        for layer, cache in enumerate(caches):  # the new owner overwrites the rows
            cache[SPEC.group_block_ids(SPEC.group_at(layer), other.block_ids[0])] = 0
        bm.free(other)
    assert all(bm.pools[0].lookup(h) is None for h in hashes)
    assert offload.stats.stored_blocks >= 3 and not _same(_rows(caches, blocks), written)

    # Offloaded and loaded back: into whichever blocks a new request gets, block for block.
    c = _request("c", prompt)
    assert bm.get_computed_blocks(c).num_tokens == 0
    assert offload.lookup("c", hashes) == 3
    assert bm.allocate_slots(c, len(prompt))
    assert offload.load("c", KVLoad(hashes, (c.block_ids[0][:3],))) == 3
    assert _same(_rows(caches, c.block_ids[0][:3]), written)
    offload.close()


@pytest.mark.parametrize("max_bytes", [1000, 1 << 62], ids=["small-chunks", "one-chunk-per-group"])
def test_transferred_together(max_bytes):
    """A producer's exported blocks [6, 1, 4] reach a consumer's blocks [2, 7, 3]; the consumer
    had the first as a prefix hit, so blocks 1.. of the transfer move."""
    src, dst = _filled(seed=1), _filled(seed=2)
    before = [c.clone() for c in dst]
    export = Export("t", _request("p", list(range(3 * BS))), [], 3 * BS, None, lease_expiry=0.0)
    export.request.block_ids = [[6, 1, 4]]
    producer, consumer = KVPort(SPEC, src), KVPort(SPEC, dst)
    sink = consumer.sink("c", [[2, 7, 3]])
    ranges = SPEC.transfer_ranges(3 * BS, first_block=1)
    for slab in plan(SPEC, ranges, max_bytes):
        chunk = kv_pb.KvChunk.FromString(
            make_chunk(SPEC, slab, producer.read_exported(export, slab)).SerializeToString()
        )
        sink.write(check_chunk(SPEC, chunk, ranges), chunk.data)
    assert _same(_rows(dst, [7, 3]), _rows(src, [1, 4]))
    untouched = [b for b in range(NUM_BLOCKS) if b not in (7, 3)]
    for layer, (d, b) in enumerate(zip(dst, before, strict=True)):
        rows = functools.partial(SPEC.group_block_ids, SPEC.group_at(layer))
        assert torch.equal(d[rows(untouched)], b[rows(untouched)]), layer
