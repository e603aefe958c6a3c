"""The KV blocks' checksums (engine/kv_cache/checksum.py) against the `crc32c` package from PyPI:
the C code built here and the package's fallback give the standard CRC-32C of each block's rows,
layer after layer, over a spec of two cache groups with different block sizes; on one thread or
several; and a flipped byte changes exactly its block's checksum."""

from __future__ import annotations

import random

import crc32c as reference
import pytest
import torch

from engine.kv_cache import checksum
from tests.test_kv_hybrid import NUM_BLOCKS, SPEC, _filled


def _expected(caches: list[torch.Tensor], block_id: int) -> int:
    """The reference: the package's CRC-32C of the block's rows of every layer, concatenated."""
    data = b"".join(
        cache[SPEC.group_block_ids(SPEC.group_at(layer), [block_id])]
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for layer, cache in enumerate(caches)
    )
    return reference.crc32c(data)


@pytest.fixture(params=["c", "package"])
def implementation(request, monkeypatch):
    if request.param == "c":
        assert checksum.load(), "crc32c.c did not build: a C compiler is part of the test machine"
    else:
        monkeypatch.setattr(checksum, "_library", lambda: None)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
def test_block_checksums_are_the_crc32c_of_each_blocks_rows(implementation, threads, monkeypatch):
    caches = _filled(seed=11)
    ids = [6, 1, 7, 3, 0, 2, 5]  # seven: four side by side, then three one at a time
    monkeypatch.setattr(checksum, "PARALLEL_BYTES", 0)
    torch.set_num_threads(threads)
    try:
        got = checksum.block_checksums(SPEC, caches, ids)
    finally:
        torch.set_num_threads(2)
    assert got == [_expected(caches, b) for b in ids]
    assert checksum.block_checksums(SPEC, caches, []) == []


def test_a_flipped_byte_changes_its_blocks_checksum_only(implementation):
    caches = _filled(seed=12)
    ids = list(range(NUM_BLOCKS))
    before = checksum.block_checksums(SPEC, caches, ids)
    layer = len(caches) - 1  # the second group's last layer
    rows = SPEC.group_block_ids(SPEC.group_at(layer), [5])
    caches[layer][rows[-1]].view(torch.uint8)[-1] ^= 0x10
    after = checksum.block_checksums(SPEC, caches, ids)
    assert [i for i in ids if before[i] != after[i]] == [5]


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 63, 4097])
def test_crc32c_of_bytes_and_its_continuation_match_the_package(implementation, length):
    data = random.Random(length).randbytes(length)
    assert checksum.crc32c(data) == reference.crc32c(data)
    half = length // 2
    assert checksum.crc32c(data[half:], checksum.crc32c(data[:half])) == reference.crc32c(data)
