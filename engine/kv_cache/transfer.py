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
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engine.kv_cache.checksum import block_checksums
from engine.kv_cache.codec import Slab, read_slab, read_state, write_slab, write_state
from engine.kv_cache.export import Export
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.state import StatePool


def read_order(tables: Sequence[Sequence[int]], ranges: tuple[tuple[int, int], ...]) -> list[int]:
    """The blocks of each table's range (KVCacheSpec.transfer_ranges), table after table: the
    order in which a NIXL read, its handle and BeginRead name a transfer's blocks and checksums
    (for a spec of one table, its blocks from the first one read)."""
    return [b for table, (start, end) in zip(tables, ranges, strict=True) for b in table[start:end]]


def from_block(spec: KVCacheSpec, num_tokens: int, listed: Sequence, first_block: int) -> list:
    """What a list in read order from block 0 (a handle's block ids or checksums) names from
    first_block on, in read order."""
    out, offset = [], 0
    whole, rest = spec.transfer_ranges(num_tokens), spec.transfer_ranges(num_tokens, first_block)
    for (start, end), (first, _) in zip(whole, rest, strict=True):
        out += listed[offset + first - start : offset + end - start]
        offset += end - start
    return out


def read_bytes(spec: KVCacheSpec, ranges: tuple[tuple[int, int], ...]) -> int:
    """The bytes a transfer of these ranges moves (states not counted)."""
    return sum(
        (end - start) * spec.table_bytes_per_block(t)
        for t, (start, end) in zip(spec.tables, ranges, strict=True)
    )


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
    """Writes a transfer's slabs into one importing request's blocks, and its states into the
    request's state slot; slab block indices count from the start of the request's prompt blocks,
    as the producer's do, in every block table."""

    def __init__(
        self,
        request_id: str,
        spec: KVCacheSpec,
        caches: list[torch.Tensor],
        tables: list[list[int]],
        num_tokens: int,
        states: tuple[torch.Tensor, ...] = (),
    ):
        """tables: the request's prompt blocks per block table (a window table's null entries
        where nothing is written); num_tokens: the prompt's; states: views of the request's state
        slot, one per StateSpec."""
        if len(tables) != len(spec.tables) or len(states) != len(spec.states):
            raise ValueError(
                f"an import needs {len(spec.tables)} block tables and {len(spec.states)} states, "
                f"got {len(tables)} and {len(states)}"
            )
        self.request_id = request_id
        self.spec = spec
        self.num_blocks = len(tables[0])
        self.num_tokens = num_tokens
        self.ranges = spec.transfer_ranges(num_tokens)
        """Per table, the blocks a transfer may write (a window's last ones only)."""
        self._caches = caches
        self._tables = [list(t) for t in tables]
        self._states = states
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._open = True
        self._remote_writers = 0
        self._cancel = threading.Event()

    @property
    def tables(self) -> tuple[tuple[int, ...], ...]:
        """The importing request's prompt blocks per table (a window's null where none is written)."""
        return tuple(tuple(t) for t in self._tables)

    def ranges_from(self, first_block: int) -> tuple[tuple[int, int], ...]:
        """Per table, the blocks a transfer from first_block on writes."""
        return self.spec.transfer_ranges(self.num_tokens, first_block)

    def write(self, slab: Slab, data: bytes) -> None:
        """Any thread. ImportClosed once the import ended; KVCodecError (nothing written) for a
        slab that does not fit the spec; ValueError for blocks outside what its table takes."""
        t = self.spec.table_index(self.spec.group_at(slab.layer_start).kind)
        start, end = self.ranges[t]
        if not start <= slab.block_start < slab.block_start + slab.num_blocks <= end:
            raise ValueError(
                f"slab blocks [{slab.block_start}, +{slab.num_blocks}) outside [{start}, {end}) of block table {t}"
            )
        ids = self._tables[t][slab.block_start : slab.block_start + slab.num_blocks]
        with self._lock:
            if not self._open:
                raise ImportClosed(f"the import of request {self.request_id!r} has ended")
            write_slab(self.spec, self._caches, ids, slab.layer_start, data)

    def write_state(self, index: int, data: bytes) -> None:
        """Any thread: the request's state `index` (codec.read_state's bytes). ImportClosed once the
        import ended; KVCodecError (nothing written) when they are not its size."""
        with self._lock:
            if not self._open:
                raise ImportClosed(f"the import of request {self.request_id!r} has ended")
            write_state(self.spec, index, self._states[index], data)

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

    def checksums(self, first_block: int) -> list[int]:
        """Any thread, inside a remote_write slot: the checksums of the blocks a transfer from
        first_block on writes, in read order (engine/kv_cache/checksum.py)."""
        return table_checksums(self.spec, self._caches, self._tables, self.ranges_from(first_block))

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


