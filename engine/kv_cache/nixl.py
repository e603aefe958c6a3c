"""NIXL as the KV data plane: a consumer READs a producer's exported blocks straight from the
producer's registered cache memory into its own blocks (UCX underneath: a CMA copy on one
host, RDMA or TCP across nodes), instead of the gRPC chunk stream's copies.

    producer worker                                   consumer worker
    NixlAgent: every layer cache registered once      NixlAgent: every layer cache registered once
    metadata + regions --(GetEngineInfo, authenticated)--> add_peer
    export (pinned, lease) <--(KvTransfer.BeginRead)-- block ids, per-block checksums
    registered memory ======== one-sided NIXL READ ========> the import sink's blocks
                       <--(KvTransfer.Release done|abort)-- the read and the export end

Geometry. A layer's cache is [rows, block_size, width] contiguous, one region per layer; engine
block b of group g is rows `spec.group_block_ids(g, [b])` -- `sub_blocks(g)` consecutive rows,
one contiguous run of `spec.layer_bytes_per_block(g)` bytes. A transfer is one descriptor per
(layer, run of blocks) on each side, paired row by row, so groups of any block size move
together: the (local, remote) block pairs, sorted by local block, are cut into runs that go on
block after block on both sides (`descriptors`, runs of <= MAX_DESC_BYTES per layer). Sorting
matters: a request's blocks are freed tail first, so the next one often gets them in descending
order, which merges only once sorted.
A hybrid spec's block tables (engine/kv_cache/spec.py `tables`) are paired table by table: the
handle and BeginRead name the blocks in read order (transfer.py `read_order`: each table's blocks
a transfer moves, a sliding window's only those the next token reads, table after table), and
each group's descriptors come from its own table's pairs. Per-request states live outside the
registered caches: the reader pulls them over gRPC afterwards (services/kv_transfer/nixl_pull.py).
The consumer builds both sides itself: its own addresses from its import sink's blocks, the
producer's from the producer's regions (checked against the spec and each table's block count
when the peer is added) and the block ids the producer handed out (checked against its table's
count). Nothing is
pickled: metadata is NIXL's own byte string, everything else protobuf integers.

Threads. The worker owns its agent (the engine thread owns nothing new). `read` blocks: run it
off the engine thread and the event loop. It writes only inside the import sink's `remote_write`
slot (engine/kv_cache/transfer.py): when the import closes, or the caller cancels, or the
deadline passes, every transfer handle is released -- NIXL cancels a transfer in flight, and
one it cannot cancel is waited out first -- before the slot is left, so no READ lands in blocks
the import no longer owns. An end-to-end checksum (CRC-32C per block, engine/kv_cache/checksum.py)
computed by the producer when it issued the handle is verified on the consumer's blocks before
they join the batch.

One host. UCX reads another process's memory on the same host with CMA (process_vm_readv; TCP
carries only its wire-up), which copies inside the post, on the reading thread, so a read costs
that copy plus the checksums over the same bytes; splitting it into pieces, on one thread or on
two, was no faster here (2 cores). Across hosts (RDMA or TCP) the post returns at once and the
read polls for completion every POLL_S.

Progress. The Python wrapper of NIXL fixes the progress thread's delay at 0, a busy spin that
took ~65 % of a core per idle worker here; UCX over TCP needs target-side progress for a READ,
so the agent is built from NIXL's bindings with the progress thread on and a delay of
PROGRESS_DELAY_US (idle cost ~2 % of a core).

Security. A peer that holds an agent's metadata can READ all of that agent's registered memory
-- the whole KV cache of that worker (every request's prompt KV in it, not only the blocks of
the transfer it was handed) -- for as long as the worker runs; it cannot write it (nothing asks
for remote writes, but registration does not forbid them on every transport: treat the metadata
as a credential). The worker hands it out only in GetEngineInfo, to callers that passed the
internal token / mutual TLS (services/common/security.py), the same gate as every internal RPC.
Deregistering does not revoke it on every transport: over UCX's TCP transport a READ of memory
that was deregistered still succeeded here (close() is cleanup, not a revocation); only the
worker's process ending, or a new agent (a restart: new name, new keys), takes the access away.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from engine.kv_cache import checksum
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import ImportClosed, ImportSink, KVPort, MemoryRegion, read_bytes

logger = logging.getLogger(__name__)

_BINDINGS = ("nixl_cu12._bindings", "nixl._bindings", "nixl_cu13._bindings")
"""Where NIXL's bindings live, by wheel (nixl-cu12 is the one pinned)."""
PROGRESS_DELAY_US = 100
READER_PROGRESS_DELAY_US = 2000
"""The progress thread's delay in an agent whose memory no peer reads (a decode worker): its own
reads progress in their polling, so its thread only tidies up (a transfer given up mid-way).
Each wake-up takes a core from the engine beside it for a moment: at 100 µs, an idle stack's two
agents (20,000 wake-ups a second) slowed an offline engine on the same two cores by 7%, and a
served decode worker's steps by ~1.5% (benchmarks/served_vs_offline.py --interleave)."""
POLL_S = 0.0002
"""Between transfer status checks."""
MAX_METADATA_BYTES = 1 << 20
MAX_AGENT_NAME_CHARS = 128
MAX_PEERS = 64
"""Remote agents loaded at once; the least recently used is dropped first."""
MEM_TYPES = ("DRAM", "VRAM")
MAX_DESC_BYTES = 2 << 20
"""Longest descriptor a transfer is merged into: one per (layer, 18 KiB block) read ~30 % slower
here than 0.5-2 MiB pieces, and one per layer no faster."""
GATE_POLL_S = 0.01


