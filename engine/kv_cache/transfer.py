"""The engine's side of KV transfers between engines: the only way the services read or write
cache tensors.

Who may touch the cache, stated once:
- the engine thread runs the model, which reads and writes every block a scheduled request holds;
- any thread may read the blocks of an export (`KVPort.read_exported`) between its
  `ExportTable.begin_read` and `end_read`: they are pinned, the engine writes them no more, and
  the export cannot end under a read, so the engine thread cannot free them meanwhile
  (engine/kv_cache/export.py);
- any thread may write an importing request's blocks, only through its `ImportSink`, between
  `KVHandover.allocate_import` (which opens the sink) and `finish_import` / `recompute_import` /
  `EngineCore.abort_request` (which close it on the engine thread before the blocks join the batch or are
  freed). Closing waits for a write in progress, and a write after the close is refused, so a
  transfer that is cancelled mid-write can never land in blocks that were freed and handed to
  another request;
- a one-sided read (NIXL, engine/kv_cache/nixl.py) writes an importing request's blocks from the
  network card or the transport's threads, not from Python: it may be posted only inside the
  sink's `remote_write` slot, which the import's close cancels and then waits for -- the read's
  transfer handle is released (or has finished) before close returns, so no READ lands in blocks
  after the import was closed;
- the memory a NIXL agent registers is the cache tensors' (`KVPort.memory_regions`): a peer that
  holds the agent's metadata can read all of it, which is why the metadata is handed only to
  authenticated callers (services/worker/service.py GetEngineInfo).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.kv_cache.checksum import block_checksums
from engine.kv_cache.codec import Slab, read_slab, write_slab
from engine.kv_cache.export import Export
from engine.kv_cache.spec import KVCacheSpec


class ImportClosed(RuntimeError):
    """The import ended (finished, recomputed or aborted): its blocks are no longer writable."""


@dataclass(frozen=True)
class MemoryRegion:
    """One layer cache's memory: what a NIXL agent registers and a reader addresses."""

    addr: int
    length: int
    """Bytes: the layer's rows for every engine block."""
    device: int
    """CUDA device index; 0 for host memory."""


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
        self._idle = threading.Condition(self._lock)
        self._open = True
        self._remote_writers = 0
        self._cancel = threading.Event()

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The importing request's prompt blocks (engine block ids), in order."""
        return tuple(self._block_ids)

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

    @contextmanager
    def remote_write(self) -> Iterator[threading.Event]:
        """Any thread: a slot for a one-sided read into the blocks (NIXL). Yields an event that
        close() sets: the holder must then cancel its transfer and leave the slot only once the
        transfer can no longer write (its handle released, or finished). ImportClosed if the
        import already ended."""
        with self._lock:
            if not self._open:
                raise ImportClosed(f"the import of request {self.request_id!r} has ended")
            self._remote_writers += 1
        try:
            yield self._cancel
        finally:
            with self._lock:
                self._remote_writers -= 1
                self._idle.notify_all()

    def checksums(self, first_block: int, end: int | None = None) -> list[int]:
        """Any thread, inside a remote_write slot: the checksums of blocks [first_block,
        end or num_blocks) (engine/kv_cache/checksum.py)."""
        return block_checksums(self.spec, self._caches, self._block_ids[first_block:end])

    def close(self, wait: bool = True) -> bool:
        """Engine thread: later writes raise ImportClosed; a write in progress is waited for and a
        remote write is cancelled. wait: also wait until the remote write can no longer land;
        without it (an abort, which must not stall the engine thread on a peer) the caller keeps
        the blocks until `idle`. Returns whether the blocks are free of writers now."""
        with self._lock:
            self._open = False
            self._cancel.set()
            while wait and self._remote_writers:
                self._idle.wait()
            return not self._remote_writers

    @property
    def idle(self) -> bool:
        """No remote write is in its slot (after close: none can land any more)."""
        return not self._remote_writers

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

    def checksum_exported(self, export: Export, first_block: int = 0) -> list[int]:
        """Any thread, inside a read of the export: the checksums of its blocks [first_block, end)."""
        return block_checksums(self.spec, self._caches, export.block_ids[first_block:])

    def memory_regions(self) -> list[MemoryRegion]:
        """Every layer cache's memory, in layer order (registered once with a NIXL agent; the
        tensors live as long as the engine)."""
        return [
            MemoryRegion(c.data_ptr(), c.numel() * c.element_size(), max(c.get_device(), 0))
            for c in self._caches
        ]

    @property
    def on_gpu(self) -> bool:
        return self._caches[0].is_cuda

    @property
    def num_blocks(self) -> int:
        """Engine blocks the caches hold."""
        g = self.spec.groups[0]
        return self._caches[self.spec.slot_start(g)].shape[0] // self.spec.sub_blocks(g)

    def sink(self, request_id: str, block_ids: list[int]) -> ImportSink:
        return ImportSink(request_id, self.spec, self._caches, block_ids)
