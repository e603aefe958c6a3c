"""Exported KV: the send half of a KV transfer, engine side.

A prefill-only request (`add_request(kv_export=...)`) ends after its first token; its prompt
blocks then belong to an `Export` in the engine's `ExportTable`, pinned under a lease until the
decode side has read them. Each export is an explicit state machine:

    PENDING --begin_read--> READING --end_read--> PENDING (another read may follow)
       |                      |
       +-- release(done) -----+--> SUCCEEDED     release(abort) --> ABORTED
       +-- lease runs out ----+--> EXPIRED       a read that fails --> stays, the lease still runs

An export that is being read is not ended under the read: a release or expiry asked for
meanwhile waits until the read ends. A remote read (`begin_remote_read`: a peer READs the
blocks itself, over NIXL) has no end_read of ours: the peer's release ends it together with the
export, and one the peer never ends ends by itself at its deadline (`expire_due`), and the
export with it when its lease has run out -- an export is never READING forever. Pinned KV is bounded twice over: a lease never runs past
`created + max_total_lease_s`, however often it is renewed or read, and the pinned blocks (exports
plus the prefills running, `reserve`) stay within a limit the caller of `reserve` passes in,
shared fairly among the callers (the end clients).

Threads. The engine thread creates exports (`add`, when the request finishes) and frees the
blocks of ended ones (`take_ended`, through the scheduler, the one place blocks are freed). Any
thread -- the services' gRPC handlers -- reads, renews, releases and expires exports: those
methods hold the table's lock. An ended export's blocks stay allocated until the engine thread
takes it; `on_end` tells whoever wants to know (the worker wakes its engine thread with it).
Blocks of an export are read off the engine thread only between `begin_read` and `end_read`
(engine/kv_cache/transfer.py states who may touch the cache).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engine.request import Request

logger = logging.getLogger(__name__)

DEFAULT_LEASE_S = 30.0
DEFAULT_MAX_LEASE_S = 300.0
DEFAULT_MAX_TOTAL_LEASE_S = 120.0
RELEASE_ROOM_S = 5.0
"""Lease left after a read ends, for the release that follows."""
_ENDED_KEPT = 10_000
"""Recent end states remembered, for clear errors on late calls."""


class ExportNotFound(LookupError):
    """No such export, or it has ended (the message says which)."""


class ExportReleasing(RuntimeError):
    """The export is being released: it takes no lease renewal."""


class PinLimitExceeded(RuntimeError):
    """A caller would hold more pinned blocks than its limit."""


class ExportState(enum.Enum):
    PENDING = "pending"
    READING = "reading"
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    EXPIRED = "expired"

    @property
    def ended(self) -> bool:
        return self in (ExportState.SUCCEEDED, ExportState.ABORTED, ExportState.EXPIRED)


@dataclass(frozen=True)
class ExportOptions:
    """What a prefill-only request asks of its export (add_request(kv_export=...))."""

    lease_s: float | None = None
    """First lease; None: the table's default. Capped by the table's limits."""
    caller: str = ""
    """Who the blocks are pinned for (the worker counts them against its per-caller limit)."""


@dataclass
class Export:
    export_id: str
    """The transfer id the decode side names it by (random, unguessable)."""
    request: Request
    """The finished request: it holds the pinned prompt blocks (`block_ids`) until freed."""
    block_hashes: list[bytes]
    """Chained hashes of the full prompt blocks."""
    num_tokens: int
    """Prompt tokens the blocks hold."""
    generator_state: torch.Tensor | None
    """A seeded request's generator state after the first token, for the decode side to go on."""
    lease_expiry: float
    """time.time() after which the blocks may be freed."""
    caller: str = ""
    state: ExportState = ExportState.PENDING
    active_reads: int = 0
    pending_end: ExportState | None = None
    """An end state asked for while a read was in progress; applied when it ends."""
    bytes_sent: int = 0
    created: float = field(default_factory=time.time)
    remote_read_until: float | None = None
    """time.time() at which a peer's remote read ends by itself; None: none in progress."""
    states: tuple[torch.Tensor, ...] = ()
    """Views of the request's state slot after the prompt, one per StateSpec (kept with the blocks)."""
    null_ids: tuple[int, ...] = ()
    """Per table, the id standing for no block (BlockPool.null_id); empty: none stands for none."""
    block_checksums: list[int] | None = None
    """CRC-32C per block, computed before the handle went out (checksum.block_checksums); None: not
    computed (checksums off, or the worker serves KV over gRPC only)."""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def tables(self) -> list[list[int]]:
        """The prompt's blocks, one list per block table (KVCacheSpec.tables), each num_blocks
        long: a window table holds its pool's null block where the prompt's blocks fell behind
        its window (KVCacheSpec.transfer_ranges says which blocks a transfer moves)."""
        return self.request.block_ids

    @property
    def num_blocks(self) -> int:
        """The prompt's blocks, in each table."""
        return len(self.request.block_ids[0]) if self.request.block_ids else 0

    @property
    def block_ids(self) -> list[int]:
        """The full-attention table's blocks (what a NIXL reader reads: engine/kv_cache/nixl.py
        moves specs of one table)."""
        return self.request.block_ids[0] if self.request.block_ids else []

    def pinned(self) -> set[tuple[int, int]]:
        """(table, block id) of every block it pins, null entries left out."""
        nulls = self.null_ids or (-1,) * len(self.tables)
        return {(t, b) for t, table in enumerate(self.tables) for b in table if b != nulls[t]}


