"""BlockPool / KVCacheManager (one full-attention table) / hashing, exact: block ids, ref counts, free-queue order, eviction
order and prefix-cache hits are asserted, never printed (STYLE.md item 9).

Legend: `bs` is the block size; a request "computes" its tokens when allocate_slots covers them
(the manager registers full blocks in the prefix-cache index at that moment).
"""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.hashing import HASH_BYTES, hash_block, hash_blocks
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.engine_testing import full_manager, table


def make_req(rid: str, tokens: list[int], prompt_logprobs: int | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(prompt_logprobs=prompt_logprobs))


def admit(bm: KVCacheManager, req: Request) -> list[int]:
    """What the scheduler does for a waiting request with room to spare: prefix lookup, then
    allocate the whole remainder. -> the hit block ids."""
    computed = bm.get_computed_blocks(req)
    hits, num_hit_tokens = computed.blocks[0], computed.num_tokens
    assert bm.allocate_slots(req, req.num_tokens - num_hit_tokens, computed)
    req.num_computed_tokens = req.num_tokens
    return [b.block_id for b in hits]


def free_queue(bm: KVCacheManager) -> list[int]:
    return list(bm.pools[0].free_queue)


def ref_counts(bm: KVCacheManager) -> list[int]:
    return [b.ref_count for b in bm.pools[0].blocks]


def snapshot(bm: KVCacheManager, *reqs: Request) -> tuple:
    pool = bm.pools[0]
    return (
        free_queue(bm),
        ref_counts(bm),
        [b.block_hash for b in pool.blocks],
        dict(pool.cached),
        pool.num_evictions,
        [(list(table(r)), list(r.block_hashes), r.num_computed_tokens) for r in reqs],
    )


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- allocation and freeing ---------------------------------------------------------------------


ALLOC_CASES = [(4, 1), (4, 4), (4, 5), (4, 9), (4, 12), (16, 33), (3, 7)]