def table_checksums(
    spec: KVCacheSpec,
    caches: list[torch.Tensor],
    tables: Sequence[Sequence[int]],
    ranges: tuple[tuple[int, int], ...],
) -> list[int]:
    """The checksums of each table's blocks in its range, in read order."""
    return [
        c
        for t, (table, (start, end)) in enumerate(zip(tables, ranges, strict=True))
        for c in block_checksums(spec, caches, list(table[start:end]), t)
    ]


class KVPort:
    """What the services get instead of the cache tensors."""

    def __init__(self, spec: KVCacheSpec, caches: list[torch.Tensor], states: StatePool | None = None):
        """states: the engine's per-request state pool (where the spec has states)."""
        spec.check_caches(caches)
        if bool(spec.states) != (states is not None):
            raise ValueError(
                f"the spec has {len(spec.states)} per-request states: a state pool goes with them"
            )
        self.spec = spec
        self._caches = caches
        self._states = states

    def read_exported(self, export: Export, slab: Slab) -> bytes:
        """Any thread, inside a read of the export: layers of one cache group x some of its
        pinned blocks (slab.block_start indexes the prompt's blocks, in the group's table)."""
        t = self.spec.table_index(self.spec.group_at(slab.layer_start).kind)
        ids = export.tables[t][slab.block_start : slab.block_start + slab.num_blocks]
        return read_slab(self.spec, self._caches, ids, slab.layer_start, slab.num_layers)

    def read_exported_state(self, export: Export, index: int) -> bytes:
        """Any thread, inside a read of the export: its request's state `index` after the prompt
        (the slot stays the request's while the export holds its blocks)."""
        return read_state(export.states[index])

    def request_states(self, request_id: str) -> tuple[torch.Tensor, ...]:
        """Engine thread: views of a request's state slot, one per StateSpec (none without states)."""
        return self._states.views(request_id) if self._states is not None else ()

    def exported_blocks(self, export: Export, first_block: int = 0) -> list[int]:
        """The export's blocks a transfer from first_block on reads, in read order (`read_order`)."""
        return read_order(export.tables, self.spec.transfer_ranges(export.num_tokens, first_block))

    def checksum_exported(self, export: Export, first_block: int = 0) -> list[int]:
        """Any thread, inside a read of the export: the checksums of `exported_blocks`, in their order."""
        ranges = self.spec.transfer_ranges(export.num_tokens, first_block)
        return table_checksums(self.spec, self._caches, export.tables, ranges)

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
        """Engine blocks the first table's caches hold."""
        return self.table_blocks[0]

    @property
    def table_blocks(self) -> tuple[int, ...]:
        """Engine blocks each table's caches hold."""
        out = []
        for t in self.spec.tables:
            g = t.groups[0]
            out.append(self._caches[self.spec.slot_start(g)].shape[0] // self.spec.sub_blocks(g))
        return tuple(out)

    def sink(self, request_id: str, tables: list[list[int]], num_tokens: int | None = None) -> ImportSink:
        """Engine thread: where a transfer writes an importing request's prompt KV (tables: its
        prompt blocks per table; num_tokens: the prompt's, default every block full) and its
        states."""
        if num_tokens is None:
            num_tokens = len(tables[0]) * self.spec.block_size
        return ImportSink(
            request_id, self.spec, self._caches, tables, num_tokens, self.request_states(request_id)
        )
