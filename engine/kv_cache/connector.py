"""The KV connector interface: how KV bytes from outside the engine's device cache come in.

Split the way vLLM splits its KVConnector, into what the scheduler asks and what the worker does:

- scheduler side, on the engine thread, never waiting on I/O:
  `lookup` -- how many of a request's blocks after its device-cache hits the connector can supply
  now, or None when it does not know yet (it has started finding out off the engine thread; the
  request waits in RequestStatus.WAITING_FOR_REMOTE_KV meanwhile);
  `on_evict` -- a cached block is about to be reused;
  `release` -- the request was admitted (its blocks loaded) or ended: forget what was kept for it;
- worker side: `load` writes supplied blocks into the blocks the scheduler allocated -- the
  scheduler only plans it (a `KVLoad` on the scheduled request); EngineCore writes it before the
  forward through `run_load`, so decoding and checking blocks stays out of `Scheduler.schedule`
  -- and `poll` names the requests whose lookups finished (they go back to the head of the
  waiting queue).

The engine holds at most one connector (`EngineCore.connector`) and hands it to the scheduler and
the block pool when it builds them. The offload tiers (offload.py: host memory and a shared
Redis) are one; the tests add slow and failing test doubles of this interface.

KV transfers between engines have the same split, in two modules: the send half is
export.py's `ExportTable` (a finished prefill-only request's blocks are handed to an export
with a lease -- vLLM's `request_finished` holding the blocks -- and ended exports come back to
the engine thread through `take_ended`, its `get_finished`); the receive half is an import
(engine/kv_handover.py: `allocate_import` admits it through `Scheduler.admit`, which asks this
connector first, then transfer.py's `ImportSink`, then `finish_import` or `recompute_import`).
Every block they hold is freed through `Scheduler.free_blocks`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Gauge(NamedTuple):
    """One value a connector reports: a Prometheus gauge name, its help text, how to read it
    (any thread; a stale value is fine)."""

    name: str
    help: str
    read: Callable[[], float]


class KVConnector(ABC):
    # ---- scheduler side -------------------------------------------------------------------

    @abstractmethod
    def lookup(
        self,
        request_id: str,
        block_hashes: list[bytes],
        first_block: int = 0,
        device_states: Callable[[bytes], bool] | None = None,
    ) -> int | None:
        """How many of these consecutive blocks, from the first, can be loaded now -- in every
        block table what a prefix hit ending there needs (a window's only its last blocks), and
        the state after it where the spec has states, from the connector or, where
        device_states(block hash) says so, the device's snapshots; first_block: the device prefix
        hit before them. None while an off-thread lookup for this request is in flight (ask again once
        `poll` names it). At most one off-thread lookup per admission: afterwards the answer
        comes from what it found."""

    @abstractmethod
    def on_evict(self, block_hash: bytes, block_id: int, table: int = 0) -> None:
        """A full cached block of block table `table` is about to be reused for other tokens."""

    def on_evict_state(self, block_hash: bytes, states: tuple) -> None:  # noqa: B027 - optional
        """A request's states after block `block_hash` (a snapshot: one view per StateSpec) are
        about to be dropped from the device."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """The request was admitted (after `load`), finished or aborted: cancel its lookup and drop
        what was kept for it."""

    # ---- worker side ------------------------------------------------------------------------

    @abstractmethod
    def load(self, request_id: str, load: KVLoad) -> int:
        """Write the blocks `lookup` counted for the request where the load says, in order; stops
        at the first one that cannot be given intact. Returns how many were written -- all or
        none for a load of several tables or a state (a hit must serve every table)."""

    @abstractmethod
    def poll(self) -> set[str]:
        """Requests whose off-thread lookups have finished since they were started."""

    def close(self) -> None:  # noqa: B027 - optional: most connectors hold nothing to stop
        """Stop background threads and release resources."""

    def gauges(self) -> list[Gauge]:
        """What the connector reports to a worker's /metrics (none by default)."""
        return []


NO_BLOCK = -1
"""In a KVLoad's table: nothing to load there (a window's blocks behind what the first computed token reads)."""


@dataclass
class KVLoad:
    """Blocks the connector supplies to a request just admitted, as the scheduler planned them:
    the worker side writes them before the forward (`run_load`); the scheduler never does."""

    block_hashes: list[bytes]
    tables: tuple[list[int], ...]
    """Per block table, where each block goes (NO_BLOCK: not loaded): blocks allocated right
    after the request's device prefix hit."""
    states: tuple = ()
    """Views of the request's state slot, for the states after the last block; empty where the
    spec has none or the device's snapshot was restored already."""
    all_or_none: bool = False
    """Loaded whole or not at all: a hit of several tables, or with states, is served by every
    table (and the state) or by none."""

    @property
    def block_ids(self) -> list[int]:
        """The first table's destinations."""
        return self.tables[0]


def run_load(connector: KVConnector, request_id: str, load: KVLoad) -> int:
    """Write a planned load, then forget what the connector kept for the request. -> blocks that
    could not be given intact (the run stops at the first): their tokens are computed instead."""
    loaded = connector.load(request_id, load)
    connector.release(request_id)
    return len(load.block_hashes) - loaded