@pytest.mark.parametrize("bs, n", ALLOC_CASES, ids=[f"bs{bs}-prompt{n}" for bs, n in ALLOC_CASES])
def test_allocate_exact_blocks_and_index(bs, n):
    bm = full_manager(16, bs)
    req = make_req("a", tokens(100, n))
    assert admit(bm, req) == []
    num_blocks = -(-n // bs)
    assert table(req) == list(range(num_blocks))
    assert ref_counts(bm) == [1] * num_blocks + [0] * (16 - num_blocks)
    assert free_queue(bm) == list(range(num_blocks, 16))
    # Exactly the full blocks are registered, under the request's chained hashes.
    assert req.block_hashes == hash_blocks(req.token_ids, bs)
    assert bm.pools[0].cached == {h: i for i, h in enumerate(req.block_hashes)}
    assert len(bm.pools[0].cached) == n // bs
    for i, block in enumerate(bm.pools[0].blocks[:num_blocks]):
        assert block.block_hash == (req.block_hashes[i] if i < n // bs else None)
    assert bm.usage == num_blocks / 16


def test_requests_take_blocks_from_the_queue_head_in_order():
    bm = full_manager(8, 4)
    a, b, c = make_req("a", tokens(0, 9)), make_req("b", tokens(100, 5)), make_req("c", tokens(200, 1))
    for r in (a, b, c):
        admit(bm, r)
    assert (table(a), table(b), table(c)) == ([0, 1, 2], [3, 4], [5])
    assert free_queue(bm) == [6, 7]
    assert ref_counts(bm) == [1, 1, 1, 1, 1, 1, 0, 0]


def test_chunked_allocation_registers_blocks_as_they_fill():
    bm = full_manager(8, 4)
    req = make_req("a", tokens(10, 10))
    steps = [3, 3, 4]  # prefill chunks: 3, 6 then 10 tokens computed
    expected_blocks = [[0], [0, 1], [0, 1, 2]]
    expected_cached = [0, 1, 2]
    for n, blocks, cached in zip(steps, expected_blocks, expected_cached, strict=True):
        assert bm.allocate_slots(req, n)
        req.num_computed_tokens += n
        assert table(req) == blocks
        assert len(bm.pools[0].cached) == cached
    # Two decodes: the generated tokens fill block 2, which is then registered too.
    for tok in (500, 501):
        req.append_token(tok)
        assert bm.allocate_slots(req, 1)
        req.num_computed_tokens += 1
    assert table(req) == [0, 1, 2]
    assert req.block_hashes == hash_blocks(req.token_ids, 4)
    assert bm.pools[0].cached == {req.block_hashes[i]: i for i in range(3)}
    # One more decode crosses into a fresh block, which is partial and not registered.
    req.append_token(502)
    assert bm.allocate_slots(req, 1)
    assert table(req) == [0, 1, 2, 3]
    assert bm.pools[0].blocks[3].block_hash is None


def test_allocate_slots_rejects_tokens_not_known_yet():
    bm = full_manager(4, 4)
    req = make_req("a", tokens(0, 5))
    with pytest.raises(AssertionError, match="not known yet"):
        bm.allocate_slots(req, 6)


def test_free_releases_tail_first_and_keeps_cached_blocks_findable():
    bm = full_manager(8, 4)
    a, b = make_req("a", tokens(0, 10)), make_req("b", tokens(100, 4))
    admit(bm, a)  # [0, 1, 2]: 0 and 1 full
    admit(bm, b)  # [3]: full
    bm.free(a)
    assert table(a) == []
    # Tail first: a's last (partial) block is evicted first, its first block last.
    assert free_queue(bm) == [4, 5, 6, 7, 2, 1, 0]
    assert ref_counts(bm) == [0, 0, 0, 1, 0, 0, 0, 0]
    assert bm.pools[0].cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1, b.block_hashes[0]: 3}
    bm.free(b)
    assert free_queue(bm) == [4, 5, 6, 7, 2, 1, 0, 3]
    assert ref_counts(bm) == [0] * 8
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_eviction_order_when_blocks_are_reused():
    bm = full_manager(6, 4)
    a = make_req("a", tokens(0, 12))  # [0, 1, 2], all full
    b = make_req("b", tokens(100, 6))  # [3, 4]: 3 full, 4 partial
    admit(bm, a)
    admit(bm, b)
    bm.free(a)  # least recently freed: evicted first
    bm.free(b)
    assert free_queue(bm) == [5, 2, 1, 0, 4, 3]
    owner = {0: a.block_hashes[0], 1: a.block_hashes[1], 2: a.block_hashes[2], 3: b.block_hashes[0]}
    taken, evictions = [], []
    for _ in range(6):
        (block,) = bm.pools[0].allocate(1)
        taken.append(block.block_id)
        evictions.append(bm.pools[0].num_evictions)
        assert block.ref_count == 1 and block.block_hash is None
        if block.block_id in owner:
            assert owner[block.block_id] not in bm.pools[0].cached
    assert taken == [5, 2, 1, 0, 4, 3]
    # Never-cached blocks (5, and b's partial block 4) evict nothing.
    assert evictions == [0, 1, 2, 3, 3, 4]
    assert bm.pools[0].cached == {}


def test_partial_reuse_evicts_prefix_last():
    """Reusing part of the free queue evicts a freed request's tail and keeps its prefix hittable."""
    bm = full_manager(5, 4)
    a = make_req("a", tokens(0, 12))
    admit(bm, a)  # [0, 1, 2]
    bm.free(a)  # queue [3, 4, 2, 1, 0]
    x = make_req("x", tokens(900, 12))
    admit(bm, x)
    assert table(x) == [3, 4, 2]  # evicting a's block 2 only
    assert bm.pools[0].num_evictions == 1
    assert a.block_hashes[2] not in bm.pools[0].cached
    computed = bm.get_computed_blocks(make_req("a2", tokens(0, 12) + [7]))
    hits, num_hit_tokens = computed.blocks[0], computed.num_tokens
    assert [h.block_id for h in hits] == [0, 1] and num_hit_tokens == 8


def test_double_free_is_an_internal_error():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(AssertionError, match="freed more often"):
        pool.free([block])


@pytest.mark.parametrize("n", [0, -1], ids=["zero", "negative"])
def test_num_blocks_must_be_positive(n):
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        BlockPool(n)


# ---- prefix-cache hits --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bs, shared, n_b, hit_ids, new_ids",
    [
        (4, 12, 14, [0, 1, 2], [3]),  # all of a's full blocks
        (4, 8, 14, [0, 1], [3, 4]),  # diverges at a block boundary
        (4, 6, 10, [0], [3, 4]),  # diverges mid-block: that block is not shared
        (4, 3, 10, [], [3, 4, 5]),  # diverges inside the first block
        (4, 12, 9, [0, 1], [3]),  # b is a's first 9 tokens: its last token is computed
        (2, 12, 13, [0, 1, 2, 3, 4, 5], [6]),
    ],
    ids=[
        "bs4-shared12-prompt14",
        "bs4-shared8-prompt14",
        "bs4-shared6-prompt10",
        "bs4-shared3-prompt10",
        "bs4-prefixof-a-prompt9",
        "bs2-shared12-prompt13",
    ],
)
def test_second_request_gets_exactly_the_shared_full_blocks(bs, shared, n_b, hit_ids, new_ids):
    bm = full_manager(16, bs)
    a = make_req("a", tokens(0, 12))
    admit(bm, a)
    a_blocks = list(table(a))
    b = make_req("b", (tokens(0, shared) + tokens(1000, n_b))[:n_b])
    assert admit(bm, b) == hit_ids
    assert table(b) == hit_ids + [len(a_blocks) + i for i in range(len(new_ids))]
    assert table(b)[len(hit_ids) :] == new_ids
    refs = ref_counts(bm)
    for i in a_blocks:
        assert refs[i] == (2 if i in hit_ids else 1)
    for i in new_ids:
        assert refs[i] == 1
    assert bm.prefix_queries == 12 + n_b
    assert bm.prefix_hits == len(hit_ids) * bs


