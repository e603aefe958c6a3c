"""Per-request state (DeepSeek-V4's compressor state): one slot per running request, snapshots for
prefix hits, and per-position draft states so a verify step keeps only what was accepted.

A state is not per token: it is overwritten as the request runs, so a block table cannot hold it.
The pool keeps, for every StateSpec of the KV cache spec, a tensor
`[num_slots + num_snapshots, layers, *shape]`: a running request's slot, then snapshot slots.

Prefix hits: a request that skips n cached blocks must also start from the state after those
n x block_size tokens. The pool keeps a snapshot of a request's state at every block boundary its
steps cross, keyed by that block's chained hash (`reserve_snapshot`: the runner reserves the rows,
the model writes the state after each boundary into them), and a hit of n blocks is
served only where the snapshot of block n - 1 exists (`longest_snapshot`). Snapshots, not
recomputing the tail: the state after a prefix depends on every token since the last completed
entry and on the overlap the compressor reads (up to m = 128 tokens for V4's coarse cache), so
recomputing it would run up to a block of tokens through the compressor on every hit, while a
snapshot is one small copy at a boundary. Snapshots are evicted least recently used.

Speculative decoding: a verify step runs k drafts; the state after each of the k + 1 positions is
written to `draft_states(request)`, and `accept(request, a)` copies the one after the a accepted
drafts (and the known token) into the slot. The states of the rejected drafts are dropped: that is
the rollback, with no copy made before the step.

Not thread-safe: KVCacheManager (the engine's step loop) is its only caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.kv_cache.cache_group import StateSpec


class StatePool:
    def __init__(
        self,
        specs: tuple[StateSpec, ...],
        num_slots: int,
        num_snapshots: int,
        num_draft_positions: int = 0,
        device: torch.device | str = "cpu",
        on_evict: Callable[[bytes, tuple[torch.Tensor, ...]], None] | None = None,
    ):
        """num_slots: requests that can run at once; num_snapshots: prefix snapshots kept;
        num_draft_positions: k + 1 for k speculative drafts (0: no speculation); on_evict(block
        hash, its states): a snapshot is about to be dropped (KV offloading keeps it)."""
        if num_slots < 1 or num_snapshots < 0 or num_draft_positions < 0:
            raise ValueError(
                f"state pool: num_slots {num_slots} must be >= 1, num_snapshots {num_snapshots} and "
                f"num_draft_positions {num_draft_positions} >= 0"
            )
        self.specs = specs
        self.on_evict = on_evict
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.tensors = {
            s.name: torch.zeros(
                num_slots + num_snapshots, len(s.layers), *s.shape, dtype=s.dtype, device=device
            )
            for s in specs
        }
        """name -> [num_slots + num_snapshots, layers, *shape]: the slots, then the snapshots."""
        self.drafts = {
            s.name: torch.zeros(
                num_slots, num_draft_positions, len(s.layers), *s.shape, dtype=s.dtype, device=device
            )
            for s in specs
        }
        """name -> [num_slots, k + 1, layers, *shape]: a verify step's state after each position."""
        self._free_slots = list(range(num_slots - 1, -1, -1))  # slot 0 first
        self._slot: dict[str, int] = {}  # request id -> slot
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()  # block hash -> snapshot row, LRU first
        self._free_snapshots = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_cached_snapshots(self) -> int:
        return len(self._snapshots)

    def holds(self, request_id: str) -> bool:
        return request_id in self._slot

    def allocate(self, request_id: str) -> bool:
        """Give the request a zeroed slot; False (nothing changed) when none is free."""
        assert request_id not in self._slot, f"request {request_id!r} already holds a state slot"
        if not self._free_slots:
            return False
        slot = self._free_slots.pop()
        for t in self.tensors.values():
            t[slot].zero_()
        self._slot[request_id] = slot
        return True

    def free(self, request_id: str) -> None:
        """Give the slot back (finish, abort, preemption); a request without one is a no-op."""
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def row(self, request_id: str) -> int:
        """The request's slot: its row in every state tensor."""
        return self._slot[request_id]

    def state(self, request_id: str, name: str) -> torch.Tensor:
        """The request's state `name`: [layers, *shape], a view to read and write in place."""
        return self.tensors[name][self._slot[request_id]]

    def views(self, request_id: str) -> tuple[torch.Tensor, ...]:
        """Every state of the request, in the spec's order (what transfers and loads write)."""
        slot = self._slot[request_id]
        return tuple(self.tensors[s.name][slot] for s in self.specs)

    def draft_states(self, request_id: str, name: str) -> torch.Tensor:
        """[k + 1, layers, *shape]: row i is the state after position i of a verify step's query."""
        return self.drafts[name][self._slot[request_id]]

    def accept(self, request_id: str, num_accepted: int) -> None:
        """A verify step kept num_accepted drafts: the state after them becomes the request's; the
        rejected drafts' states are dropped."""
        slot = self._slot[request_id]
        for name, t in self.tensors.items():
            t[slot].copy_(self.drafts[name][slot, num_accepted])

    # ---- prefix snapshots -------------------------------------------------------------------

    def snapshot(self, request_id: str, block_hash: bytes) -> None:
        """Keep the request's current state as the state after the block `block_hash` ends (the
        caller knows the request's computed tokens end there). First writer wins."""
        row = self.reserve_snapshot(block_hash)
        if row is not None:
            slot = self._slot[request_id]
            for t in self.tensors.values():
                t[row].copy_(t[slot])

    def reserve_snapshot(self, block_hash: bytes) -> int | None:
        """A row for the state after block `block_hash`, which the caller writes (the model, at a
        block boundary inside a step's chunk: `ForwardBatch.snapshots`) -- the least recently
        used snapshot's where none is free; None: one is kept already (first writer wins) or the
        pool keeps none."""
        if not self.num_snapshots or block_hash in self._snapshots:
            return None
        if self._free_snapshots:
            row = self._free_snapshots.pop()
        else:
            evicted, row = self._snapshots.popitem(last=False)  # the least recently used
            if self.on_evict is not None:
                self.on_evict(evicted, tuple(self.tensors[s.name][row] for s in self.specs))
        self._snapshots[block_hash] = row
        return row

    def has_snapshot(self, block_hash: bytes) -> bool:
        return block_hash in self._snapshots

    def longest_snapshot(self, block_hashes: list[bytes], max_blocks: int) -> int:
        """The largest n <= max_blocks with a snapshot after block n - 1 (0 always qualifies)."""
        for n in range(max_blocks, 0, -1):
            if block_hashes[n - 1] in self._snapshots:
                return n
        return 0

    def restore(self, request_id: str, block_hash: bytes) -> None:
        """Start the request from the snapshot after block `block_hash` (it must exist)."""
        row = self._snapshots[block_hash]
        self._snapshots.move_to_end(block_hash)
        slot = self._slot[request_id]
        for t in self.tensors.values():
            t[slot].copy_(t[row])

    def reset(self) -> None:
        """Forget every snapshot (with the prefix cache)."""
        self._free_snapshots.extend(self._snapshots.values())
        self._snapshots.clear()