class NixlError(RuntimeError):
    """A NIXL transfer could not be posted or failed (the message says which)."""


class NixlTimeout(NixlError):
    """The transfer did not finish by its deadline (it was cancelled)."""


class NixlCancelled(NixlError):
    """The caller cancelled the transfer."""


class ChecksumMismatch(NixlError):
    """A block read does not hash to what the producer computed when it issued the handle."""


def bindings() -> ModuleType | None:
    """NIXL's bindings, or None when no NIXL wheel is installed (`pip install 'pdserve[nixl]'`)."""
    for name in _BINDINGS:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def available() -> bool:
    return bindings() is not None


@dataclass(frozen=True)
class PeerAgent:
    """A producer's agent as this agent knows it, its regions checked against our spec."""

    name: str
    regions: tuple[MemoryRegion, ...]
    table_blocks: tuple[int, ...]
    """Engine blocks of each of its block tables."""
    mem_type: str

    @property
    def num_blocks(self) -> int:
        return self.table_blocks[0]


def check_peer(
    spec: KVCacheSpec,
    name: str,
    metadata: bytes,
    regions: list[MemoryRegion],
    num_blocks: int | Sequence[int],
    mem_type: str,
) -> PeerAgent:
    """A peer's advertised agent against our spec (the peer's compat hash equals ours, so its
    geometry must too): ValueError naming the field and the limit. num_blocks: per block table
    (one count for a spec of one)."""
    if not name or len(name) > MAX_AGENT_NAME_CHARS:
        raise ValueError(f"nixl.agent_name must be 1 to {MAX_AGENT_NAME_CHARS} characters, got {len(name)}")
    if not 0 < len(metadata) <= MAX_METADATA_BYTES:
        raise ValueError(f"nixl.metadata must be 1 to {MAX_METADATA_BYTES} bytes, got {len(metadata)}")
    if mem_type not in MEM_TYPES:
        raise ValueError(f"nixl.mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
    counts = (num_blocks,) * len(spec.tables) if isinstance(num_blocks, int) else tuple(num_blocks)
    if len(counts) != len(spec.tables):
        raise ValueError(
            f"nixl.table_blocks has {len(counts)} counts, the KV cache spec has {len(spec.tables)} tables"
        )
    for n in counts:
        if not 0 < n < 2**31:
            raise ValueError(f"nixl.num_blocks must be in (0, 2^31), got {n}")
    if len(regions) != spec.num_caches:
        raise ValueError(
            f"nixl.regions has {len(regions)} entries, the KV cache spec has {spec.num_caches} caches"
        )
    for layer, r in enumerate(regions):
        g = spec.group_at(layer)
        n = counts[spec.table_index(g.kind)]
        want = n * spec.layer_bytes_per_block(g)
        if r.length != want:
            raise ValueError(
                f"nixl.regions[{layer}].length is {r.length}, {n} blocks of this spec are {want} bytes"
            )
        if not 0 < r.addr < 2**64 - r.length:
            raise ValueError(f"nixl.regions[{layer}].addr {r.addr:#x} leaves no room for {r.length} bytes")
    return PeerAgent(name, tuple(regions), counts, mem_type)


def block_runs(local_ids: list[int], remote_ids: list[int]) -> np.ndarray:
    """Pair i is (local_ids[i], remote_ids[i]); sorted by local block, the pairs are cut into runs
    that go on block after block on both sides -> int64 [R, 3]: (first local block, first remote
    block, blocks). The order of the pairs does not matter to a READ, so blocks allocated in
    descending order (a freed request's, tail first) merge as well as ascending ones."""
    local = np.asarray(local_ids, dtype=np.int64)
    remote = np.asarray(remote_ids, dtype=np.int64)
    if local.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    order = np.argsort(local, kind="stable")
    local, remote = local[order], remote[order]
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)  # [N - 1]
    starts = np.flatnonzero(np.concatenate(([True], breaks)))  # [R]
    lengths = np.diff(np.append(starts, local.size))  # [R]
    return np.stack([local[starts], remote[starts], lengths], axis=1)


