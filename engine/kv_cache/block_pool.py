"""KV-cache blocks: reference counts, a free queue with LRU eviction, and the prefix-cache index.

A block is owned by the requests that reference it (ref_count > 0). A full block may also carry
a content hash; it then stays findable in the index after its last owner frees it, until the
allocator reuses it. The free queue is ordered: freed blocks go to its tail, and with prefix
caching blocks are taken from its head, so the least recently freed cached block is evicted
first. Without it no block's contents are worth keeping, and blocks are taken from the tail:
the ones freed last, still in the CPU's caches, and the cache's memory stays resident only for
as many blocks as ever ran at once (engine/kv_cache/spec.py allocates it untouched).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    """Set once the block is full and registered in the prefix-cache index."""


class BlockPool:
    """Not thread-safe: only the engine's step loop may call it."""

    def __init__(
        self,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        on_evict: Callable[[bytes, int], None] | None = None,
        null_block: bool = False,
    ):
        """null_block: block 0 is never handed out; it stands in a block table for blocks a
        request no longer holds (those behind a sliding window), so the table stays a valid index."""
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0] if null_block else None
        self.null_id = 0 if null_block else -1
        """The null block's id in a block table; -1 (no block's id) where the pool has none, so
        `block_id != null_id` tells a held entry in any table."""
        first = 1 if null_block else 0
        order = range(first, num_blocks) if enable_prefix_caching else reversed(range(first, num_blocks))
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in order)
        self.cached: dict[bytes, int] = {}  # block hash -> block id
        self.enable_prefix_caching = enable_prefix_caching
        self.num_evictions = 0
        self.on_evict = on_evict
        """Called with (block hash, block id) just before a cached block's contents are dropped
        (KV offloading copies them out)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return len(self.blocks) - (self.null_block is not None)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def lookup(self, block_hash: bytes) -> Block | None:
        block_id = self.cached.get(block_hash)
        return None if block_id is None else self.blocks[block_id]

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the free queue (its head with prefix caching, else its tail), evicting
        their cached contents."""
        assert n <= self.num_free_blocks, "caller must check num_free_blocks first"
        out = []
        newest_first = not self.enable_prefix_caching
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=newest_first)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block_id)
                del self.cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Add a reference to prefix-cache hits (taking free ones out of the free queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop one reference each; blocks reaching zero go to the free queue's tail in the given order."""
        for block in blocks:
            assert block.ref_count > 0, f"block {block.block_id} freed more often than referenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = None

    def cache_full_block(self, block: Block, block_hash: bytes) -> None:
        """Register a block whose tokens are all known under its chained hash (first writer wins)."""
        if not self.enable_prefix_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block.block_id

    def uncache(self, block: Block) -> None:
        """Drop a block's prefix-cache entry (its contents are not what its hash says)."""
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0 and block.block_hash is not None:
                block.block_hash = None
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].block_hash == h}
