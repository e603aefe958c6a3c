"""NIXL as the KV data plane: a consumer READs a producer's exported blocks straight from the
producer's registered cache memory into its own blocks (UCX underneath: shared memory or TCP on
one host, RDMA across nodes), instead of the gRPC chunk stream's copies.

    producer worker                                   consumer worker
    NixlAgent: every layer cache registered once      NixlAgent: every layer cache registered once
    metadata + regions --(GetEngineInfo, authenticated)--> add_peer
    export (pinned, lease) <--(KvTransfer.BeginRead)-- block ids, per-block checksums
    registered memory ======== one-sided NIXL READ ========> the import sink's blocks
                       <--(KvTransfer.Release done|abort)-- the read and the export end

Geometry. A layer's cache is [rows, block_size, width] contiguous, one region per layer; engine
block b of group g is rows `spec.group_block_ids(g, [b])` -- `sub_blocks(g)` consecutive rows,
one contiguous run of `spec.layer_bytes_per_block(g)` bytes. A transfer is one descriptor per
(layer, block) on each side, in the same order, so groups of any block size move together;
runs that are contiguous on both sides are then merged (`coalesce`, pieces of <= 2 MiB).
The consumer builds both sides itself: its own addresses from its import sink's blocks, the
producer's from the producer's regions (checked against the spec when the peer is added) and
the block ids the producer handed out (checked against the producer's block count). Nothing is
pickled: metadata is NIXL's own byte string, everything else protobuf integers.

Threads. The worker owns its agent (the engine thread owns nothing new). `read` blocks: run it
off the engine thread and the event loop. It writes only inside the import sink's `remote_write`
slot (engine/kv_cache/transfer.py): when the import closes, or the caller cancels, or the
deadline passes, the transfer handle is released -- NIXL cancels a transfer in flight, and one
it cannot cancel is waited out first -- before the slot is left, so no READ lands in blocks the
import no longer owns. An end-to-end checksum (xxh3-64 per block, codec.block_digests) computed
by the producer when it issued the handle is verified on the consumer's blocks before they join
the batch.

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
from dataclasses import dataclass
from types import ModuleType

import numpy as np

from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import ImportClosed, ImportSink, KVPort, MemoryRegion

logger = logging.getLogger(__name__)

_BINDINGS = ("nixl_cu12._bindings", "nixl._bindings", "nixl_cu13._bindings")
"""Where NIXL's bindings live, by wheel (nixl-cu12 is the one pinned)."""
PROGRESS_DELAY_US = 100
POLL_S = 0.0002
"""Between transfer status checks."""
MAX_METADATA_BYTES = 1 << 20
MAX_AGENT_NAME_CHARS = 128
MAX_PEERS = 64
"""Remote agents loaded at once; the least recently used is dropped first."""
MEM_TYPES = ("DRAM", "VRAM")
MAX_DESC_BYTES = 2 << 20
"""Longest descriptor a transfer is merged into: one per (layer, block) was ~30 % slower over
UCX's TCP transport (18 KiB blocks), and one per layer no faster than 2 MiB pieces."""


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
    num_blocks: int
    mem_type: str


def check_peer(
    spec: KVCacheSpec,
    name: str,
    metadata: bytes,
    regions: list[MemoryRegion],
    num_blocks: int,
    mem_type: str,
) -> PeerAgent:
    """A peer's advertised agent against our spec (the peer's compat hash equals ours, so its
    geometry must too): ValueError naming the field and the limit."""
    if not name or len(name) > MAX_AGENT_NAME_CHARS:
        raise ValueError(f"nixl.agent_name must be 1 to {MAX_AGENT_NAME_CHARS} characters, got {len(name)}")
    if not 0 < len(metadata) <= MAX_METADATA_BYTES:
        raise ValueError(f"nixl.metadata must be 1 to {MAX_METADATA_BYTES} bytes, got {len(metadata)}")
    if mem_type not in MEM_TYPES:
        raise ValueError(f"nixl.mem_type must be one of {MEM_TYPES}, got {mem_type!r}")
    if not 0 < num_blocks < 2**31:
        raise ValueError(f"nixl.num_blocks must be in (0, 2^31), got {num_blocks}")
    if len(regions) != spec.num_layers:
        raise ValueError(
            f"nixl.regions has {len(regions)} entries, the KV cache spec has {spec.num_layers} layers"
        )
    for layer, r in enumerate(regions):
        want = num_blocks * spec.layer_bytes_per_block(spec.group_of(layer))
        if r.length != want:
            raise ValueError(
                f"nixl.regions[{layer}].length is {r.length}, {num_blocks} blocks of this spec are {want} bytes"
            )
        if not 0 < r.addr < 2**64 - r.length:
            raise ValueError(f"nixl.regions[{layer}].addr {r.addr:#x} leaves no room for {r.length} bytes")
    return PeerAgent(name, tuple(regions), num_blocks, mem_type)


def descriptors(spec: KVCacheSpec, regions: tuple[MemoryRegion, ...], block_ids: list[int]) -> np.ndarray:
    """One (addr, length, device) row per (layer, engine block), layers in order, blocks in the
    given order within each layer -> uint64 [num_layers x len(block_ids), 3]."""
    out = []
    for g in spec.groups:
        per = spec.layer_bytes_per_block(g)  # one engine block of one layer: sub_blocks(g) rows
        first_rows = np.array([spec.group_block_ids(g, [b])[0] for b in block_ids], dtype=np.uint64)
        offsets = first_rows * np.uint64(g.block_bytes)  # [blocks]
        for layer in g.layers:
            r = regions[layer]
            rows = np.empty((len(block_ids), 3), dtype=np.uint64)
            rows[:, 0] = np.uint64(r.addr) + offsets
            rows[:, 1] = per
            rows[:, 2] = r.device
            out.append(rows)
    return np.concatenate(out) if out else np.zeros((0, 3), dtype=np.uint64)


