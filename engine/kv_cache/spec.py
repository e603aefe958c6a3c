"""What the paged KV cache holds, described once: a KVCacheSpec made of cache groups
(engine/kv_cache/cache_group.py) and per-request states.

Every (group, layer) cache is a tensor [num_group_blocks, block_size, width], looked up by its kind
and model layer (`KVCaches.layer`, `KVCaches.group`). The engine keeps them in one flat list, a
group's layers together in the spec's group order: a cache's position there, its slot, is how
transfers, offload and the wire address caches (`KVCacheSpec.slot_start`, `group_at`), the same on
both sides of equal specs.

Groups that live alike share a block table (`tables`): the full-attention kinds (latent, MTP,
indexer keys) one, the compressed groups of one rate one (DeepSeek-V4's CSA entries and their
indexer keys), a sliding-window group its own; a request holds a block table
per table, in engine blocks of `block_size` tokens (the spec's: the largest group block in
tokens). Every group's block, in tokens (block_size x tokens_per_entry), divides it, so one engine
block is `sub_blocks(g)` consecutive blocks of group g, and a group's rows follow from its table's
block ids (`group_block_ids`). Each table's caches are sized by its own block count (`allocate`);
engine/kv_cache/manager.py allocates, prefix-caches and frees each table's blocks by its kind.

The spec is what two engines compare before KV moves between them, over a transfer or an offload
tier: `compat_hash()` covers the model, every group's geometry, dtype and element layout --
including the order `k_pe`'s rotated pairs are stored in, so a change to the rotary kernels'
output changes the hash instead of silently mixing layouts -- and every state. The KV cache
manager, the runner, the KV byte codec, the wire check, the offload tiers and a worker's identity
read geometry from here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.hugepages import huge_zeros
from engine.kv_cache.cache_group import (
    FULL_KINDS,
    CacheGroupSpec,
    CacheKind,
    StateSpec,
    dtype_named,
)
from kernels.rotary import OUTPUT_LAYOUT

MANAGER_KINDS = ("full", "sliding_window", "compressed")
"""How a block table's blocks live (engine/kv_cache/single_type.py has one manager per kind)."""


@dataclass(frozen=True)
class TableSpec:
    """Cache groups that share one block table because they live alike: a request's blocks in
    them are allocated, prefix-cached and freed together (vLLM groups its full-attention layers of
    different widths the same way). Every table is in engine blocks of the spec's block_size
    tokens; a member group whose blocks are smaller takes sub_blocks of them per engine block."""

    manager: str
    """One of MANAGER_KINDS."""
    groups: tuple[CacheGroupSpec, ...]

    @property
    def windowed(self) -> bool:
        """Its blocks fall behind a sliding window as a request runs (the others keep its history)."""
        return self.manager == "sliding_window"

    @property
    def window(self) -> int:
        """sliding_window: the tokens a query sees (0 otherwise)."""
        return self.groups[0].window

    @property
    def tokens_per_entry(self) -> int:
        """compressed: the tokens one entry summarises (1 otherwise)."""
        return self.groups[0].tokens_per_entry

    def first_needed(self, num_tokens: int, block_size: int) -> int:
        """The first block a request whose first num_tokens tokens are computed still reads: a
        window's next token sees the window - 1 tokens before it; every other table all of them."""
        return max(0, num_tokens - (self.window - 1)) // block_size if self.windowed else 0

    @property
    def kinds(self) -> tuple[CacheKind, ...]:
        return tuple(g.kind for g in self.groups)


def _manager_of(g: CacheGroupSpec) -> str:
    if g.kind in FULL_KINDS:
        return "full"
    return "sliding_window" if g.kind == CacheKind.SLIDING_WINDOW else "compressed"


