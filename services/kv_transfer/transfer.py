"""The producer's record of pinned KV transfers: an explicit state machine per transfer.

    PENDING --Pull--> TRANSFERRING --stream done--> PENDING (another Pull may follow)
       |                   |
       +-- Release(done) --+--> SUCCEEDED      Release(abort) --> ABORTED
       +-- lease runs out -+--> EXPIRED        stream error   --> stays, lease still runs

A transfer owns its blocks (through the engine's `exported` table) until it reaches an end state;
then `on_free(request_id)` is called exactly once (request_id is the engine's id, never a
caller's label). A transfer that is being streamed is not freed under the stream: its end
(release or expiry) waits until the Pull finishes. Only the event loop touches the table.

Pinned KV is bounded twice over: a transfer's lease never runs past `created +
max_total_lease_s`, however often it is renewed or pulled, and one caller's pinned blocks
(its transfers plus the prefills it has running, `reserve`) stay within a limit the worker
passes in, so no caller can hold the worker's KV forever or all of it.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.errors import FailedPrecondition, NotFound, ResourceExhausted

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOTAL_LEASE_S = 120.0
RELEASE_ROOM_S = 5.0
"""Lease left after a Pull ends, for the Release that follows."""


class TransferState(enum.Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    EXPIRED = "expired"

    @property
    def ended(self) -> bool:
        return self in (TransferState.SUCCEEDED, TransferState.ABORTED, TransferState.EXPIRED)


@dataclass
class Transfer:
    transfer_id: str
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    num_tokens: int
    lease_expiry: float
    """time.time() after which the blocks may be freed."""
    state: TransferState = TransferState.PENDING
    active_pulls: int = 0
    pending_end: TransferState | None = None
    """An end state requested while a Pull was streaming; applied when it finishes."""
    bytes_sent: int = 0
    created: float = field(default_factory=time.time)
    caller: str = ""
    """Who asked for the blocks (the Prefill caller's host): its pinned blocks are bounded."""


class TransferTable:
    def __init__(
        self,
        on_free: Callable[[str], None],
        max_lease_s: float = 300.0,
        max_total_lease_s: float = DEFAULT_MAX_TOTAL_LEASE_S,
    ):
        if max_total_lease_s <= 0:
            raise ValueError(f"max_total_lease_s must be > 0, got {max_total_lease_s}")
        self._on_free = on_free
        self.max_lease_s = max_lease_s
        """Longest lease one create / renew grants."""
        self.max_total_lease_s = max_total_lease_s
        """No lease runs past the transfer's creation plus this, however often it is renewed."""
        self._transfers: dict[str, Transfer] = {}
        self._reserved: dict[str, int] = {}  # caller -> blocks of its prefills still running
        self._ended: dict[str, TransferState] = {}  # recent end states, for clear errors
        self.counts: dict[TransferState, int] = {s: 0 for s in TransferState if s.ended}

    def __len__(self) -> int:
        return len(self._transfers)

    def create(
        self,
        request_id: str,
        block_ids: list[int],
        block_hashes: list[bytes],
        num_tokens: int,
        lease_s: float,
        caller: str = "",
    ) -> Transfer:
        now = time.time()
        lease_s = min(lease_s, self.max_lease_s, self.max_total_lease_s)
        t = Transfer(
            uuid.uuid4().hex,
            request_id,
            block_ids,
            block_hashes,
            num_tokens,
            now + lease_s,
            created=now,
            caller=caller,
        )
        self._transfers[t.transfer_id] = t
        return t

    # ---- per-caller bound on pinned blocks -----------------------------------------------------

    def pinned_blocks(self, caller: str) -> int:
        """Blocks the caller holds pinned: its live transfers' plus its reservations."""
        held = sum(len(t.block_ids) for t in self._transfers.values() if t.caller == caller)
        return held + self._reserved.get(caller, 0)

    def reserve(self, caller: str, num_blocks: int, limit: int) -> None:
        """Count num_blocks against the caller before its prefill runs (unreserve when it ends,
        whether or not it became a transfer). ResourceExhausted, with nothing changed, when the
        caller would hold more than `limit` pinned blocks."""
        pinned = self.pinned_blocks(caller)
        if pinned + num_blocks > limit:
            raise ResourceExhausted(
                f"caller {caller} has {pinned} KV blocks pinned; {num_blocks} more would pass the "
                f"limit of {limit} (max_pinned_fraction of this worker's KV blocks)"
            )
        self._reserved[caller] = self._reserved.get(caller, 0) + num_blocks

    def unreserve(self, caller: str, num_blocks: int) -> None:
        left = self._reserved.get(caller, 0) - num_blocks
        assert left >= 0, f"unreserve of {num_blocks} blocks that {caller} did not reserve"
        if left:
            self._reserved[caller] = left
        else:
            self._reserved.pop(caller, None)

    def _cap(self, t: Transfer, expiry: float) -> float:
        """A lease expiry, bounded by the transfer's total lease time."""
        return min(expiry, t.created + self.max_total_lease_s)

    def get(self, transfer_id: str) -> Transfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            ended = self._ended.get(transfer_id)
            if ended is not None:
                raise NotFound(f"transfer {transfer_id!r} has ended ({ended.value})")
            raise NotFound(f"unknown transfer {transfer_id!r}")
        if t.pending_end is None and t.active_pulls == 0 and time.time() > t.lease_expiry:
            self._end(t, TransferState.EXPIRED)
            raise NotFound(f"transfer {transfer_id!r} has ended (expired)")
        return t

    def begin_pull(self, transfer_id: str) -> Transfer:
        t = self.get(transfer_id)
        if t.pending_end is not None:
            raise NotFound(f"transfer {transfer_id!r} is being released")
        if time.time() > t.lease_expiry:  # other pulls run past the lease; no new ones start
            raise NotFound(f"transfer {transfer_id!r} has run out of lease")
        t.active_pulls += 1
        t.state = TransferState.TRANSFERRING
        return t

    def end_pull(self, t: Transfer) -> None:
        t.active_pulls -= 1
        if t.active_pulls == 0:
            t.state = TransferState.PENDING
            t.lease_expiry = max(t.lease_expiry, self._cap(t, time.time() + RELEASE_ROOM_S))
            if t.pending_end is not None:
                self._end(t, t.pending_end)

    def release(self, transfer_id: str, done: bool) -> None:
        t = self.get(transfer_id)
        end = TransferState.SUCCEEDED if done else TransferState.ABORTED
        if t.active_pulls:
            t.pending_end = end
        else:
            self._end(t, end)

    def renew(self, transfer_id: str, lease_s: float) -> float:
        t = self.get(transfer_id)
        if t.pending_end is not None:
            raise FailedPrecondition(f"transfer {transfer_id!r} is being released")
        t.lease_expiry = max(t.lease_expiry, self._cap(t, time.time() + min(lease_s, self.max_lease_s)))
        return t.lease_expiry

    def expire_due(self) -> int:
        """End every transfer whose lease ran out (and is not streaming); returns how many."""
        now = time.time()
        due = [t for t in self._transfers.values() if t.active_pulls == 0 and now > t.lease_expiry]
        for t in due:
            self._end(t, TransferState.EXPIRED)
        return len(due)

    def abort_all(self) -> None:
        """Abort every transfer (shutdown); ones being pulled end when their Pull does."""
        for t in list(self._transfers.values()):
            if t.active_pulls:
                t.pending_end = TransferState.ABORTED
            else:
                self._end(t, TransferState.ABORTED)

    def _end(self, t: Transfer, state: TransferState) -> None:
        assert state.ended
        t.state = state
        del self._transfers[t.transfer_id]
        self._ended[t.transfer_id] = state
        if len(self._ended) > 10_000:
            self._ended.pop(next(iter(self._ended)))
        self.counts[state] += 1
        logger.debug("transfer %s of %s %s", t.transfer_id, t.request_id, state.value)
        self._on_free(t.request_id)


def caller_key(peer: str) -> str:
    """The key a Prefill caller's pinned blocks are counted under: the host of its gRPC peer
    address ("ipv4:10.0.0.7:51234" -> "10.0.0.7", "ipv6:[::1]:51234" -> "::1"); other address
    kinds (unix sockets) as given."""
    kind, _, address = peer.partition(":")
    if kind == "ipv4":
        return address.rpartition(":")[0] or address
    if kind == "ipv6" and address.startswith("[") and "]" in address:
        return address[1 : address.index("]")]
    return peer