def coalesce(
    local: np.ndarray, remote: np.ndarray, max_bytes: int = MAX_DESC_BYTES
) -> tuple[np.ndarray, np.ndarray]:
    """Merge runs of rows that continue contiguously on both sides (blocks allocated back to back)
    into rows of at most max_bytes (or one row's length); the same merge on both sides, so row i
    of one still pairs with row i of the other. [N, 3] x 2 -> [M, 3] x 2, M <= N."""
    assert local.shape == remote.shape and (local[:, 1] == remote[:, 1]).all()
    out_l, out_r = [], []
    for (la, n, ld), (ra, _, rd) in zip(local.tolist(), remote.tolist(), strict=True):
        if out_l:
            pl, pr = out_l[-1], out_r[-1]
            if (
                la == pl[0] + pl[1]
                and ra == pr[0] + pr[1]
                and (ld, rd) == (pl[2], pr[2])
                and pl[1] + n <= max_bytes
            ):
                pl[1] += n
                pr[1] += n
                continue
        out_l.append([la, n, ld])
        out_r.append([ra, n, rd])
    return np.array(out_l, dtype=np.uint64).reshape(-1, 3), np.array(out_r, dtype=np.uint64).reshape(-1, 3)


class NixlAgent:
    """This worker's NIXL agent: every layer cache of the port registered once, at start."""

    def __init__(self, name: str, port: KVPort, progress_delay_us: int = PROGRESS_DELAY_US):
        b = bindings()
        if b is None:
            raise RuntimeError(
                "NIXL is not installed: pip install 'pdserve[nixl]' (or use --kv-transport grpc)"
            )
        self._b = b
        self.name = name
        self.spec = port.spec
        self.num_blocks = port.num_blocks
        self.regions = tuple(port.memory_regions())
        self.mem_type = "VRAM" if port.on_gpu else "DRAM"
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
        self, name: str, metadata: bytes, regions: list[MemoryRegion], num_blocks: int, mem_type: str
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
    ) -> int:
        """Blocking (never on the engine thread). READ the producer's blocks `remote_block_ids`
        into the sink's blocks [first_block, num_blocks), then, with expected_digests, check
        every block read against them. Returns the bytes read. Raises ImportClosed (the import
        ended), NixlCancelled, NixlTimeout, NixlError, ChecksumMismatch, or ValueError when the
        producer's block ids do not fit (nothing is posted then)."""
        want = sink.num_blocks - first_block
        if not 0 <= first_block <= sink.num_blocks or len(remote_block_ids) != want:
            raise ValueError(
                f"block_ids: {len(remote_block_ids)} from the producer, the handle leaves {want} to read"
            )
        for i, b in enumerate(remote_block_ids):
            if not 0 <= b < peer.num_blocks:
                raise ValueError(f"block_ids[{i}] = {b} outside the producer's [0, {peer.num_blocks})")
        if expected_digests is not None and len(expected_digests) != want:
            raise ValueError(f"block_checksums: {len(expected_digests)} for {want} blocks")
        if want == 0:
            return 0
        local, remote = coalesce(
            descriptors(self.spec, self.regions, list(sink.block_ids[first_block:])),
            descriptors(self.spec, peer.regions, list(remote_block_ids)),
        )
        nbytes = int(local[:, 1].sum())
        b = self._b
        deadline = time.monotonic() + timeout_s
        with sink.remote_write() as closing:
            try:
                handle = self._agent.createXferReq(
                    b.NIXL_READ,
                    b.nixlXferDList(self._segment(self.mem_type), local),
                    b.nixlXferDList(self._segment(peer.mem_type), remote),
                    peer.name,
                    b"",
                    [],
                )
            except Exception as e:  # noqa: BLE001
                raise NixlError(f"NIXL READ from {peer.name} could not be prepared: {e}") from None
            try:
                status = self._status(self._agent.postXferReq, handle, b"")
                while status == b.NIXL_IN_PROG:
                    if closing.is_set():
                        raise ImportClosed(f"the import of request {sink.request_id!r} has ended")
                    if cancel.is_set():
                        raise NixlCancelled(f"NIXL READ from {peer.name} cancelled")
                    if time.monotonic() > deadline:
                        raise NixlTimeout(f"NIXL READ from {peer.name} took longer than {timeout_s:.1f} s")
                    time.sleep(POLL_S)
                    status = self._status(self._agent.getXferStatus, handle)
                if status != b.NIXL_SUCCESS:
                    raise NixlError(f"NIXL READ from {peer.name} failed: {status}")
            finally:
                self._release(handle)
            if expected_digests is not None:
                got = sink.digests(first_block)
                for i, (g, e) in enumerate(zip(got, expected_digests, strict=True)):
                    if g != e:
                        raise ChecksumMismatch(
                            f"KV block {first_block + i} read from {peer.name} fails its checksum "
                            f"(xxh3-64 {g:016x}, the producer's {e:016x})"
                        )
        return nbytes

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
