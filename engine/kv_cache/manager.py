"""The one owner of the engine's KV memory: every table's block pool, a manager per table, the
prefix cache and the per-request state pool.

A request holds one block table per TableSpec (`Request.block_ids[t]`, see spec.py `tables`), each
covering its first `num_computed_tokens + num_new_tokens` tokens in engine blocks of block_size
tokens. Full blocks are registered in their table's prefix cache under their chained hash
(hashing.py) when they are allocated for computation, so a request arriving later with the same
prefix reuses them instead of recomputing. A prefix hit is served by every table or by none: the
coordinator (`get_computed_blocks`) shrinks the hit until each table's manager can serve it (a
window table needs only its last blocks, a compressed table its entries) and a state snapshot
exists at its end when the spec has states. A hit never covers a request's last token: at least
one token must run through the model to produce logits.

The scheduler asks it (admission, growth, preemption, finish) and EngineCore asks it (imports,
exports, caching drafts' blocks); nothing else allocates or frees. Not thread-safe: only the
engine's step loop may call it; other threads read `stats()` snapshots the loop publishes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.hashing import hash_block
from engine.kv_cache.single_type import MANAGERS, SingleTypeManager, table_slots
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.state import StatePool
from engine.request import Request


class ComputedBlocks(NamedTuple):
    """A prefix hit: the same number of blocks in every table (None: a table needs none there)."""

    blocks: tuple[list[Block | None], ...]
    num_tokens: int

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


@dataclass(frozen=True)
class KVStats:
    """What the KV memory looks like after a step, for other threads (a worker's /metrics and load)."""

    usage: float
    """The fullest table's fraction of blocks in use."""
    num_free_blocks: int
    num_blocks: int
    """Over every table's pool (null blocks not counted)."""
    prefix_queries: int
    prefix_hits: int
    num_free_state_slots: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


def size_tables(
    spec: KVCacheSpec,
    memory_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    lookahead: int = 0,
    num_blocks: int | None = None,
) -> tuple[int, ...]:
    """Engine blocks per table for a memory budget. A sliding-window table gets what max_num_seqs
    requests can hold at once -- each the blocks of window - 1 tokens before its next token, one
    more where they straddle a block, and its speculative lookahead, plus the blocks of one step's
    new tokens (max_num_batched_tokens over all requests, one more per request where its chunk
    straddles), and its null block -- not their whole history. The tables that keep a request's
    whole history (full attention, compressed) get one count, num_blocks or as many as the rest of
    the budget holds, capped at what max_num_seqs requests of max_model_len tokens can use."""
    bs = spec.block_size
    counts = [0] * len(spec.tables)
    history = []
    window_bytes = 0
    for i, t in enumerate(spec.tables):
        if not t.windowed:
            history.append(i)
            continue
        per_request = -(-(t.window - 1) // bs) + 2 + -(-lookahead // bs)
        step = -(-min(max_num_batched_tokens, max_num_seqs * max_model_len) // bs)
        cap = max_num_seqs * -(-(max_model_len + lookahead) // bs)
        counts[i] = min(max_num_seqs * per_request + step, cap) + 1
        window_bytes += counts[i] * spec.table_bytes_per_block(t)
    if history:
        per_block = sum(spec.table_bytes_per_block(spec.tables[i]) for i in history)
        useful = max_num_seqs * -(-max_model_len // bs)
        n = num_blocks or max(1, min(useful, (memory_bytes - window_bytes) // per_block))
        for i in history:
            counts[i] = n
    return tuple(counts)


def history_blocks(spec: KVCacheSpec, counts: Sequence[int]) -> int | None:
    """How many engine blocks of history a request can hold: the count of the tables that keep
    it all (full attention, compressed); None when every table is a window (no bound: a window
    table holds a window, whatever the length)."""
    history = [n for t, n in zip(spec.tables, counts, strict=True) if not t.windowed]
    return min(history) if history else None


class KVCacheManager:
    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int | Sequence[int],
        enable_prefix_caching: bool = True,
        on_evict: Callable[[bytes, int, int], None] | None = None,
        on_evict_state: Callable[[bytes, tuple], None] | None = None,
        num_state_slots: int = 0,
        num_state_snapshots: int = 0,
        num_draft_positions: int = 0,
        device: torch.device | str = "cpu",
    ):
        """num_blocks: engine blocks per table (one count for all); a sliding window's pool spends
        one on its null block. on_evict(block hash, block id, table): a cached block's contents are
        about to be dropped; on_evict_state(block hash, states): a state snapshot's (KV
        offloading keeps both). num_state_slots: requests that can hold a state at once (needed
        when the spec has states)."""
        counts = spec.table_blocks(num_blocks)
        self.spec = spec
        self.block_size = spec.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._on_evict = on_evict
        self.pools = tuple(
            BlockPool(
                n,
                enable_prefix_caching,
                functools.partial(self._evicted, table=i) if on_evict is not None else None,
                null_block=t.windowed,
            )
            for i, (t, n) in enumerate(zip(spec.tables, counts, strict=True))
        )
        self.managers: tuple[SingleTypeManager, ...] = tuple(
            MANAGERS[t.manager](t, pool, self.block_size)
            for t, pool in zip(spec.tables, self.pools, strict=True)
        )
        self.states: StatePool | None = None
        if spec.states:
            if num_state_slots < 1:
                raise ValueError(
                    f"the spec holds per-request state: num_state_slots must be >= 1, got {num_state_slots}"
                )
            self.states = StatePool(
                spec.states, num_state_slots, num_state_snapshots, num_draft_positions, device, on_evict_state
            )
        self._windowed = [i for i, t in enumerate(spec.tables) if t.windowed]
        """Tables whose blocks fall behind a window as the request runs."""
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    def _evicted(self, block_hash: bytes, block_id: int, table: int) -> None:
        """A cached block is about to be dropped (the offloader keeps it). Where a table that keeps
        the history drops one, a window table's free block of the same prefix goes with it, kept
        too: a window pool sized for the running requests rarely evicts, and an offloaded prefix
        is served only where every table can serve it."""
        self._on_evict(block_hash, block_id, table=table)
        if self.spec.tables[table].windowed:
            return
        for w in self._windowed:
            pool = self.pools[w]
            block = pool.lookup(block_hash)
            if block is not None and block.ref_count == 0:
                self._on_evict(block_hash, block.block_id, table=w)
                pool.uncache(block)

    # ---- what it holds ---------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def num_blocks(self) -> int:
        return sum(p.num_usable_blocks for p in self.pools)

    @property
    def usage(self) -> float:
        return max(p.usage for p in self.pools)

    def num_held(self, req: Request) -> list[int]:
        """Blocks the request holds per table (null entries not counted)."""
        tables = req.block_ids or [[] for _ in self.managers]
        return [
            sum(1 for b in table if b != m.pool.null_id)
            for m, table in zip(self.managers, tables, strict=True)
        ]

    def stats(self) -> KVStats:
        return KVStats(
            usage=self.usage,
            num_free_blocks=self.num_free_blocks,
            num_blocks=self.num_blocks,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            num_free_state_slots=self.states.num_free_slots if self.states is not None else 0,
        )

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reset_prefix_cache(self) -> None:
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.states is not None:
            self.states.reset()

    # ---- prefix hits -----------------------------------------------------------------------

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover the full blocks among the first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[i - 1] if i else b""
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, req: Request, max_tokens: int | None = None) -> ComputedBlocks:
        """The longest cached prefix every table (and the state pool) can serve, for a request
        that holds no blocks yet; at most max_tokens tokens (default: all but the last token)."""
        assert not req.block_ids, "prefix lookup is for requests that hold no blocks"
        empty = ComputedBlocks(tuple([] for _ in self.managers), 0)
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return empty  # prompt logprobs need logits at every prompt position
        limit = req.num_tokens - 1 if max_tokens is None else min(max_tokens, req.num_tokens - 1)
        self._update_hashes(req, limit)
        hashes = req.block_hashes
        n = limit // self.block_size
        while True:  # each table (and the states) may only shrink the hit; stop when none does
            hits = [m.find_hits(hashes, n) for m in self.managers]
            agreed = min(len(h) for h in hits)
            if self.states is not None:
                agreed = self.states.longest_snapshot(hashes, agreed)
            if agreed == n:
                return ComputedBlocks(tuple(hits), n * self.block_size)
            n = agreed

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        cache_blocks: bool = True,
        lookahead: int = 0,
        num_external: int = 0,
    ) -> bool:
        """Make room for num_new_tokens more tokens (after the prefix hit `computed`, for a request
        that holds nothing yet) in every table. False, and nothing changed, when a pool (or the
        state slots) cannot give what it needs -- except that blocks behind a window, which no
        token will read again, are back in their pool either way. With cache_blocks=False the new
        full blocks are not registered in the prefix cache (their contents arrive later: see
        cache_blocks). lookahead: room for that many more slots whose tokens are not known yet
        (speculative drafts); they are never registered in the prefix cache. num_external: the
        first that many new tokens' KV is written from outside (a connector's load, an import),
        not computed here, so a window table gets only the blocks from the first token computed
        after them on reads."""
        if req.block_ids:  # a running request grows (every step: kept lean)
            assert computed is None, "prefix hits are for a request that holds no blocks"
            return self._grow(req, num_new_tokens, cache_blocks, lookahead)
        hits = computed.blocks if computed is not None else tuple([] for _ in self.managers)
        num_hits = computed.num_blocks if computed is not None else 0
        num_computed = req.num_computed_tokens + num_hits * self.block_size
        total = num_computed + num_new_tokens
        assert total <= req.num_tokens, "cannot compute tokens that are not known yet"
        want = self.blocks_needed(total + lookahead)
        first_read = num_computed + num_external  # the first token computed here
        # Per table: null entries up to the first block read (a window's), then blocks from there.
        starts = [
            max(len(h), m.table.first_needed(first_read, self.block_size))
            for m, h in zip(self.managers, hits, strict=True)
        ]
        for m, table_hits, start in zip(self.managers, hits, starts, strict=True):
            reusable_free = sum(
                1 for b in table_hits if b is not None and b.ref_count == 0
            )  # in the free queue
            if want - start > m.pool.num_free_blocks - reusable_free:
                return False
        wants_state = self.states is not None and not self.states.holds(req.request_id)
        if wants_state and not self.states.allocate(req.request_id):
            return False
        if self.enable_prefix_caching and req.params.prompt_logprobs is None:
            # Admission (first allocation): count the lookup once, not on every retry.
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_hits * self.block_size
        tables = []
        for t, (m, table_hits, start) in enumerate(zip(self.managers, hits, starts, strict=True)):
            m.pool.touch([b for b in table_hits if b is not None])
            table = [b.block_id if b is not None else m.pool.null_id for b in table_hits]
            table += [m.pool.null_id] * (start - len(table))
            table += [b.block_id for b in m.pool.allocate(max(0, want - start))]
            if t in self._windowed and first_read > num_computed:
                m.free_behind(table, first_read)  # hit blocks the first token no longer reads
            tables.append(table)
        req.block_ids = tables
        if wants_state and num_hits:
            self.states.restore(req.request_id, req.block_hashes[num_hits - 1])
        if cache_blocks:
            self.cache_blocks(req, total, start=num_computed)
        return True

    def _grow(self, req: Request, num_new_tokens: int, cache_blocks: bool, lookahead: int) -> bool:
        tables = req.block_ids
        num_computed = req.num_computed_tokens
        total = num_computed + num_new_tokens
        assert total <= req.num_tokens, "cannot compute tokens that are not known yet"
        for t in self._windowed:
            self.managers[t].free_behind(tables[t], num_computed)
        want = self.blocks_needed(total + lookahead)
        for m, table in zip(self.managers, tables, strict=True):
            if want - len(table) > m.pool.num_free_blocks:
                return False
        for m, table in zip(self.managers, tables, strict=True):
            if want > len(table):
                table.extend(b.block_id for b in m.pool.allocate(want - len(table)))
        if cache_blocks and num_computed // self.block_size < total // self.block_size:
            self.cache_blocks(req, total, start=num_computed)
        return True

    def cache_blocks(self, req: Request, num_tokens: int, start: int = 0) -> None:
        """Register the request's full blocks among tokens [start, num_tokens) in every table's
        prefix cache."""
        if not self.enable_prefix_caching:
            return
        self._update_hashes(req, num_tokens)
        bs = self.block_size
        for m, table in zip(self.managers, req.block_ids, strict=True):
            for i in range(start // bs, num_tokens // bs):
                if table[i] != m.pool.null_id:
                    m.pool.cache_full_block(m.pool.blocks[table[i]], req.block_hashes[i])

    def uncache(self, tables: Sequence[list[int]]) -> None:
        """Take these blocks (per table; negative ids skipped) out of the prefix cache: what was
        registered for them will not be written."""
        for pool, ids in zip(self.pools, tables, strict=True):
            for b in ids:
                if b >= 0 and b != pool.null_id:
                    pool.uncache(pool.blocks[b])

    def snapshot_state(self, req: Request) -> None:
        """The request's computed tokens end on a block boundary: keep its state there for prefix
        hits (the runner calls it after writing the state of such a step)."""
        n = req.num_computed_tokens
        if self.states is not None and self.enable_prefix_caching and n and n % self.block_size == 0:
            self._update_hashes(req, n)
            self.states.snapshot(req.request_id, req.block_hashes[n // self.block_size - 1])

    def free(self, req: Request, keep: int = 0) -> None:
        """Release a request's blocks after its first `keep` in every table, last first, so its
        prefix blocks are evicted last; its state slot too unless it keeps blocks (an export,
        which keeps of a window only what the token after its computed ones reads). Only the
        scheduler calls it (Scheduler.free_blocks)."""
        if req.block_ids:
            for m, table in zip(self.managers, req.block_ids, strict=True):
                m.free(table, keep)
                if keep:
                    m.free_behind(table, req.num_computed_tokens)
                del table[keep:]
            if not any(req.block_ids):
                req.block_ids = []
        if keep == 0 and self.states is not None:
            self.states.free(req.request_id)

    def slot_mapping(self, req: Request, table: int, positions: range) -> list[int]:
        """Where table `table`'s caches take each position's entry (-1: not written)."""
        return table_slots(self.spec.tables[table], self.block_size, req.block_ids[table], positions)