class ExportTable:
    def __init__(
        self,
        default_lease_s: float = DEFAULT_LEASE_S,
        max_lease_s: float = DEFAULT_MAX_LEASE_S,
        max_total_lease_s: float = DEFAULT_MAX_TOTAL_LEASE_S,
        on_end: Callable[[], None] | None = None,
    ):
        """on_end(): an export ended (any thread, outside the lock); its blocks wait for the
        engine thread's `take_ended`."""
        for name, value in (
            ("default_lease_s", default_lease_s),
            ("max_lease_s", max_lease_s),
            ("max_total_lease_s", max_total_lease_s),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        self.default_lease_s = default_lease_s
        self.max_lease_s = max_lease_s
        """Longest lease one add / renew grants."""
        self.max_total_lease_s = max_total_lease_s
        """No lease runs past the export's creation plus this, however often it is renewed."""
        self.on_end = on_end
        self._lock = threading.Lock()
        self._exports: dict[str, Export] = {}
        self._by_request: dict[str, Export] = {}
        """Live exports and ended ones whose blocks the engine has not freed yet."""
        self._ended: list[Export] = []
        self._wake = False
        """An export ended since on_end was last called."""
        self._ended_states: dict[str, ExportState] = {}
        self._reserved: dict[str, int] = {}  # caller -> blocks of its prefills still running
        self.counts: dict[ExportState, int] = {s: 0 for s in ExportState if s.ended}

    def __len__(self) -> int:
        """Live exports."""
        return len(self._exports)

    # ---- engine thread ---------------------------------------------------------------------------

    def add(
        self,
        request: Request,
        block_hashes: list[bytes],
        generator_state: torch.Tensor | None,
        options: ExportOptions,
        null_ids: tuple[int, ...] = (),
        states: tuple[torch.Tensor, ...] = (),
    ) -> Export:
        """Pin a finished prefill-only request's blocks (request.block_ids, the prompt's; null_ids:
        each table's id for no block) and its states (views of its kept state slot)."""
        now = time.time()
        lease_s = options.lease_s if options.lease_s is not None else self.default_lease_s
        lease_s = min(lease_s, self.max_lease_s, self.max_total_lease_s)
        export = Export(
            uuid.uuid4().hex,
            request,
            block_hashes,
            request.num_prompt_tokens,
            generator_state,
            now + lease_s,
            caller=options.caller,
            created=now,
            null_ids=null_ids,
            states=states,
        )
        with self._lock:
            assert request.request_id not in self._by_request, f"{request.request_id!r} is already exported"
            self._exports[export.export_id] = export
            self._by_request[request.request_id] = export
        return export

    def take_ended(self) -> list[Export]:
        """Exports that ended since the last call: the caller frees their blocks."""
        with self._lock:
            ended, self._ended = self._ended, []
            for export in ended:
                del self._by_request[export.request_id]
        return ended

    def holds(self, request_id: str) -> bool:
        """The request's blocks are still pinned (its export is live or not freed yet)."""
        return request_id in self._by_request

    def find(self, request_id: str) -> Export | None:
        """The live export of an engine request id."""
        export = self._by_request.get(request_id)
        return export if export is not None and not export.state.ended else None

    # ---- any thread --------------------------------------------------------------------------

    def get(self, export_id: str) -> Export:
        with self._locked():
            return self._get(export_id)

    def begin_read(self, export_id: str) -> Export:
        """Start reading the export's blocks: they stay pinned until the matching end_read."""
        with self._locked():
            export = self._get(export_id)
            if export.pending_end is not None:
                raise ExportNotFound(f"transfer {export_id!r} is being released")
            if time.time() > export.lease_expiry:  # reads in progress run past the lease; no new ones
                raise ExportNotFound(f"transfer {export_id!r} has run out of lease")
            export.active_reads += 1
            export.state = ExportState.READING
        return export

    def end_read(self, export: Export, room: bool = True) -> None:
        """room: leave the lease at least RELEASE_ROOM_S, for the release that follows a
        consumer's read (False for the producer's own reads, the checksums: the lease stays)."""
        with self._locked():
            self._end_read(export, room)

    def begin_remote_read(self, export_id: str, hold_s: float) -> Export:
        """A peer starts reading the blocks itself (one-sided, NIXL): they stay pinned until its
        release, or until hold_s from now (capped by the export's total lease), whichever is
        first. Asked again while one is in progress (a retried call), it extends that read."""
        if hold_s <= 0:
            raise ValueError(f"hold_s must be > 0, got {hold_s}")
        with self._locked():
            export = self._get(export_id)
            if export.pending_end is not None:
                raise ExportNotFound(f"transfer {export_id!r} is being released")
            now = time.time()
            until = self._cap(export, now + min(hold_s, self.max_lease_s))
            if export.remote_read_until is None:
                if now > export.lease_expiry:
                    raise ExportNotFound(f"transfer {export_id!r} has run out of lease")
                export.active_reads += 1
                export.state = ExportState.READING
            export.remote_read_until = max(until, export.remote_read_until or 0.0)
        return export

    def release(self, export_id: str, done: bool) -> None:
        """The decode side is done with the blocks (done) or gave up (abort)."""
        end = ExportState.SUCCEEDED if done else ExportState.ABORTED
        with self._locked():
            export = self._get(export_id)
            if export.remote_read_until is not None:  # the peer's release ends its read
                export.remote_read_until = None
                export.active_reads -= 1
            if export.active_reads:
                export.pending_end = end
            else:
                self._end(export, end)

    def release_request(self, request_id: str) -> bool:
        """Abort the export of an engine request id; False if it has none live."""
        with self._locked():
            export = self._by_request.get(request_id)
            if export is None or export.state.ended or export.pending_end is not None:
                return False
            if export.active_reads:
                export.pending_end = ExportState.ABORTED
            else:
                self._end(export, ExportState.ABORTED)
        return True

    def renew(self, export_id: str, lease_s: float) -> float:
        """Extend the lease (never shortens it) -> the new expiry."""
        with self._locked():
            export = self._get(export_id)
            if export.pending_end is not None:
                raise ExportReleasing(f"transfer {export_id!r} is being released")
            expiry = self._cap(export, time.time() + min(lease_s, self.max_lease_s))
            export.lease_expiry = max(export.lease_expiry, expiry)
            return export.lease_expiry

    def expire_due(self) -> int:
        """End every export whose lease ran out (and is not being read), after ending the remote
        reads past their deadline; returns how many exports ended."""
        now = time.time()
        with self._locked():
            for export in list(self._exports.values()):
                if export.remote_read_until is not None and now > export.remote_read_until:
                    logger.info("remote read of transfer %s ran past its deadline; ended", export.export_id)
                    export.remote_read_until = None
                    self._end_read(export, room=False)  # its reader is gone: no release will follow
            due = [e for e in self._exports.values() if e.active_reads == 0 and now > e.lease_expiry]
            for export in due:
                self._end(export, ExportState.EXPIRED)
        return len(due)

    def abort_all(self) -> None:
        """Abort every export (shutdown); ones being read end when their read does (a peer's
        remote read is ended here: the worker is going away)."""
        with self._locked():
            for export in list(self._exports.values()):
                if export.remote_read_until is not None:
                    export.remote_read_until = None
                    export.active_reads -= 1
                if export.active_reads:
                    export.pending_end = ExportState.ABORTED
                else:
                    self._end(export, ExportState.ABORTED)

    # ---- the bound on pinned blocks, shared fairly among callers -------------------------------

    def pinned_blocks(self, caller: str | None = None) -> int:
        """Blocks the caller holds pinned (None: every caller together): its live exports' (each
        block once, however many of its exports share it: the n samples of one prompt) plus its
        reservations."""
        with self._lock:
            return self._pinned(caller)

    def reserve(self, caller: str, num_blocks: int, limit: int, ceiling: int | None = None) -> None:
        """Count num_blocks against the caller before its prefill runs (unreserve when it ends,
        whether or not it was exported). Callers are the end clients (a router passes who asked).

        Pinned blocks are shared among them: a caller may pin while every caller's pinned blocks
        together stay within `limit`; past that, a caller holding less than its fair share (limit /
        the callers holding pins, itself counted) may still pin up to its share, every caller's
        together then up to `ceiling` (default limit): the heavy caller's next reservations are
        refused until it is back under its share, and its pins drain as its transfers end. So one
        client's batches cannot refuse another's. PinLimitExceeded, with nothing changed, else."""
        ceiling = limit if ceiling is None else max(ceiling, limit)
        with self._lock:
            mine, total = self._pinned(caller), self._pinned(None)
            if total + num_blocks <= limit:
                self._reserved[caller] = self._reserved.get(caller, 0) + num_blocks
                return
            callers = self._callers() | {caller}
            share = limit // len(callers)
            if mine + num_blocks <= share and total + num_blocks <= ceiling:
                self._reserved[caller] = self._reserved.get(caller, 0) + num_blocks
                return
            raise PinLimitExceeded(
                f"caller {caller} has {mine} KV blocks pinned; {num_blocks} more would pass its share of "
                f"{share} ({limit} pinnable blocks, max_pinned_fraction of this worker's, over "
                f"{len(callers)} caller(s) pinning; {total} pinned now)"
            )

    def unreserve(self, caller: str, num_blocks: int) -> None:
        with self._lock:
            left = self._reserved.get(caller, 0) - num_blocks
            assert left >= 0, f"unreserve of {num_blocks} blocks that {caller} did not reserve"
            if left:
                self._reserved[caller] = left
            else:
                self._reserved.pop(caller, None)

    # ---- under the lock ---------------------------------------------------------------------------

    def _pinned(self, caller: str | None) -> int:
        held = set().union(
            *(e.pinned() for e in self._exports.values() if caller is None or e.caller == caller)
        )
        reserved = self._reserved.get(caller, 0) if caller is not None else sum(self._reserved.values())
        return len(held) + reserved

    def _callers(self) -> set[str]:
        """Callers holding pins: exports or reservations."""
        return {e.caller for e in self._exports.values()} | set(self._reserved)

    def _end_read(self, export: Export, room: bool = True) -> None:
        export.active_reads -= 1
        if export.active_reads == 0:
            export.state = ExportState.PENDING
            if room:
                export.lease_expiry = max(
                    export.lease_expiry, self._cap(export, time.time() + RELEASE_ROOM_S)
                )
            if export.pending_end is not None:
                self._end(export, export.pending_end)

    def _cap(self, export: Export, expiry: float) -> float:
        return min(expiry, export.created + self.max_total_lease_s)

    def _get(self, export_id: str) -> Export:
        export = self._exports.get(export_id)
        if export is None:
            ended = self._ended_states.get(export_id)
            if ended is not None:
                raise ExportNotFound(f"transfer {export_id!r} has ended ({ended.value})")
            raise ExportNotFound(f"unknown transfer {export_id!r}")
        if export.pending_end is None and export.active_reads == 0 and time.time() > export.lease_expiry:
            self._end(export, ExportState.EXPIRED)
            raise ExportNotFound(f"transfer {export_id!r} has ended (expired)")
        return export

    def _end(self, export: Export, state: ExportState) -> None:
        assert state.ended and not export.state.ended
        export.state = state
        del self._exports[export.export_id]
        self._ended.append(export)
        self._ended_states[export.export_id] = state
        if len(self._ended_states) > _ENDED_KEPT:
            self._ended_states.pop(next(iter(self._ended_states)))
        self.counts[state] += 1
        self._wake = True
        logger.debug("export %s of %s %s", export.export_id, export.request_id, state.value)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, then on_end (outside it) if an export ended meanwhile -- also when the
        body raised (a lookup that found the lease run out ends the export, then refuses)."""
        try:
            with self._lock:
                yield
        finally:
            with self._lock:
                wake, self._wake = self._wake, False
            if wake and self.on_end is not None:
                self.on_end()
