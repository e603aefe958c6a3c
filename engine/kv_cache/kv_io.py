"""Reading and writing whole KV blocks as raw bytes, for moving a request's cache between engines.

A slab is layers [layer_start, layer_start + L) x the given blocks of the paged caches, laid out
as [L, nb, block_size, width] row-major in the cache dtype, little-endian. Bytes only: nothing is
pickled, so bytes from the network can at worst be wrong numbers, never code.
"""

from __future__ import annotations

import sys

import torch

assert sys.byteorder == "little", "the KV wire format is little-endian"


def read_blocks(caches: list[torch.Tensor], block_ids: list[int], layer_start: int, num_layers: int) -> bytes:
    """Copy out the slab [num_layers, len(block_ids), block_size, width] as bytes."""
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    slab = torch.stack(
        [caches[layer].index_select(0, index) for layer in range(layer_start, layer_start + num_layers)]
    )
    return slab.cpu().contiguous().view(torch.uint8).numpy().tobytes()


def write_blocks(caches: list[torch.Tensor], block_ids: list[int], layer_start: int, data: bytes) -> None:
    """Write a slab produced by read_blocks (same dtype and geometry) into the given blocks."""
    _, block_size, width = caches[0].shape
    per_layer = len(block_ids) * block_size * width * caches[0].element_size()
    if not block_ids or len(data) % per_layer:
        raise ValueError(
            f"KV slab has {len(data)} bytes, not a whole number of layers of {len(block_ids)} blocks"
        )
    num_layers = len(data) // per_layer
    if layer_start < 0 or layer_start + num_layers > len(caches):
        raise ValueError(
            f"KV slab layers [{layer_start}, {layer_start + num_layers}) outside [0, {len(caches)})"
        )
    slab = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(caches[0].dtype)
    slab = slab.view(num_layers, len(block_ids), block_size, width)
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0].device)
    for i in range(num_layers):
        caches[layer_start + i].index_copy_(0, index, slab[i].to(caches[0].device))
