"""Maps requests onto KV-cache blocks: allocation, prefix-cache hits, freeing.

A request's blocks cover its first `num_computed_tokens + num_new_tokens` tokens. Full blocks are
registered in the prefix cache under their chained hash (see hashing.py) when they are allocated
for computation, so a request arriving later with the same prefix reuses them instead of
recomputing. A cache hit never covers a request's last token: at least one token must run through
the model to produce logits.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.kv_cache.block_pool import Block, BlockPool
from engine.kv_cache.hashing import hash_block
from engine.request import Request


class BlockManager:
    """Not thread-safe: only the engine's step loop may call it."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        on_evict: Callable[[bytes, int], None] | None = None,
    ):
        """on_evict(block hash, block id): a cached block's contents are about to be dropped."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching, on_evict)
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _update_hashes(self, req: Request, num_tokens: int) -> None:
        """Extend req.block_hashes to cover the full blocks among the first num_tokens tokens."""
        bs = self.block_size
        for i in range(len(req.block_hashes), num_tokens // bs):
            parent = req.block_hashes[i - 1] if i else b""
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, req: Request) -> tuple[list[Block], int]:
        """Longest cached prefix of a request that holds no blocks yet -> (blocks, tokens they cover)."""
        assert not req.block_ids, "prefix lookup is for requests that hold no blocks"
        if not self.enable_prefix_caching or req.params.prompt_logprobs is not None:
            return [], 0  # prompt logprobs need logits at every prompt position
        self._update_hashes(req, req.num_tokens - 1)
        hits: list[Block] = []
        for block_hash in req.block_hashes[: (req.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        req: Request,
        num_new_tokens: int,
        computed: list[Block] | None = None,
        cache_blocks: bool = True,
        lookahead: int = 0,
    ) -> bool:
        """Make room for num_new_tokens more tokens (after any prefix hits). False, and nothing
        changed, when the free blocks don't suffice. With cache_blocks=False the new full blocks
        are not registered in the prefix cache (their contents arrive later: see cache_blocks).
        lookahead: room for that many more slots whose tokens are not known yet (speculative
        drafts); they are never registered in the prefix cache."""
        computed = computed or []
        num_computed = req.num_computed_tokens + len(computed) * self.block_size
        total = num_computed + num_new_tokens
        assert total <= req.num_tokens, "cannot compute tokens that are not known yet"
        needed = self.blocks_needed(total + lookahead) - len(req.block_ids) - len(computed)
        reusable_free = sum(1 for b in computed if b.ref_count == 0)  # hits sitting in the free queue
        if needed > self.pool.num_free_blocks - reusable_free:
            return False
        if not req.block_ids and self.enable_prefix_caching and req.params.prompt_logprobs is None:
            # Admission (first allocation): count the lookup once, not on every retry.
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(computed) * self.block_size
        self.pool.touch(computed)
        req.block_ids.extend(b.block_id for b in computed)
        req.block_ids.extend(b.block_id for b in self.pool.allocate(max(needed, 0)))
        if cache_blocks:
            self.cache_blocks(req, total, start=num_computed)
        return True

    def cache_blocks(self, req: Request, num_tokens: int, start: int = 0) -> None:
        """Register the request's full blocks among tokens [start, num_tokens) in the prefix cache."""
        if self.enable_prefix_caching:
            self._update_hashes(req, num_tokens)
            for i in range(start // self.block_size, num_tokens // self.block_size):
                self.pool.cache_full_block(self.pool.blocks[req.block_ids[i]], req.block_hashes[i])

    def free(self, req: Request, keep: int = 0) -> None:
        """Release a request's blocks after its first `keep`, tail first, so its prefix blocks
        are evicted last. Only the scheduler calls it (Scheduler.free_blocks)."""
        self.pool.free([self.pool.blocks[b] for b in reversed(req.block_ids[keep:])])
        req.block_ids = req.block_ids[:keep]