@dataclass(frozen=True)
class KVCacheSpec:
    groups: tuple[CacheGroupSpec, ...]
    model_fingerprint: str
    """Fingerprint of the model's config: KV only means the same thing under the same weights'
    architecture (see `model_fingerprint`)."""
    states: tuple[StateSpec, ...] = ()
    """Per-request states beside the caches (DeepSeek-V4's compressor states)."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a KV cache spec needs at least one cache group")
        kinds = [g.kind for g in self.groups]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"a KV cache spec has one group of each kind, got {[k.value for k in kinds]}")
        for g in self.groups:
            if self.block_size % _tokens_per_block(g):
                raise ValueError(
                    f"a {g.kind.value} group's block holds {_tokens_per_block(g)} tokens, which does not "
                    f"divide the engine block of {self.block_size} tokens"
                )

    @functools.cached_property
    def tables(self) -> tuple[TableSpec, ...]:
        """The block tables a request holds: the full-attention groups together (first), then the
        compressed groups of each rate together and each window group alone, in the spec's group
        order."""
        by_manager: dict[tuple, list[CacheGroupSpec]] = {}
        for g in self.groups:
            manager = _manager_of(g)
            key = {"full": (), "compressed": (g.tokens_per_entry,)}.get(manager, (g.kind,))
            by_manager.setdefault((manager, *key), []).append(g)
        tables = [TableSpec(_manager_of(gs[0]), tuple(gs)) for gs in by_manager.values()]
        return tuple(sorted(tables, key=lambda t: t.manager != "full"))

    def table_index(self, kind: CacheKind) -> int:
        """Which of a request's block tables group `kind` reads."""
        for i, t in enumerate(self.tables):
            if kind in t.kinds:
                return i
        raise KeyError(f"the KV cache spec has no {kind.value!r} group")

    def transfer_ranges(self, num_tokens: int, first_block: int = 0) -> tuple[tuple[int, int], ...]:
        """The blocks a hand-over of a request's first num_tokens tokens moves, per table: [start,
        end) in the request's block index, from first_block (what the receiver holds already) on,
        and for a window table only from the first block its next token reads. Both sides derive
        it from the same numbers: the producer to send, the consumer to check and expect."""
        end = -(-num_tokens // self.block_size)
        return tuple(
            (min(end, max(first_block, t.first_needed(num_tokens, self.block_size))), end)
            for t in self.tables
        )

    def table_bytes_per_block(self, t: TableSpec) -> int:
        """One engine block of table t over every layer of its groups."""
        return sum(g.num_layers * self.layer_bytes_per_block(g) for g in t.groups)

    @property
    def num_caches(self) -> int:
        """(group, layer) caches over all groups: the length of the engine's flat list."""
        return sum(g.num_layers for g in self.groups)

    def slot_start(self, g: CacheGroupSpec) -> int:
        """Where group g's caches start in the flat list (its layers follow in order)."""
        start = 0
        for other in self.groups:
            if other.kind == g.kind:
                return start
            start += other.num_layers
        raise ValueError(f"cache group {g.kind.value!r} is not in this spec")

    def group_at(self, slot: int) -> CacheGroupSpec:
        """The group whose caches hold flat position `slot`."""
        start = 0
        for g in self.groups:
            if start <= slot < start + g.num_layers:
                return g
            start += g.num_layers
        raise ValueError(f"cache slot {slot} outside [0, {self.num_caches})")

    def group(self, kind: CacheKind) -> CacheGroupSpec:
        for g in self.groups:
            if g.kind == kind:
                return g
        raise KeyError(f"the KV cache spec has no {kind.value!r} group")

    def has(self, kind: CacheKind) -> bool:
        return any(g.kind == kind for g in self.groups)

    def slot(self, kind: CacheKind, layer: int) -> int:
        """Flat position of group `kind`'s cache of model layer `layer`."""
        g = self.group(kind)
        if layer not in g.layers:
            raise KeyError(
                f"the {kind.value!r} cache group holds no layer {layer} (it holds {list(g.layers)})"
            )
        return self.slot_start(g) + g.layers.index(layer)

    @property
    def block_size(self) -> int:
        """Tokens per engine block: the largest group block, in tokens."""
        return max(_tokens_per_block(g) for g in self.groups)

    def sub_blocks(self, g: CacheGroupSpec) -> int:
        """Blocks of group g in one engine block."""
        return self.block_size // _tokens_per_block(g)

    def group_block_ids(self, g: CacheGroupSpec, block_ids: list[int]) -> list[int]:
        """Group g's block table for these engine blocks, in order."""
        k = self.sub_blocks(g)
        if k == 1:
            return list(block_ids)
        return [b * k + j for b in block_ids for j in range(k)]

    def layer_bytes_per_block(self, g: CacheGroupSpec) -> int:
        """One engine block of one of group g's layers."""
        return self.sub_blocks(g) * g.block_bytes

    @property
    def bytes_per_block(self) -> int:
        """One engine block's bytes over every layer of every group."""
        return sum(self.table_bytes_per_block(t) for t in self.tables)

    def describe(self) -> dict:
        d = {"model": self.model_fingerprint, "groups": [g.describe() for g in self.groups]}
        if self.states:
            d["states"] = [s.describe() for s in self.states]
        return d

    def compat_hash(self) -> str:
        """Equal hashes <=> KV blocks mean the same thing in both engines (16 hex digits)."""
        return self._compat_hash

    @functools.cached_property
    def _compat_hash(self) -> str:
        blob = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @staticmethod
    def from_description(d: dict) -> KVCacheSpec:
        """Inverse of describe(); ValueError naming the field on anything malformed."""
        try:
            groups = tuple(
                CacheGroupSpec(
                    kind=CacheKind(g["kind"]),
                    layers=tuple(int(x) for x in g["layers"]),
                    block_size=int(g["block_size"]),
                    width=int(g["width"]),
                    dtype=dtype_named(g["dtype"]),
                    rope_width=int(g["rope_width"]),
                    rotary_layout=str(g["rotary_layout"]),
                    tokens_per_entry=int(g["tokens_per_entry"]),
                    rope_offset=_rope_offset(g),
                    scale=str(g["scale"]),
                    window=int(g.get("window", 0)),
                )
                for g in d["groups"]
            )
            states = tuple(
                StateSpec(
                    str(s["name"]),
                    tuple(int(x) for x in s["layers"]),
                    tuple(int(x) for x in s["shape"]),
                    dtype_named(s["dtype"]),
                )
                for s in d.get("states", ())
            )
            return KVCacheSpec(groups, str(d["model"]), states)
        except KeyError as e:
            raise ValueError(f"KV cache spec lacks the field {e.args[0]!r}") from None

    def check_runnable(self) -> None:
        """Refuse, by name, what this engine cannot run yet: FP8 entries, and attention over a
        group whose blocks are smaller than the engine block (the runner builds each table's slot
        mapping in engine blocks)."""
        for g in self.groups:
            if g.scale != "none":
                raise NotImplementedError(
                    f"a {g.kind.value} group of FP8 entries with a {g.scale} scale is described but not run yet"
                )
            if self.sub_blocks(g) != 1:
                raise NotImplementedError(
                    f"a {g.kind.value} group of {g.block_size}-entry blocks under {self.block_size}-token "
                    "engine blocks is allocated and moved, but not attended yet"
                )

    def table_blocks(self, num_blocks: int | Sequence[int]) -> tuple[int, ...]:
        """Engine blocks per table: one count for every table, or one each."""
        counts = (num_blocks,) * len(self.tables) if isinstance(num_blocks, int) else tuple(num_blocks)
        if len(counts) != len(self.tables) or min(counts) < 1:
            raise ValueError(
                f"{counts} blocks: the spec has {len(self.tables)} block tables, each needs >= 1 block"
            )
        return counts

    def allocate(
        self, num_blocks: int | Sequence[int], device: torch.device | str, prefault: bool = False
    ) -> KVCaches:
        """The layer caches for num_blocks engine blocks (per table, or one count for all), zeroed:
        [blocks of g's table x sub_blocks(g), g.block_size, g.width] per layer of group g, a group's
        layers together, in the spec's group order.

        On huge pages (engine/hugepages.py huge_zeros): decode gathers blocks from all over the
        cache, and 4 KiB pages made every block a string of TLB misses (a 5x slower gather
        measured in a VM). Resident only where blocks have been written: the engine reuses the
        blocks freed last first when nothing is prefix-cached (block_pool.py), so a cache sized
        for 256 sequences of 512 tokens costs what the sequences running hold; or, prefault, all
        of it from the start (engine/hugepages.py populate: a server's cache)."""
        counts = self.table_blocks(num_blocks)
        caches = []
        for g in self.groups:
            shape = (counts[self.table_index(g.kind)] * self.sub_blocks(g), g.block_size, g.storage_width)
            nbytes = math.prod(shape) * g.storage_dtype.itemsize
            caches += [
                huge_zeros(nbytes, device, prefault).view(g.storage_dtype).view(shape) for _ in g.layers
            ]
        return KVCaches(self, caches)

    def check_caches(self, caches: list[torch.Tensor]) -> None:
        """The tensors are this spec's (after allocate, or caches handed in from outside): every
        group of a table has as many engine blocks as the table's first group."""
        if len(caches) != self.num_caches:
            raise ValueError(f"{len(caches)} caches, the spec has {self.num_caches} (group, layer) caches")
        counts = {}
        for slot, cache in enumerate(caches):
            g = self.group_at(slot)
            t = self.table_index(g.kind)
            if t not in counts:
                counts[t] = cache.shape[0] // self.sub_blocks(g) if cache.dim() else 0
            want = (counts[t] * self.sub_blocks(g), g.block_size, g.storage_width)
            if cache.dim() != 3 or cache.shape != want or cache.dtype != g.storage_dtype:
                layer = g.layers[slot - self.slot_start(g)]
                raise ValueError(
                    f"the {g.kind.value} cache of layer {layer} is {tuple(cache.shape)} {cache.dtype}, the spec "
                    f"says {list(want)} {g.storage_dtype} for {counts[t]} engine blocks"
                )


class KVCaches(list):
    """The engine's caches: a flat list in the spec's slot order (what transfers, offload and the
    codec walk), looked up by kind and model layer (what models and kernels ask for)."""

    def __init__(self, spec: KVCacheSpec, caches: list[torch.Tensor]):
        super().__init__(caches)
        self.spec = spec
        self._groups: dict[CacheKind, list[torch.Tensor]] = {}  # looked up every step: found once
        self._layers: dict[tuple[CacheKind, int], torch.Tensor] = {}
        for g in spec.groups:
            start = spec.slot_start(g)
            self._groups[g.kind] = caches[start : start + g.num_layers]
            self._layers.update(((g.kind, n), c) for n, c in zip(g.layers, self._groups[g.kind], strict=True))

    def layer(self, kind: CacheKind, layer: int) -> torch.Tensor:
        """Group `kind`'s cache of model layer `layer`."""
        if (kind, layer) not in self._layers:
            self.spec.slot(kind, layer)  # KeyError naming it
        return self._layers[kind, layer]

    def group(self, kind: CacheKind) -> list[torch.Tensor]:
        """Group `kind`'s caches, in the order of its layers (the caller's to read, not to change)."""
        if kind not in self._groups:
            self.spec.group(kind)  # KeyError naming it
        return self._groups[kind]


def _rope_offset(g: dict) -> int | None:
    """A described group's rope_offset: None where the rotary part ends the entry (the default)."""
    offset = int(g["rope_offset"])
    return None if offset == int(g["width"]) - int(g["rope_width"]) else offset


def _tokens_per_block(g: CacheGroupSpec) -> int:
    return g.block_size * g.tokens_per_entry


def model_fingerprint(model_dir: str | Path) -> str:
    """The model's config.json, canonicalised and hashed."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def mla_spec(
    *,
    num_layers: int,
    num_mtp_layers: int,
    block_size: int,
    kv_lora_rank: int,
    rope_dim: int,
    dtype: torch.dtype,
    fingerprint: str,
) -> KVCacheSpec:
    """DeepSeek-V2/V3: the model's latent cache, then the MTP layers' (when drafting)."""

    def group(kind: CacheKind, start: int, count: int) -> CacheGroupSpec:
        return CacheGroupSpec(
            kind=kind,
            layers=tuple(range(start, start + count)),
            block_size=block_size,
            width=kv_lora_rank + rope_dim,
            dtype=dtype,
            rope_width=rope_dim,
            rotary_layout=OUTPUT_LAYOUT if rope_dim else "none",
        )

    groups = [group(CacheKind.LATENT, 0, num_layers)]
    if num_mtp_layers:
        groups.append(group(CacheKind.MTP_LATENT, num_layers, num_mtp_layers))
    return KVCacheSpec(tuple(groups), fingerprint)
