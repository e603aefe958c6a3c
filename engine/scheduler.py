"""Continuous batching with chunked prefill under a token budget, preempting by recompute.

Each step the scheduler first gives every running request what it needs (one token for a
decode, the next chunk for a prefill), in arrival order; when the KV cache is full it preempts
the most recently admitted running request (its blocks are freed and it is recomputed later, its
generated tokens kept). Then, if nothing was preempted, it admits waiting requests, first
reusing their cached prefix, while the token budget, `max_num_seqs` and free blocks allow. A
prefill that does not fit the remaining budget is chunked; decodes and prefill chunks share one
step.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.kv_cache.connector import NO_BLOCK, KVConnector, KVLoad
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


class Admission(enum.Enum):
    """Why Scheduler.admit did not admit a request."""

    NO_ROOM = "no_room"
    LOOKING_UP = "looking_up"


@dataclass
class ScheduledRequest:
    request: Request
    num_computed_tokens: int
    """Tokens already in the cache when the step starts (prefix hits included)."""
    num_new_tokens: int
    """Known tokens this step runs through the model."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Speculative drafts run after them, to be verified (the runner returns what was accepted)."""
    kv_load: KVLoad | None = None
    """Blocks the connector writes before the forward (counted in num_computed_tokens); those it
    cannot give are computed instead (EngineCore moves their tokens to num_new_tokens)."""

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last known token, so the step samples its next token."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        """One known token after a cached context (plus any drafts): runs the absorbed MLA path."""
        return self.num_new_tokens == 1 and self.num_computed_tokens > 0

    @property
    def query_len(self) -> int:
        """Tokens this request puts into the forward: the known ones, then the drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """Requests that run this step, with their token counts."""
    preempted: list[Request] = field(default_factory=list)
    """Requests whose blocks were freed this step to make room; they wait to be recomputed."""
    num_batched_tokens: int = 0
    """Sum of num_new_tokens: at most max_num_batched_tokens."""

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting and running queues. Not thread-safe: only the engine's step loop calls it."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_speculative: int = 0,
        connector: KVConnector | None = None,
    ):
        self.kv = kv
        """Owns the blocks: the scheduler asks it for room and gives blocks back through it."""
        self.connector = connector
        """Where prefix blocks missing from the device cache may come from (KV offload tiers)."""
        self.num_speculative = num_speculative
        """k of speculative decoding (0: off): a step that samples reserves slots for the verify
        of k drafts and for drafting the next k."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: list[Request] = []
        """Requests (WAITING_FOR_REMOTE_KV) whose prefix blocks the connector is looking up."""
        self.importing: dict[str, Request] = {}
        """Requests whose prompt KV comes from another engine: WAITING_FOR_REMOTE_KV until admitted
        (`admit_import`), LOADING_REMOTE_KV while a transfer writes it, then running
        (`end_import`). Not stepped: the transfer, not a step, moves them on."""
        self._virtual_time = 0.0
        """The start tag of the request admitted last (start-time fair queuing)."""
        self._client_finish: dict[str, float] = {}
        """Each client's last finish tag, for clients ahead of the virtual time."""

    def add(self, req: Request) -> None:
        """Queue a new request, fairly among clients (start-time fair queuing, by prompt tokens):
        its start tag is the later of the virtual time and its client's last finish tag, and
        waiting requests run in tag order, so a client's backlog of prompts queues behind itself,
        not in front of another client's next one. One client (offline: every request's "") keeps
        arrival order."""
        start = max(self._virtual_time, self._client_finish.get(req.client, 0.0))
        self._client_finish[req.client] = start + max(1, len(req.prompt_token_ids))
        req.fair_tag = start
        # The last waiting request with a tag <= start is usually the tail: search from there.
        i = len(self.waiting)
        while i and self.waiting[i - 1].fair_tag > start:
            i -= 1
        self.waiting.insert(i, req)

    def _started(self, req: Request) -> None:
        """A waiting request was admitted: the virtual time moves to its tag, and clients that
        have fallen behind it are forgotten (their next request starts at the virtual time)."""
        if req.fair_tag > self._virtual_time:
            self._virtual_time = req.fair_tag
            if len(self._client_finish) > 64:
                self._client_finish = {c: f for c, f in self._client_finish.items() if f > self._virtual_time}

    @property
    def num_unfinished(self) -> int:
        """Requests a step may move on (imports wait for their transfer, not a step)."""
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    @property
    def num_waiting(self) -> int:
        """Requests not running yet: queued, looking their prefix up, or importing."""
        return len(self.waiting) + len(self.waiting_for_kv) + len(self.importing)

    # ---- imports (engine/kv_handover.py writes their KV) ------------------------------------

    def begin_import(self, req: Request) -> None:
        """Hold a new request until its prompt KV is in: WAITING_FOR_REMOTE_KV, holding no blocks."""
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.importing[req.request_id] = req

    def admit_import(self, req: Request) -> tuple[int, KVLoad | None] | None:
        """Blocks for an importing request's prompt, through the admission every request goes
        through (prefix hits and what the connector holds need no transfer; the new blocks are not
        prefix-cached until their contents are in; a window table gets only what the token after
        the prompt reads) -> (prompt tokens in its blocks once the load is written, the load), or
        None when there is no room or the connector is looking its prefix up: ask again after a
        step. LOADING_REMOTE_KV once admitted."""
        n = req.num_prompt_tokens
        admitted = self.admit(req, n, n, cache_blocks=False, external=True)
        if isinstance(admitted, Admission):
            return None
        cached, _, load = admitted
        req.status = RequestStatus.LOADING_REMOTE_KV
        return cached, load

    def end_import(self, req: Request, done: bool = True) -> None:
        """The import ends: done, its prompt KV is in (registered in the prefix cache here; the
        caller then joins it to the running batch, `add_running`); else the transfer failed (the
        caller queues it to compute the prompt here, `recompute`)."""
        del self.importing[req.request_id]
        if not done:
            return
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.metrics.first_scheduled_time = time.monotonic()

    def admit(
        self, req: Request, upto: int, budget: int, cache_blocks: bool = True, external: bool = False
    ) -> tuple[int, int, KVLoad | None] | Admission:
        """Admission, written once (waiting requests in `schedule`, KV imports in `admit_import`):
        give a request that holds no blocks the blocks for its first `upto` tokens, computing at
        most `budget` of them now: its device prefix hit, then the blocks the connector can load
        after it, then new blocks (with room for speculation when the chunk samples). With
        cache_blocks=False the new blocks are not prefix-cached (an import's: their contents
        arrive later); external: their KV is written from outside, not computed (an import's: a
        window table then gets only the blocks the token after the prompt reads).
        -> (tokens in its blocks once the load is written, tokens to compute now, the connector's
        load for the worker side to write -- connector.run_load -- or None), or why it was not
        admitted: NO_ROOM (nothing changed) or LOOKING_UP (the connector is finding its prefix off
        the engine thread: ask again once `connector.poll` names it). The scheduler only plans:
        decoding, checking and copying blocks is the worker side's."""
        kv = self.kv
        computed = kv.get_computed_blocks(req, upto)
        loadable = 0
        if self.connector is not None and req.params.prompt_logprobs is None:
            # The last token is always computed; what loads is computed with the chunk's budget.
            bs = kv.block_size
            limit = min(upto // bs, (req.num_tokens - 1) // bs, computed.num_blocks + budget // bs)
            candidates = req.block_hashes[computed.num_blocks : limit]
            snapshots = kv.states.has_snapshot if kv.states is not None else None
            loadable = (
                self.connector.lookup(req.request_id, candidates, computed.num_blocks, snapshots)
                if candidates
                else 0
            )
            if loadable is None:
                return Admission.LOOKING_UP
        cached = computed.num_tokens
        num_new = min(upto - cached, budget)
        samples = req.spec_enabled and cached + num_new == req.num_tokens
        lookahead = 2 * self.num_speculative if samples else 0
        bs, start = kv.block_size, computed.num_blocks
        num_load = min(loadable, num_new // bs)
        num_external = num_new if external else num_load * bs
        if not kv.allocate_slots(
            req, num_new, computed, cache_blocks=cache_blocks, lookahead=lookahead, num_external=num_external
        ):
            return Admission.NO_ROOM
        if not num_load:
            if self.connector is not None:
                self.connector.release(req.request_id)
            return cached, num_new, None
        # What the connector holds goes into the blocks just allocated after the hits, in every
        # table (a window's only where the first token computed after them reads).
        tables = tuple(
            [b if b != pool.null_id else NO_BLOCK for b in table[start : start + num_load]]
            for pool, table in zip(kv.pools, req.block_ids, strict=True)
        )
        hashes = req.block_hashes[start : start + num_load]
        states = ()
        if kv.states is not None:  # the state after the hit: the device's snapshot, else the connector's
            if kv.states.has_snapshot(hashes[-1]):
                kv.states.restore(req.request_id, hashes[-1])
            else:
                states = kv.states.views(req.request_id)
        load = KVLoad(hashes, tables, states, all_or_none=len(tables) > 1 or kv.states is not None)
        return cached + num_load * bs, num_new - num_load * bs, load

    def _aligned(self, start: int, num_new: int) -> int:
        """With per-request state and prefix caching, a chunk that crosses a block boundary without
        ending on one ends at the last it crosses, the rest next step: the state is snapshotted
        only where a step ends on a boundary (KVCacheManager.snapshot_state), and this puts one at
        the last full block of every prompt, where a later request with the prefix can start."""
        if self.kv.states is None or not self.kv.enable_prefix_caching:
            return num_new
        boundary = (start + num_new) // self.kv.block_size * self.kv.block_size
        return boundary - start if start < boundary < start + num_new else num_new

    def _lookahead(self, req: Request, num_new: int) -> int:
        if not req.spec_enabled or req.num_computed_tokens + num_new < req.num_tokens:
            return 0
        return 2 * self.num_speculative

    def free_blocks(self, req: Request, keep: int = 0) -> None:
        """The one place KV blocks are freed: a request's blocks after its first `keep`. Called
        when a request finishes (an exported one keeps its prompt blocks), is preempted or
        recomputed, and when an export ends (KVHandover.free_ended_exports)."""
        self.kv.free(req, keep)

    def _preempt(self, req: Request) -> None:
        req.draft_token_ids = []
        self.free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%d tokens)", req.request_id, req.num_tokens)

    def _requeue_looked_up(self) -> None:
        """Requests whose lookups finished go back to the head of the queue, in order."""
        ready = self.connector.poll()
        done = [r for r in self.waiting_for_kv if r.request_id in ready]
        for req in reversed(done):
            self.waiting_for_kv.remove(req)
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.waiting_for_kv:
            self._requeue_looked_up()
        budget = self.max_num_batched_tokens
        kv = self.kv
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._aligned(
                req.num_computed_tokens, min(req.num_tokens - req.num_computed_tokens, budget)
            )
            drafts = req.draft_token_ids if num_new == 1 and len(req.draft_token_ids) < budget else []
            while not kv.allocate_slots(req, num_new, lookahead=self._lookahead(req, num_new)):
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, num_new, list(drafts)))
                budget -= num_new + len(drafts)
                i += 1
                continue
            break

        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            admitted = self.admit(req, req.num_tokens, budget)
            if admitted is Admission.LOOKING_UP:  # others go on meanwhile
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.waiting_for_kv.append(self.waiting.popleft())
                continue
            if admitted is Admission.NO_ROOM:
                break
            num_hit_tokens, num_new, load = admitted
            num_new = self._aligned(
                num_hit_tokens, num_new
            )  # its blocks cover the unaligned chunk: no matter
            self.waiting.popleft()
            self._started(req)
            req.num_computed_tokens = num_hit_tokens
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.metrics.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_hit_tokens, num_new, kv_load=load))
            budget -= num_new

        out.num_batched_tokens = self.max_num_batched_tokens - budget
        return out

    def unadmit(self, req: Request, load: KVLoad) -> None:
        """Take back the admission of a request whose all-or-none load failed: the load's blocks
        leave the prefix cache (their contents were never written), every block goes back, and
        the request waits at the head of the queue; the connector no longer counts what failed."""
        self.kv.uncache(load.tables)
        self.running.remove(req)
        self.free_blocks(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def recompute(self, req: Request) -> None:
        """Drop a request's blocks and queue it to compute its prompt here (a KV import failed)."""
        self.free_blocks(req)
        if self.connector is not None:
            self.connector.release(req.request_id)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.add(req)

    def add_running(self, req: Request) -> None:
        """Join a request whose blocks are allocated and filled from outside (an imported KV
        transfer) to the running batch; it decodes from the next step on."""
        assert req.block_ids and req.num_computed_tokens > 0
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def finish(self, req: Request, status: RequestStatus, keep_blocks: int = 0) -> None:
        """Remove a request from the queues and free its blocks after the first `keep_blocks`
        (an exported request's prompt blocks, which its export then owns)."""
        assert status.finished
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.waiting_for_kv:
            self.waiting_for_kv.remove(req)
        else:
            self.importing.pop(req.request_id, None)
        if self.connector is not None:
            self.connector.release(req.request_id)
        self.free_blocks(req, keep_blocks)
        req.status = status
        req.metrics.finished_time = time.monotonic()