def cut_runs(runs: np.ndarray, max_blocks: int) -> np.ndarray:
    """Runs [R, 3] cut into runs of at most max_blocks blocks (>= 1), in order -> [R', 3]."""
    assert max_blocks >= 1
    lengths = runs[:, 2]
    cuts = -(-lengths // max_blocks)  # pieces per run [R]
    run = np.repeat(np.arange(len(runs)), cuts)  # [R']
    k = np.arange(int(cuts.sum())) - np.repeat(np.cumsum(cuts) - cuts, cuts)  # piece within its run
    offset = k * max_blocks
    return np.stack(
        [runs[run, 0] + offset, runs[run, 1] + offset, np.minimum(max_blocks, lengths[run] - offset)], axis=1
    )


def descriptors(
    spec: KVCacheSpec,
    local_regions: tuple[MemoryRegion, ...],
    remote_regions: tuple[MemoryRegion, ...],
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    max_bytes: int = MAX_DESC_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """READ remote block remote_ids[t][i] into local block local_ids[t][i] of each block table t,
    every layer of its groups: one (addr, length, device) row per (layer, run of blocks contiguous
    on both sides), runs cut to at most max_bytes (or one block) -> uint64 [M, 3] x 2, row m of
    one side paired with row m of the other. Engine block b of group g is bytes [b, b + 1) x
    layer_bytes_per_block(g) of each of g's layer regions: its sub_blocks(g) rows lie back to back."""
    runs = [block_runs(mine, theirs) for mine, theirs in zip(local_ids, remote_ids, strict=True)]
    local, remote = [], []
    for g in spec.groups:
        per = np.uint64(spec.layer_bytes_per_block(g))
        cut = cut_runs(runs[spec.table_index(g.kind)], max(1, max_bytes // int(per))).astype(
            np.uint64
        )  # [R', 3]
        for out, regions, column in ((local, local_regions, 0), (remote, remote_regions, 1)):
            slots = range(spec.slot_start(g), spec.slot_start(g) + g.num_layers)  # g's layers' regions
            addr = np.array([regions[slot].addr for slot in slots], dtype=np.uint64)  # [L]
            device = np.array([regions[slot].device for slot in slots], dtype=np.uint64)  # [L]
            rows = np.empty((len(addr), len(cut), 3), dtype=np.uint64)  # [L, R', 3]
            rows[:, :, 0] = addr[:, None] + cut[None, :, column] * per
            rows[:, :, 1] = cut[None, :, 2] * per
            rows[:, :, 2] = device[:, None]
            out.append(rows.reshape(-1, 3))
    return np.concatenate(local), np.concatenate(remote)


@dataclass
class ReadTimings:
    """Where one read's time went on its thread, in seconds (NixlAgent.read fills it in)."""

    prepare: float = 0.0
    """Descriptors built and the transfer created."""
    transfer: float = 0.0
    """Posted until landed. On one host UCX reads with CMA (process_vm_readv), which copies
    inside the post, on the calling thread; across hosts the post returns at once."""
    verify: float = 0.0
    """Checksums of the blocks read."""
    release: float = 0.0
    """Transfer handles released."""
    descriptors: int = 0
    """Descriptors per side."""


class NixlAgent:
    """This worker's NIXL agent: every layer cache of the port registered once, at start."""

    def __init__(
        self,
        name: str,
        port: KVPort,
        progress_delay_us: int = PROGRESS_DELAY_US,
        read_gate: Path | None = None,
    ):
        """read_gate: a test hook (the reliability tests' PDSERVE_KV_READ_GATE): while that file
        exists, a read of more than one block lands its first block alone, then waits until
        the file is removed before it posts the rest (saying so in the log)."""
        b = bindings()
        if b is None:
            raise RuntimeError(
                "NIXL is not installed: pip install 'pdserve[nixl]' (or use --kv-transport grpc)"
            )
        self._b = b
        self.name = name
        self.spec = port.spec
        self.table_blocks = port.table_blocks
        self.num_blocks = self.table_blocks[0]
        self.regions = tuple(port.memory_regions())
        self.mem_type = "VRAM" if port.on_gpu else "DRAM"
        self.read_gate = read_gate
        checksum.load()  # built now, at start, not on the first read's critical path
        cfg = b.nixlAgentConfig()
        cfg.useProgThread = True
        cfg.useListenThread = False
        cfg.pthrDelay = progress_delay_us
        cfg.syncMode = b.NIXL_THREAD_SYNC_RW  # transfers from several threads, peers added meanwhile
        self._agent = b.nixlAgent(name, cfg)
        self._agent.createBackend("UCX", {})
        self._reg = b.nixlRegDList(self._segment(self.mem_type), self._rows(self.regions))
        self._agent.registerMem(self._reg, [])
        self.metadata: bytes = self._agent.getLocalMD()
        """What a peer needs to READ this agent's registered memory (see the module docstring)."""
        self._lock = threading.Lock()
        self._peers: OrderedDict[str, PeerAgent] = OrderedDict()
        self._metadata: dict[str, bytes] = {}
        self._closed = False
        logger.info(
            "NIXL agent %s: %d layer caches registered (%s, %.1f MiB)",
            name,
            len(self.regions),
            self.mem_type,
            sum(r.length for r in self.regions) / 2**20,
        )

    def _segment(self, mem_type: str):
        return self._b.VRAM_SEG if mem_type == "VRAM" else self._b.DRAM_SEG

    @staticmethod
    def _rows(regions) -> np.ndarray:
        return np.array([[r.addr, r.length, r.device] for r in regions], dtype=np.uint64).reshape(-1, 3)

    # ---- peers ---------------------------------------------------------------------------------

    def add_peer(
        self,
        name: str,
        metadata: bytes,
        regions: list[MemoryRegion],
        num_blocks: int | Sequence[int],
        mem_type: str,
    ) -> PeerAgent:
        """Load a producer's agent (once per name; ValueError naming the field if its metadata or
        geometry is not what our spec expects, or if the name is known with other metadata)."""
        peer = check_peer(self.spec, name, metadata, regions, num_blocks, mem_type)
        with self._lock:
            known = self._peers.get(name)
            if known is not None:
                if (known, self._metadata[name]) != (peer, metadata):
                    raise ValueError(f"nixl.agent_name {name!r} is already known with other metadata")
                self._peers.move_to_end(name)
                return known
        try:
            loaded = self._agent.loadRemoteMD(metadata)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own error types
            raise ValueError(f"nixl.metadata of {name!r} does not load: {e}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded != name:
            self._invalidate(loaded)
            raise ValueError(f"nixl.metadata names agent {loaded!r}, the peer says {name!r}")
        with self._lock:
            self._peers[name] = peer
            self._metadata[name] = metadata
            evicted = []
            while len(self._peers) > MAX_PEERS:
                old = self._peers.popitem(last=False)[0]
                del self._metadata[old]
                evicted.append(old)
        for old in evicted:
            self._invalidate(old)
        return peer

    def forget_peer(self, name: str) -> None:
        with self._lock:
            known = self._peers.pop(name, None)
            self._metadata.pop(name, None)
        if known is not None:
            self._invalidate(name)

    def _invalidate(self, name: str) -> None:
        try:
            self._agent.invalidateRemoteMD(name)
        except Exception as e:  # noqa: BLE001 - already gone is fine
            logger.debug("invalidating NIXL peer %s: %s", name, e)

    # ---- the read ----------------------------------------------------------------------------

    def read(
        self,
        peer: PeerAgent,
        sink: ImportSink,
        first_block: int,
        remote_block_ids: list[int],
        timeout_s: float,
        cancel: threading.Event,
        expected_digests: list[int] | None = None,
        timings: ReadTimings | None = None,
    ) -> int:
        """Blocking (never on the engine thread). READ the producer's blocks `remote_block_ids`
        (in read order: engine/kv_cache/transfer.py `read_order`) into the sink's blocks a
        transfer from first_block on writes and, with expected_digests, check every block read
        against them. Returns the bytes read; fills timings in when given. Raises ImportClosed
        (the import ended), NixlCancelled, NixlTimeout, NixlError, ChecksumMismatch, or
        ValueError when the producer's block ids do not fit (nothing is posted then). The
        per-request states are not read here: the caller pulls them (they are not in the caches)."""
        if not 0 <= first_block <= sink.num_blocks:
            raise ValueError(f"first_block {first_block} outside [0, {sink.num_blocks}]")
        ranges = sink.ranges_from(first_block)
        want = sum(end - start for start, end in ranges)
        if len(remote_block_ids) != want:
            raise ValueError(
                f"block_ids: {len(remote_block_ids)} from the producer, the handle leaves {want} to read"
            )
        tables, i = [], 0
        for t, (start, end) in enumerate(ranges):
            tables.append(list(remote_block_ids[i : i + end - start]))
            for j, b in enumerate(tables[-1]):
                if not 0 <= b < peer.table_blocks[t]:
                    raise ValueError(
                        f"block_ids[{i + j}] = {b} outside the producer's [0, {peer.table_blocks[t]}) of table {t}"
                    )
            i += end - start
        if expected_digests is not None and len(expected_digests) != want:
            raise ValueError(f"block_checksums: {len(expected_digests)} for {want} blocks")
        if want == 0:
            return 0
        local = [list(sink.tables[t][start:end]) for t, (start, end) in enumerate(ranges)]
        with sink.remote_write() as closing:
            t = timings if timings is not None else ReadTimings()
            read = _Read(self, peer, sink, closing, cancel, timeout_s, t)
            try:
                if self.read_gate is not None and want > 1 and self.read_gate.exists():
                    first = [ids[:1] for ids in local]  # each table's first block alone, then the gate
                    read.post(first, [ids[:1] for ids in tables])
                    read.wait()
                    read.wait_at_gate(self.read_gate, want)
                    local, tables = [ids[1:] for ids in local], [ids[1:] for ids in tables]
                read.post(local, tables)
                read.wait()
                if expected_digests is not None:
                    read.verify(first_block, expected_digests)
            finally:
                read.release()
        return read_bytes(self.spec, ranges)

    def _status(self, call, *args):
        try:
            return call(*args)
        except Exception as e:  # noqa: BLE001 - a peer gone mid-read surfaces here
            raise NixlError(f"NIXL transfer failed: {e}") from None

    def _release(self, handle) -> None:
        """Release a transfer handle; one still in flight that NIXL cannot cancel is waited out
        first (it must not write after we return)."""
        b = self._b
        failures = 0
        while True:
            try:
                self._agent.releaseXferReq(handle)
                return
            except Exception as e:  # noqa: BLE001
                try:
                    status = self._agent.getXferStatus(handle)
                except Exception:  # noqa: BLE001
                    status = None
                if status == b.NIXL_IN_PROG:
                    if not failures:
                        logger.warning("NIXL transfer cannot be cancelled in flight; waiting for it to end")
                    failures = 1
                    time.sleep(POLL_S)
                    continue
                failures += 1
                if failures > 2:  # not in flight (it can no longer write): give up on the handle
                    logger.error("NIXL transfer handle could not be released: %s", e)
                    return

    def close(self) -> None:
        """Deregister the caches (at shutdown, after the last transfer)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._agent.deregisterMem(self._reg, [])
        except Exception as e:  # noqa: BLE001
            logger.warning("NIXL deregistration failed: %s", e)


class _Read:
    """One read's transfers (two only at the test hook's gate); release() lets go of every one of
    them, waiting out any NIXL cannot cancel, before the read leaves the sink's remote_write slot."""

    def __init__(
        self,
        agent: NixlAgent,
        peer: PeerAgent,
        sink: ImportSink,
        closing: threading.Event,
        cancel: threading.Event,
        timeout_s: float,
        timings: ReadTimings,
    ):
        self.agent, self.peer, self.sink = agent, peer, sink
        self.closing, self.cancel, self.timeout_s = closing, cancel, timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.t = timings
        self.handles: list = []
        self.status = None

    def post(self, local_ids: list[list[int]], remote_ids: list[list[int]]) -> None:
        """READ each table's remote blocks into its local ones (lists per table, paired in order)."""
        start = time.monotonic()
        a, b = self.agent, self.agent._b
        local, remote = descriptors(a.spec, a.regions, self.peer.regions, local_ids, remote_ids)
        try:
            handle = a._agent.createXferReq(
                b.NIXL_READ,
                b.nixlXferDList(a._segment(a.mem_type), local),
                b.nixlXferDList(a._segment(self.peer.mem_type), remote),
                self.peer.name,
                b"",
                [],
            )
        except Exception as e:  # noqa: BLE001
            raise NixlError(f"NIXL READ from {self.peer.name} could not be prepared: {e}") from None
        self.handles.append(handle)
        posted = time.monotonic()
        self.t.descriptors += len(local)
        self.t.prepare += posted - start
        self.status = a._status(a._agent.postXferReq, handle, b"")
        self.t.transfer += time.monotonic() - posted

    def _go_on(self) -> None:
        if self.closing.is_set():
            raise ImportClosed(f"the import of request {self.sink.request_id!r} has ended")
        if self.cancel.is_set():
            raise NixlCancelled(f"NIXL READ from {self.peer.name} cancelled")
        if time.monotonic() > self.deadline:
            raise NixlTimeout(f"NIXL READ from {self.peer.name} took longer than {self.timeout_s:.1f} s")

    def wait(self) -> None:
        """Until the last transfer posted has landed."""
        start = time.monotonic()
        a, b = self.agent, self.agent._b
        while self.status == b.NIXL_IN_PROG:
            self._go_on()
            time.sleep(POLL_S)
            self.status = a._status(a._agent.getXferStatus, self.handles[-1])
        if self.status != b.NIXL_SUCCESS:
            raise NixlError(f"NIXL READ from {self.peer.name} failed: {self.status}")
        self.t.transfer += time.monotonic() - start

    def verify(self, first: int, expected: list[int]) -> None:
        """The sink's blocks a transfer from `first` on writes against the producer's checksums
        (both in read order)."""
        start = time.monotonic()
        got = self.sink.checksums(first)
        where = [
            (t, b) for t, (start, end) in enumerate(self.sink.ranges_from(first)) for b in range(start, end)
        ]
        for (t, b), g, e in zip(where, got, expected, strict=True):
            if g != e:
                table = f" of table {t}" if len(self.sink.ranges) > 1 else ""
                raise ChecksumMismatch(
                    f"KV block {b}{table} read from {self.peer.name} fails its checksum "
                    f"(CRC-32C {g:08x}, the producer's {e:08x})"
                )
        self.t.verify += time.monotonic() - start

    def wait_at_gate(self, gate: Path, blocks: int) -> None:
        """The test hook: hold until the gate file is gone (an import's close, a cancel or the
        deadline still end the read)."""
        logger.warning(
            "injected fault: NIXL READ from %s paused after block 1 of %d until %s is removed",
            self.peer.name,
            blocks,
            gate,
        )
        while gate.exists():
            self._go_on()
            time.sleep(GATE_POLL_S)

    def release(self) -> None:
        start = time.monotonic()
        for handle in self.handles:
            self.agent._release(handle)
        self.t.release += time.monotonic() - start
