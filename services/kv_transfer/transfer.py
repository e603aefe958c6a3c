"""The producer's record of pinned KV transfers: an explicit state machine per transfer.

    PENDING --Pull--> TRANSFERRING --stream done--> PENDING (another Pull may follow)
       |                   |
       +-- Release(done) --+--> SUCCEEDED      Release(abort) --> ABORTED
       +-- lease runs out -+--> EXPIRED        stream error   --> stays, lease still runs

A transfer owns its blocks (through the engine's `exported` table) until it reaches an end state;
then `on_free(request_id)` is called exactly once. A transfer that is being streamed is not
freed under the stream: its end (release or expiry) waits until the Pull finishes. Only the
event loop touches the table.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from services.errors import FailedPrecondition, NotFound

logger = logging.getLogger(__name__)


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


class TransferTable:
    def __init__(self, on_free: Callable[[str], None], max_lease_s: float = 300.0):
        self._on_free = on_free
        self.max_lease_s = max_lease_s
        self._transfers: dict[str, Transfer] = {}
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
    ) -> Transfer:
        lease_s = min(lease_s, self.max_lease_s)
        t = Transfer(uuid.uuid4().hex, request_id, block_ids, block_hashes, num_tokens, time.time() + lease_s)
        self._transfers[t.transfer_id] = t
        return t

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
        t.active_pulls += 1
        t.state = TransferState.TRANSFERRING
        return t

    def end_pull(self, t: Transfer) -> None:
        t.active_pulls -= 1
        if t.active_pulls == 0:
            t.state = TransferState.PENDING
            t.lease_expiry = max(t.lease_expiry, time.time() + 5.0)  # room for the Release that follows
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
        t.lease_expiry = max(t.lease_expiry, time.time() + min(lease_s, self.max_lease_s))
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
