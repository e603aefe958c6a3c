"""One cache of the paged KV cache, described: a cache group (a kind of cache on a set of the
model's layers, with one geometry) and a per-request state. engine/kv_cache/spec.py puts them
together into the KVCacheSpec.

A cache group is one kind of cache (CacheKind) on a set of the model's layers, any set, whose
caches share one geometry: `block_size` entries per block, `width` elements per entry, one dtype
and one element layout. Two groups may name the same layers (a V3.2 layer holds a latent cache and
an indexer-key cache); a spec has one group of each kind.

For DeepSeek-V2/V3 an entry is one token's MLA latent row, `c_kv` (kv_lora_rank) then the rotary
key `k_pe` (qk_rope_head_dim), and there are at most two groups: the model's layers 0 .. L - 1,
and the MTP layer's, numbered after them as the checkpoint numbers it (layer L). The kinds
for the later models are DeepSeek-V3.2's indexer keys, DeepSeek-V4's sliding-window and compressed
caches (CSA entries and their indexer keys, HCA entries), and its compressor states (StateSpec),
with where an entry's rotary part sits (`rope_offset`) and, for FP8 entries, their per-entry
float32 scale (`scale`: V3.2's 132-byte indexer key); the engine refuses a spec it cannot run yet
(`KVCacheSpec.check_runnable`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

import torch

DTYPE_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float8_e4m3fn: "float8_e4m3fn",
}
"""The cache dtypes a spec may name (FP8 only with a scale per entry)."""

SCALES = ("none", "float32_per_entry")
"""How an entry's values are scaled: "none", or "float32_per_entry": the entry stores its width
FP8 (e4m3) values, then one float32 scale they are multiplied by (DeepSeek-V3.2's reference keeps
its indexer keys so: 128 + 4 = 132 bytes)."""

ROTARY_LAYOUTS = ("none", "halves", "interleaved")
"""How an entry's rotary part orders its rotated pairs (x_a, x_b): "halves" stores every first
member, then every second member; "interleaved" stores each pair side by side; "none": no rotary
part."""


class CacheKind(StrEnum):
    LATENT = "latent"
    """MLA: one token's [c_kv | k_pe] per entry, attended in full."""
    MTP_LATENT = "mtp_latent"
    """The same rows, for the MTP layers that draft speculative tokens."""
    INDEXER_KEYS = "indexer_keys"
    """DeepSeek-V3.2: the lightning indexer's key per token, on the latent cache's layers."""
    SLIDING_WINDOW = "sliding_window"
    """DeepSeek-V4: K = V rows kept only for the last window of tokens."""
    COMPRESSED = "compressed"
    """DeepSeek-V4's CSA layers: one entry summarises `tokens_per_entry` (4) tokens."""
    COMPRESSED_INDEXER_KEYS = "compressed_indexer_keys"
    """DeepSeek-V4's CSA layers: the lightning indexer's key per compressed entry."""
    HEAVILY_COMPRESSED = "heavily_compressed"
    """DeepSeek-V4's HCA layers: one entry per `tokens_per_entry` (128) tokens."""


FULL_KINDS = frozenset({CacheKind.LATENT, CacheKind.MTP_LATENT, CacheKind.INDEXER_KEYS})
"""Kinds attended over a request's whole history: they live alike and share one block table."""