def test_partial_last_block_is_never_shared():
    bm = full_manager(8, 4)
    a = make_req("a", tokens(0, 6))  # [0 full, 1 partial]
    admit(bm, a)
    b = make_req("b", tokens(0, 6) + [99])  # same 6 tokens, then more
    assert admit(bm, b) == [0]
    assert table(b) == [0, 2]
    assert ref_counts(bm)[:3] == [2, 1, 1]
    assert bm.pools[0].blocks[1].block_hash is None


MATCH_CASES = [(4, 1), (4, 4), (4, 5), (4, 8), (4, 9), (4, 12), (4, 13), (1, 3)]


@pytest.mark.parametrize("bs, n", MATCH_CASES, ids=[f"bs{bs}-prompt{n}" for bs, n in MATCH_CASES])
def test_full_prompt_match_leaves_the_last_token_to_compute(bs, n):
    bm = full_manager(16, bs)
    a = make_req("a", tokens(0, n))
    admit(bm, a)
    b = make_req("b", tokens(0, n))
    computed = bm.get_computed_blocks(b)
    hits, num_hit_tokens = computed.blocks[0], computed.num_tokens
    num_hit_blocks = (n - 1) // bs
    assert [h.block_id for h in hits] == list(range(num_hit_blocks))
    assert num_hit_tokens == num_hit_blocks * bs < n
    assert bm.allocate_slots(b, n - num_hit_tokens, computed)
    assert table(b)[:num_hit_blocks] == table(a)[:num_hit_blocks]
    assert len(table(b)) == len(table(a))
    assert set(table(b)[num_hit_blocks:]).isdisjoint(table(a))
    # Even a request whose own hashes cover every block (a, freed after computing it all).
    bm.free(a)
    a.num_computed_tokens = 0
    assert len(a.block_hashes) == n // bs
    computed = bm.get_computed_blocks(a)
    hits, num_hit_tokens = computed.blocks[0], computed.num_tokens
    assert len(hits) == num_hit_blocks and num_hit_tokens == num_hit_blocks * bs


def test_hits_on_free_blocks_are_taken_out_of_the_free_queue():
    bm = full_manager(8, 4)
    a = make_req("a", tokens(0, 12))
    admit(bm, a)
    bm.free(a)
    assert free_queue(bm) == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_req("b", tokens(0, 8) + tokens(500, 3))
    assert admit(bm, b) == [0, 1]
    assert table(b) == [0, 1, 3]  # the new block comes from the head, not a's block 2
    assert free_queue(bm) == [4, 5, 6, 7, 2]
    assert ref_counts(bm) == [1, 1, 0, 1, 0, 0, 0, 0]
    assert bm.pools[0].num_evictions == 0
    assert bm.pools[0].lookup(a.block_hashes[2]).block_id == 2  # still cached, still free


def test_lookup_stops_at_the_first_miss():
    bm = full_manager(8, 4)
    a = make_req("a", tokens(0, 12))
    admit(bm, a)
    # Block 1 differs, block 2 equals a's block 2 token for token: its chained hash differs.
    b = make_req("b", tokens(0, 4) + tokens(700, 4) + tokens(8, 4) + [1])
    assert admit(bm, b) == [0]
    assert table(b) == [0, 3, 4, 5]
    assert b.block_hashes[2] != a.block_hashes[2]


# ---- hashing ------------------------------------------------------------------------------------


