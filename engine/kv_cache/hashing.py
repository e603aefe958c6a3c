"""Chained content hash of full KV blocks, shared by the engine, the router index, Redis and offload tiers.

    hash_i = blake2b(hash_{i-1} || int32 token ids of block i || extra), hash_{-1} = b""

A block's hash therefore names its whole prefix, not just its own tokens. The digest is stable
across processes and machines (unlike Python's `hash`), so it can key shared stores.
"""

from __future__ import annotations

import hashlib
import struct

HASH_BYTES = 16


def hash_block(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=HASH_BYTES)
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))  # little-endian int32 everywhere
    if extra:
        h.update(extra)
    return h.digest()


def hash_blocks(token_ids: list[int], block_size: int, start: int = 0, parent: bytes = b"") -> list[bytes]:
    """Hashes of the full blocks of token_ids from block index `start` on, chained from `parent`."""
    out = []
    for begin in range(start * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[begin : begin + block_size])
        out.append(parent)
    return out


REDIS_KEY_PREFIX = "pdkv:"
"""Namespace of stored blocks in Redis (offload.RedisTier; the router reads it)."""


def tier_key(compat: str, block_hash: bytes) -> str:
    """How every offload tier names a stored block: the KV cache spec's compatibility hash, so
    incompatible engines never read each other's blocks, then the chained block hash."""
    return f"{compat}:{block_hash.hex()}"


def redis_key(compat: str, block_hash: bytes) -> str:
    return REDIS_KEY_PREFIX + tier_key(compat, block_hash)