@dataclass(frozen=True)
class CacheGroupSpec:
    kind: CacheKind
    layers: tuple[int, ...]
    """The model layers that hold this cache (strictly ascending, any set)."""
    block_size: int
    """Entries per block: tokens, or compressed entries for a COMPRESSED group."""
    width: int
    """Elements per entry."""
    dtype: torch.dtype
    rope_width: int = 0
    """Elements of the entry that are a rotary key."""
    rotary_layout: str = "none"
    tokens_per_entry: int = 1
    rope_offset: int | None = None
    """Where the rotary part starts in the entry; None: at its end (MLA's [c_kv | k_pe]; V3.2's
    indexer key ropes its leading elements: 0)."""
    scale: str = "none"
    """One of SCALES."""
    window: int = 0
    """SLIDING_WINDOW only (and required there): the tokens a query sees, itself included."""

    def __post_init__(self) -> None:
        if (self.window > 0) != (self.kind == CacheKind.SLIDING_WINDOW) or self.window < 0:
            raise ValueError(
                f"a {self.kind.value} group with window {self.window}: sliding-window groups, and only "
                "they, name a window >= 1"
            )
        if not self.layers or any(b <= a for a, b in zip(self.layers, self.layers[1:], strict=False)):
            raise ValueError(
                f"a cache group's layers must be non-empty and strictly ascending, got {self.layers}"
            )
        if self.layers[0] < 0:
            raise ValueError(f"cache group layers must be >= 0, got {self.layers}")
        for name in ("block_size", "width", "tokens_per_entry"):
            if getattr(self, name) < 1:
                raise ValueError(f"cache group {name} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(
                f"cache group dtype must be one of {sorted(DTYPE_NAMES.values())}, got {self.dtype}"
            )
        if self.rotary_layout not in ROTARY_LAYOUTS:
            raise ValueError(f"rotary_layout must be one of {ROTARY_LAYOUTS}, got {self.rotary_layout!r}")
        if not 0 <= self.rope_width <= self.width or (self.rope_width > 0) != (self.rotary_layout != "none"):
            raise ValueError(
                f"rope_width {self.rope_width} with rotary_layout {self.rotary_layout!r}: a group has a "
                f"rotary part of width in (0, {self.width}] exactly when it names its layout"
            )
        if self.rope_offset is not None and not (
            self.rope_width > 0 and 0 <= self.rope_offset <= self.width - self.rope_width
        ):
            raise ValueError(
                f"rope_offset {self.rope_offset}: a rotary part of width {self.rope_width} starts in "
                f"[0, {self.width - self.rope_width}] of the {self.width}-element entry"
            )
        if self.scale not in SCALES:
            raise ValueError(f"scale must be one of {SCALES}, got {self.scale!r}")
        if (self.scale != "none") != (self.dtype == torch.float8_e4m3fn):
            raise ValueError(
                f"dtype {DTYPE_NAMES[self.dtype]} with scale {self.scale!r}: FP8 entries, and only they, "
                "carry a float32 scale (scale='float32_per_entry')"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def rope_start(self) -> int:
        """The first element of the rotary part (the entry's width where it has none)."""
        return self.width - self.rope_width if self.rope_offset is None else self.rope_offset

    @property
    def entry_bytes(self) -> int:
        """One entry as stored: its elements, and its scale where it has one."""
        return self.width * self.dtype.itemsize + (4 if self.scale != "none" else 0)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The cache tensor's dtype: the elements', or bytes where an entry carries its scale."""
        return torch.uint8 if self.scale != "none" else self.dtype

    @property
    def storage_width(self) -> int:
        """The cache tensor's last dimension, in storage_dtype units."""
        return self.entry_bytes if self.scale != "none" else self.width

    @property
    def block_bytes(self) -> int:
        """One block of one layer."""
        return self.block_size * self.entry_bytes

    def describe(self) -> dict:
        """Every field as plain JSON values (the compatibility hash and the wire carry this)."""
        return {
            "kind": self.kind.value,
            "layers": list(self.layers),
            "block_size": self.block_size,
            "width": self.width,
            "dtype": DTYPE_NAMES[self.dtype],
            "rope_width": self.rope_width,
            "rotary_layout": self.rotary_layout,
            "tokens_per_entry": self.tokens_per_entry,
            "rope_offset": self.rope_start,
            "scale": self.scale,
            **({"window": self.window} if self.window else {}),
        }


@dataclass(frozen=True)
class StateSpec:
    """A per-request state, not per token (DeepSeek-V4's compressor state): one tensor of `shape`
    per layer, overwritten as the request runs. Kept in slots (engine/kv_cache/state.py), one per
    running request, with snapshots at block boundaries for prefix hits."""

    name: str
    layers: tuple[int, ...]
    shape: tuple[int, ...]
    """One layer's state of one request."""
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not self.name or not self.layers or not self.shape or min(self.shape) < 1:
            raise ValueError(
                f"state {self.name!r}: needs a name, layers and a shape of sizes >= 1, got "
                f"layers {self.layers}, shape {self.shape}"
            )
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"state dtype must be one of {sorted(DTYPE_NAMES.values())}, got {self.dtype}")

    @property
    def slot_bytes(self) -> int:
        """One request's state over every layer."""
        return len(self.layers) * math.prod(self.shape) * self.dtype.itemsize

    def describe(self) -> dict:
        return {
            "name": self.name,
            "layers": list(self.layers),
            "shape": list(self.shape),
            "dtype": DTYPE_NAMES[self.dtype],
        }


def dtype_named(name: str) -> torch.dtype:
    for dtype, n in DTYPE_NAMES.items():
        if n == name:
            return dtype
    raise ValueError(f"cache group dtype must be one of {sorted(DTYPE_NAMES.values())}, got {name!r}")