def test_hash_is_stable_and_pinned():
    # The digest keys the router index, Redis and the offload tiers: it must not drift.
    h0 = hash_block(b"", [1, 2, 3, 4])
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert h0.hex() == "5c3887ef44b86da26265cb5c108a056b"
    assert h1.hex() == "1664ccca28a32287142c2088ea54ac27"
    # The format: blake2b-128 over parent || little-endian int32 token ids.
    assert h0 == hashlib.blake2b(struct.pack("<4i", 1, 2, 3, 4), digest_size=HASH_BYTES).digest()
    assert h1 == hashlib.blake2b(h0 + struct.pack("<4i", 5, 6, 7, 8), digest_size=HASH_BYTES).digest()
    assert hash_block(b"", [1, 2, 3, 4]) == h0  # no hidden state between calls
    assert hash_block(b"", [1, 2, 3, 4], extra=b"lora-1") != h0


def test_same_tokens_under_different_prefixes_hash_differently():
    block = [7, 7, 7, 7]
    a = hash_blocks([1, 2, 3, 4] + block, 4)
    b = hash_blocks([1, 2, 3, 5] + block, 4)
    assert a[0] != b[0] and a[1] != b[1]
    assert a[1] == hash_block(a[0], block)
    assert hash_block(b"", block) not in (a[1], b[1])


HASH_CASES = [(4, 0), (4, 3), (4, 4), (4, 11), (3, 12)]


@pytest.mark.parametrize("bs, n", HASH_CASES, ids=[f"bs{bs}-tokens{n}" for bs, n in HASH_CASES])
def test_hash_blocks_covers_full_blocks_and_resumes(bs, n):
    toks = tokens(40, n)
    hashes = hash_blocks(toks, bs)
    assert len(hashes) == n // bs
    for start in range(len(hashes) + 1):
        parent = hashes[start - 1] if start else b""
        assert hash_blocks(toks, bs, start=start, parent=parent) == hashes[start:]


# ---- allocation failure changes nothing ---------------------------------------------------------


def test_allocate_slots_false_changes_nothing():
    bm = full_manager(4, 4)
    a = make_req("a", tokens(0, 12))
    admit(bm, a)  # [0, 1, 2], one block free
    b = make_req("b", tokens(100, 8))
    computed = bm.get_computed_blocks(b)
    before = snapshot(bm, a, b)
    assert not bm.allocate_slots(b, 8, computed)
    assert snapshot(bm, a, b) == before
    # A running request short of a block: same.
    a.append_token(1)
    assert bm.allocate_slots(a, 1)  # 13 tokens: takes the last free block
    assert table(a) == [0, 1, 2, 3]
    a.num_computed_tokens += 1
    for tok in (2, 3, 4, 5):
        a.append_token(tok)
    before = snapshot(bm, a)
    assert not bm.allocate_slots(a, 4)  # 17 tokens would need a fifth block
    assert snapshot(bm, a) == before


@pytest.mark.parametrize(
    "x_frees, ok",
    [(False, False), (True, True)],
    ids=["hits-in-free-queue-short", "hits-in-free-queue-enough"],
)
def test_allocate_slots_counts_free_hits_against_free_blocks(x_frees, ok):
    bm = full_manager(4, 4)
    a = make_req("a", tokens(0, 8))
    admit(bm, a)  # [0, 1], both cached
    bm.free(a)  # queue [2, 3, 1, 0]
    x = make_req("x", tokens(900, 8))
    admit(bm, x)  # takes the never-cached 2 and 3
    assert table(x) == [2, 3] and free_queue(bm) == [1, 0]
    if x_frees:
        bm.free(x)  # queue [1, 0, 3, 2]
    b = make_req("b", tokens(0, 8) + tokens(300, 4))  # hits a's 0 and 1, needs one more block
    computed = bm.get_computed_blocks(b)
    hits, num_hit_tokens = computed.blocks[0], computed.num_tokens
    assert [h.block_id for h in hits] == [0, 1] and num_hit_tokens == 8
    assert all(h.ref_count == 0 for h in hits)
    # The two free blocks *are* the hits: taking them leaves nothing for the third block.
    before = snapshot(bm, b)
    assert bm.allocate_slots(b, 4, computed) is ok
    if ok:
        assert table(b) == [0, 1, 3]
        assert free_queue(bm) == [2]
        assert ref_counts(bm) == [1, 1, 0, 1]
    else:
        assert snapshot(bm, b) == before
        assert free_queue(bm) == [1, 0]


def test_hits_held_by_a_running_request_cost_no_free_blocks():
    bm = full_manager(4, 4)
    a = make_req("a", tokens(0, 8))
    admit(bm, a)  # [0, 1] in use
    admit(bm, make_req("x", tokens(900, 4)))  # [2]
    b = make_req("b", tokens(0, 8) + tokens(300, 4))
    assert admit(bm, b) == [0, 1]
    assert table(b) == [0, 1, 3]
    assert ref_counts(bm) == [2, 2, 1, 1]
    assert free_queue(bm) == []


