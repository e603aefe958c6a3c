"""How one block table's blocks live: a manager per kind (full attention, sliding window, compressed).

A request holds one block table per TableSpec of the KV cache spec (engine/kv_cache/spec.py), each
a list of block ids in that table's own BlockPool, entry i for the engine block of tokens
[i * block_size, (i + 1) * block_size). The managers differ in three things:
- which blocks a request still needs (`free_behind`): all of them for full attention and
  compressed caches; for a sliding window of W tokens only those holding the last W - 1 tokens
  before the next one, so blocks behind it go back to the pool while the request runs and the
  table keeps the pool's null block in their place;
- which cached blocks serve a prefix hit of n blocks (`find_hits`): the first n for full
  attention and compressed caches; only the last ceil((W - 1) / block_size) of them for a window;
- where a token's entry is written (`table_slots`, which the runner asks too): every token for
  full attention and windows; for a compressed cache of m tokens per entry only the token that
  completes an entry.

KVCacheManager (manager.py) owns them and is their only caller, on the engine's step loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.spec import TableSpec


class SingleTypeManager(ABC):
    kind: ClassVar[str]

    def __init__(self, table: TableSpec, pool: BlockPool, block_size: int):
        self.table = table
        self.pool = pool
        self.block_size = block_size

    def free_behind(self, blocks: list[int], num_computed: int) -> None:  # noqa: B027 - most keep all
        """Give back the blocks no token from num_computed on will read (in place: their entries
        become the null block)."""

    @abstractmethod
    def find_hits(self, block_hashes: list[bytes], max_blocks: int) -> list[Block | None]:
        """The cached blocks that serve the longest prefix hit of at most max_blocks blocks this
        table can give: one entry per block of the hit, None where the table needs none (behind a
        window). Touches nothing."""

    def free(self, blocks: list[int], keep: int = 0) -> None:
        """Release the table's blocks after its first `keep`, last first (its prefix is evicted
        last), skipping null entries; the caller truncates the table."""
        null = self.pool.null_id
        self.pool.free([self.pool.blocks[b] for b in reversed(blocks[keep:]) if b != null])

    def _cached_prefix(self, block_hashes: list[bytes], max_blocks: int) -> list[Block | None]:
        hits: list[Block | None] = []
        for block_hash in block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits


class FullAttentionManager(SingleTypeManager):
    """Every token attends to every earlier one: a request keeps all its blocks."""

    kind = "full"

    def find_hits(self, block_hashes: list[bytes], max_blocks: int) -> list[Block | None]:
        return self._cached_prefix(block_hashes, max_blocks)


class SlidingWindowManager(SingleTypeManager):
    """A token sees itself and the window - 1 tokens before it (DeepSeek-V4's 128-token window)."""

    kind = "sliding_window"

    def __init__(self, table: TableSpec, pool: BlockPool, block_size: int):
        super().__init__(table, pool, block_size)
        assert pool.null_block is not None, "a sliding window's pool keeps a null block"
        self.window = table.window
        self.blocks_before = -(-(self.window - 1) // block_size)
        """Blocks a token at a block boundary reads before it: the ones holding its window - 1 predecessors."""

    def free_behind(self, blocks: list[int], num_computed: int) -> None:
        null = self.pool.null_id
        first_needed = self.table.first_needed(num_computed, self.block_size)
        behind = [self.pool.blocks[b] for b in blocks[:first_needed] if b != null]
        if behind:
            self.pool.free(behind)  # oldest first: evicted first
            blocks[:first_needed] = [null] * first_needed

    def find_hits(self, block_hashes: list[bytes], max_blocks: int) -> list[Block | None]:
        """The largest n <= max_blocks whose last blocks_before blocks (all n when fewer) are cached:
        scanned from the right, the first run of that many cached blocks ends it."""
        n = min(max_blocks, len(block_hashes))
        need = self.blocks_before
        if need == 0:  # a window of one token reads no earlier block
            return [None] * n
        run: list[Block] = []
        for i in range(n - 1, -1, -1):
            block = self.pool.lookup(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= need:  # blocks [i, i + need) are cached: a hit of i + need blocks
                return [None] * i + run[::-1]
        return run[::-1]  # fewer than need blocks, all cached from the first: the whole prefix is read


class CompressedManager(SingleTypeManager):
    """One entry summarises tokens_per_entry (m) tokens; an entry is written by the token that
    completes it, so a table covers the same engine blocks as full attention at 1/m of the bytes."""

    kind = "compressed"

    def find_hits(self, block_hashes: list[bytes], max_blocks: int) -> list[Block | None]:
        return self._cached_prefix(block_hashes, max_blocks)


def table_slots(table: TableSpec, block_size: int, blocks: list[int], positions: range) -> list[int]:
    """Where each position's entry is written in a table's caches (blocks: a request's block table
    there); -1: not written. In tokens of the engine block (block id x block_size + offset), or
    for a compressed table in entries (block id x entries per block + entry offset) at the
    positions that complete one. The KV cache manager and the runner both ask it."""
    if table.manager != "compressed":
        return [blocks[p // block_size] * block_size + p % block_size for p in positions]
    m = table.tokens_per_entry
    per_block = block_size // m
    out = []
    for p in positions:
        if (p + 1) % m:
            out.append(-1)
        else:
            e = p // m
            out.append(blocks[e // per_block] * per_block + e % per_block)
    return out


MANAGERS: dict[str, type[SingleTypeManager]] = {
    m.kind: m for m in (FullAttentionManager, SlidingWindowManager, CompressedManager)
}
"""Manager class by TableSpec.manager."""
