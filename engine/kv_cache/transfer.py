"""The engine's side of KV transfers between engines: the only way the services read or write
cache tensors.

Who may touch the cache, stated once:
- the engine thread runs the model, which reads and writes every block a scheduled request holds;
- any thread may read the blocks of an export (`KVPort.read_exported`) between its
  `ExportTable.begin_read` and `end_read`: they are pinned, the engine writes them no more, and
  the export cannot end under a read, so the engine thread cannot free them meanwhile
  (engine/kv_cache/export.py);
- any thread may write an importing request's blocks, only through its `ImportSink`, between
  `allocate_import` (which opens the sink) and `finish_import` / `recompute_import` /
  `abort_request` (which close it on the engine thread before the blocks join the batch or are
  freed). Closing waits for a write in progress, and a write after the close is refused, so a
  transfer that is cancelled mid-write can never land in blocks that were freed and handed to
  another request.
"""

from __future__ import annotations

import threading

import torch

from engine.kv_cache.codec import Slab, read_slab, write_slab
from engine.kv_cache.export import Export
from engine.kv_cache.spec import KVCacheSpec


class ImportClosed(RuntimeError):
    """The import ended (finished, recomputed or aborted): its blocks are no longer writable."""


class ImportSink:
    """Writes a transfer's slabs into one importing request's blocks; slab block indices count
    from the start of the request's prompt blocks, as the producer's do."""

    def __init__(self, request_id: str, spec: KVCacheSpec, caches: list[torch.Tensor], block_ids: list[int]):
        self.request_id = request_id
        self.spec = spec
        self.num_blocks = len(block_ids)
        self._caches = caches
        self._block_ids = list(block_ids)
        self._lock = threading.Lock()
        self._open = True

    def write(self, slab: Slab, data: bytes) -> None:
        """Any thread. ImportClosed once the import ended; KVCodecError (nothing written) for a
        slab that does not fit the spec."""
        if not 0 <= slab.block_start < slab.block_start + slab.num_blocks <= self.num_blocks:
            raise ValueError(
                f"slab blocks [{slab.block_start}, +{slab.num_blocks}) outside [0, {self.num_blocks})"
            )
        ids = self._block_ids[slab.block_start : slab.block_start + slab.num_blocks]
        with self._lock:
            if not self._open:
                raise ImportClosed(f"the import of request {self.request_id!r} has ended")
            write_slab(self.spec, self._caches, ids, slab.layer_start, data)

    def close(self) -> None:
        """Engine thread: waits for a write in progress; later writes raise ImportClosed."""
        with self._lock:
            self._open = False

    @property
    def is_open(self) -> bool:
        return self._open


class KVPort:
    """What the services get instead of the cache tensors."""

    def __init__(self, spec: KVCacheSpec, caches: list[torch.Tensor]):
        spec.check_caches(caches)
        self.spec = spec
        self._caches = caches

    def read_exported(self, export: Export, slab: Slab) -> bytes:
        """Any thread, inside a read of the export: layers of one cache group x some of its
        pinned blocks (slab.block_start indexes the export's blocks)."""
        ids = export.block_ids[slab.block_start : slab.block_start + slab.num_blocks]
        return read_slab(self.spec, self._caches, ids, slab.layer_start, slab.num_layers)

    def sink(self, request_id: str, block_ids: list[int]) -> ImportSink:
        return ImportSink(request_id, self.spec, self._caches, block_ids)