# ---- when there are no hits ---------------------------------------------------------------------


def test_prompt_logprobs_requests_get_no_hits():
    bm = full_manager(8, 4)
    a = make_req("a", tokens(0, 9))
    admit(bm, a)
    b = make_req("b", tokens(0, 9), prompt_logprobs=1)
    assert bm.get_computed_blocks(b).num_tokens == 0
    assert bm.prefix_queries == 9  # a's lookup only
    assert admit(bm, b) == []
    assert table(b) == [3, 4, 5]
    assert ref_counts(bm)[:6] == [1] * 6
    # b computed identical full blocks; the index keeps a's.
    assert b.block_hashes == a.block_hashes
    assert bm.pools[0].cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    assert bm.pools[0].blocks[3].block_hash is None and bm.pools[0].blocks[4].block_hash is None


def test_prefix_caching_disabled_gives_no_hits_and_registers_nothing():
    bm = full_manager(8, 4, enable_prefix_caching=False)
    a = make_req("a", tokens(0, 9))
    admit(bm, a)
    bm.free(a)
    b = make_req("b", tokens(0, 9))
    assert bm.get_computed_blocks(b).num_tokens == 0
    assert admit(bm, b) == []
    assert table(b) == [0, 1, 2]  # the blocks a freed, last freed first: nothing cached to keep
    assert bm.pools[0].cached == {}
    assert all(block.block_hash is None for block in bm.pools[0].blocks)
    assert bm.pools[0].num_evictions == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)


def test_without_prefix_caching_the_blocks_freed_last_are_taken_first():
    """No block's contents are worth keeping: the pool reuses the blocks freed last (from block 0
    at first), so the cache's memory in use stays at the most blocks ever held at once."""
    bm = full_manager(8, 4, enable_prefix_caching=False)
    a, b = make_req("a", tokens(0, 9)), make_req("b", tokens(100, 5))
    admit(bm, a)
    admit(bm, b)
    assert (table(a), table(b)) == ([0, 1, 2], [3, 4])
    bm.free(b)
    c = make_req("c", tokens(200, 13))
    admit(bm, c)
    assert table(c) == [3, 4, 5, 6]  # b's two, then the untouched ones from the low end
    bm.free(a)
    bm.free(c)
    seen = set()
    for i in range(20):  # requests one after another take the same blocks: c's, freed last
        r = make_req(f"r{i}", tokens(300 + i, 9))
        admit(bm, r)
        seen.update(table(r))
        bm.free(r)
    assert seen == {3, 4, 5}


def test_pool_with_prefix_caching_disabled_registers_nothing():
    pool = BlockPool(2, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_full_block(block, hash_block(b"", [1, 2]))
    assert block.block_hash is None and pool.cached == {}


def test_duplicate_content_keeps_the_first_block_in_the_index():
    bm = full_manager(8, 4)
    a = make_req("a", tokens(0, 8))
    admit(bm, a)  # [0, 1]
    b = make_req("b", tokens(0, 8))  # full match: hits block 0, recomputes block 1's content
    assert admit(bm, b) == [0]
    assert table(b) == [0, 2]
    assert b.block_hashes[1] == a.block_hashes[1]
    assert bm.pools[0].cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    assert bm.pools[0].blocks[2].block_hash is None
    # a leaves first; a third request still finds a's copy, not b's.
    bm.free(a)
    c = make_req("c", tokens(0, 8) + [50])
    assert admit(bm, c) == [0, 1]
    assert table(c) == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 1, 1, 1]
    bm.free(b)  # b's duplicate goes back uncached
    assert bm.pools[0].blocks[2].block_hash is None
    assert bm.pools[0].lookup(a.block_hashes[1]).block_id == 1


# ---- reset --------------------------------------------------------------------------------------


def test_reset_prefix_cache_forgets_free_blocks_only():
    bm = full_manager(8, 4)
    a = make_req("a", tokens(0, 9))  # [0, 1, 2] stays running
    c = make_req("c", tokens(100, 8))  # [3, 4] freed
    admit(bm, a)
    admit(bm, c)
    bm.free(c)
    queue = free_queue(bm)
    bm.pools[0].reset_prefix_cache()
    assert bm.pools[0].cached == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    assert bm.pools[0].blocks[3].block_hash is None and bm.pools[0].blocks[4].block_hash is None
    assert free_queue(bm) == queue
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.pools[0].num_evictions == 0
    assert admit(bm, make_req("c2", tokens(100, 8) + [1])) == []
    assert admit(bm, make_req("a2", tokens(0, 9))) == [0, 1]
