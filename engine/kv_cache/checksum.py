"""Per-block checksums of the KV cache: what a one-sided read (NIXL) is verified against end to end.

A block's checksum is the CRC-32C of its rows in every layer cache, in layer order (the block's
bytes as stored, one contiguous run per layer). The producer takes them when it issues a handle;
the consumer takes them again over the blocks it read and compares.

Two implementations give the same values:
- crc32c.c, built when the package is installed (kernels/native/build.py; in a development
  checkout whose source changed, with the C compiler at first use), called through ctypes without
  the GIL: four blocks side by side through the CRC32
  instruction, on the engine's threads. 19 MB (a 2k-token prompt of the bench model) takes
  ~1 ms on two cores, against 3.4 ms for the xxh3-64 it replaced (one core: python's xxhash
  holds the GIL).
- the `crc32c` package from PyPI, a block at a time, where the library is missing and cannot be
  built; it is also the reference the tests hold the C code to.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import subprocess
from pathlib import Path

import crc32c as _crc32c
import numpy as np
import torch

from engine import env
from engine.kv_cache.spec import KVCacheSpec
from kernels.native import build

logger = logging.getLogger(__name__)

PARALLEL_BYTES = 1 << 20
"""Blocks worth more than this are checked on every engine thread."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    """crc32c.c's library (prebuilt, or built into the native build folder), or None (with a
    warning) when it is missing and cannot be built: the PyPI package then computes the same
    values."""
    try:
        lib = ctypes.CDLL(
            str(build.find_or_build(build.CRC32C, Path(env.native_build_dir()), "KV checksums"))
        )
    except (OSError, subprocess.SubprocessError) as e:
        detail = e.stderr.decode(errors="replace") if isinstance(e, subprocess.CalledProcessError) else str(e)
        logger.warning(
            "KV checksums: crc32c.c not built (%s); using the crc32c package", detail.strip()[:200]
        )
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pdserve_crc32c_blocks.argtypes = [p, i64, i64, p, p, p, ctypes.c_int]
    lib.pdserve_crc32c_blocks.restype = None
    lib.pdserve_crc32c.argtypes = [ctypes.c_uint32, p, ctypes.c_size_t]
    lib.pdserve_crc32c.restype = ctypes.c_uint32
    return lib


def load() -> bool:
    """Build and load the C checksums now (a worker does this at start, not on its first read);
    True when they are in use."""
    return _library() is not None


def crc32c(data: bytes | memoryview | np.ndarray, value: int = 0) -> int:
    """CRC-32C of data, continuing from value (the crc32c package's call)."""
    lib = _library()
    if lib is None:
        return _crc32c.crc32c(data, value)
    buf = (
        np.frombuffer(data, dtype=np.uint8)
        if not isinstance(data, np.ndarray)
        else data.reshape(-1).view(np.uint8)
    )
    return lib.pdserve_crc32c(value, buf.ctypes.data, buf.nbytes)


def block_checksums(
    spec: KVCacheSpec, caches: list[torch.Tensor], block_ids: list[int], table: int = 0
) -> list[int]:
    """The checksum of each engine block in block_ids of block table `table` (the only one of a
    V2/V3 spec), over every layer of its groups (see the module docstring). Host caches are read
    in place; a GPU cache's rows are gathered to the host first, one copy per layer."""
    if not block_ids:
        return []
    bases, lens, keep = [], [], []
    ids = np.asarray(block_ids, dtype=np.int64)
    on_gpu = caches[0].is_cuda
    for g in spec.tables[table].groups:
        k = spec.sub_blocks(g)
        for layer in range(spec.slot_start(g), spec.slot_start(g) + g.num_layers):
            cache = caches[layer]  # [rows, block_size, width]; an engine block is k rows in a run
            if on_gpu:
                index = torch.tensor(
                    spec.group_block_ids(g, block_ids), dtype=torch.long, device=cache.device
                )
                rows = cache.index_select(0, index).cpu().view(len(block_ids), -1)
                keep.append(rows)
                bases.append(rows.data_ptr())
                lens.append(rows.shape[1] * rows.element_size())
            else:
                bases.append(cache.data_ptr())
                lens.append(k * cache[0].numel() * cache.element_size())
    if on_gpu:
        ids = np.arange(len(block_ids), dtype=np.int64)  # the gathered rows, in order
    lib = _library()
    if lib is None:
        return [_block_crc(bases, lens, int(b)) for b in ids]
    out = np.empty(len(ids), dtype=np.uint32)
    threads = torch.get_num_threads() if sum(lens) * len(ids) > PARALLEL_BYTES else 1
    base_arr, len_arr = np.asarray(bases, dtype=np.uint64), np.asarray(lens, dtype=np.uint64)
    lib.pdserve_crc32c_blocks(
        ids.ctypes.data,
        len(ids),
        len(bases),
        base_arr.ctypes.data,
        len_arr.ctypes.data,
        out.ctypes.data,
        threads,
    )
    return out.tolist()


def _block_crc(bases: list[int], lens: list[int], block: int) -> int:
    crc = 0
    for base, n in zip(bases, lens, strict=True):
        crc = _crc32c.crc32c((ctypes.c_char * n).from_address(base + block * n), crc)
    return crc
