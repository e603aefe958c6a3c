"""A request's KV crossing engines (disaggregated prefill): both halves, on the engine thread.

Producer: a prefill-only request ends after its first token with its prompt blocks pinned in an
export (export.py's ExportTable, under a lease) instead of freed; the services hand the export
to a decode worker, and the blocks of every export that ended (released, aborted, expired) are
freed here, at the start of every step.

Consumer: an import is a request continued here whose prompt KV is written from outside. The
scheduler holds it (Scheduler.importing: its state, counted among the waiting, admitted by the
admission every request goes through); this class holds the worker side, the sink its bytes
come through:

    EngineCore.begin_import      the request, WAITING_FOR_REMOTE_KV, holding no blocks
        -> allocate_import       Scheduler.admit_import: the prefix hit, what the connector holds
                                 (written now), new blocks -- a window table's only where the next
                                 token reads (None: no room or a lookup in flight -- retry after
                                 a step); LOADING_REMOTE_KV; the sink opens
        -> import_sink           where the transfer writes every table's blocks it must send, and
                                 the states
        -> finish_import         the blocks are prefix-cached; the request joins the running batch
        or recompute_import      the transfer failed: the prompt is computed here instead
        or EngineCore.abort_request   (abort: the sink is closed first, then the blocks freed)

Every block either side holds is freed through Scheduler.free_blocks. Not thread-safe: one
engine thread calls all of it (the services through AsyncEngine.call).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.connector import run_load
from engine.kv_cache.export import Export, ExportTable
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.transfer import ImportSink, KVPort
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.structured.manager import StructuredOutputManager


@dataclass
class KVImport:
    """A request continued here whose prompt KV comes from another engine."""

    request: Request
    sink: ImportSink
    """Writes into its blocks, from allocate_import until the import ends."""

    def close(self, wait: bool = True) -> bool:
        """Close the sink (see ImportSink.close) -> whether no remote write can land any more."""
        return self.sink.close(wait)


class KVHandover:
    def __init__(
        self,
        scheduler: Scheduler,
        kv_port: KVPort,
        structured: StructuredOutputManager,
        exports: ExportTable,
    ):
        self.scheduler = scheduler
        self.block_size = scheduler.kv.block_size
        self.kv_port = kv_port
        self.structured = structured
        self.exports = exports
        """Prefill-only requests' prompt blocks, pinned under leases."""
        self.sinks: dict[str, KVImport] = {}
        """Importing requests (the scheduler holds them: Scheduler.importing) with blocks, and the
        sinks their transfers write through, until the import ends."""
        self.closing: list[KVImport] = []
        """Aborted imports whose sink a remote write (a NIXL READ being cancelled) still holds:
        their blocks are freed once it has left (reap_closed), not while it may land."""

    def holds(self, request_id: str) -> bool:
        """The id still names KV here: a live export's, an import's or a closing import's."""
        return (
            request_id in self.scheduler.importing
            or self.exports.holds(request_id)
            or any(imp.request.request_id == request_id for imp in self.closing)
        )

    # ---- producer ------------------------------------------------------------------------------

    def export(self, req: Request) -> Export:
        """End a prefill-only request, its prompt blocks pinned in an export."""
        n, bs = req.num_prompt_tokens, self.block_size
        # Speculation may hold lookahead blocks past the prompt: those are freed.
        self.scheduler.finish(req, RequestStatus.FINISHED_EXPORTED, keep_blocks=-(-n // bs))
        hashes = req.block_hashes[: n // bs]
        if len(hashes) < n // bs:  # prefix caching off: not kept on the way
            hashes = hash_blocks(req.prompt_token_ids, bs)
        state = req.generator.get_state() if req.generator is not None else None
        nulls = tuple(pool.null_id for pool in self.scheduler.kv.pools)
        states = self.kv_port.request_states(req.request_id)
        return self.exports.add(req, hashes, state, req.kv_export, nulls, states)

    def release_export(self, request_id: str) -> bool:
        """Abort an exported request's export and free its blocks now (they stay in the prefix
        cache). False if it has no live export."""
        released = self.exports.release_request(request_id)
        self.free_ended_exports()
        return released

    def free_ended_exports(self) -> int:
        """Free the blocks of every export that ended (released, aborted, expired) since the
        last call; every step starts with it. Returns how many."""
        ended = self.exports.take_ended()
        for export in ended:
            self.scheduler.free_blocks(export.request)
        return len(ended)

    # ---- consumer ------------------------------------------------------------------------------

    def begin_import(self, req: Request) -> None:
        """Hold a new request (EngineCore.begin_import made it) until its prompt KV is in."""
        self.scheduler.begin_import(req)

    def allocate_import(self, request_id: str) -> int | None:
        """Give an importing request blocks for its prompt (Scheduler.admit_import) and open the
        sink the transfer writes them through; what the connector holds is written now, so the
        transfer sends only what is still missing. Returns how many leading prompt blocks need
        no transfer, or None when the cache has no room yet or the connector is looking its
        prefix up: retry after a step."""
        req = self.scheduler.importing[request_id]
        admitted = self.scheduler.admit_import(req)
        if admitted is None:
            return None
        cached, load = admitted
        if load is not None:
            cached -= run_load(self.scheduler.connector, request_id, load) * self.block_size
        req.metrics.num_cached_tokens = cached
        num_prompt = req.num_prompt_tokens
        prompt_blocks = -(-num_prompt // self.block_size)
        sink = self.kv_port.sink(request_id, [t[:prompt_blocks] for t in req.block_ids], num_prompt)
        self.sinks[request_id] = KVImport(req, sink)
        return cached // self.block_size

    def import_sink(self, request_id: str) -> ImportSink:
        """Where the transfer writes an importing request's prompt KV (after allocate_import)."""
        if request_id not in self.scheduler.importing:
            raise KeyError(f"request {request_id!r} is not importing")
        imp = self.sinks.get(request_id)
        if imp is None:
            raise RuntimeError(f"request {request_id!r} has no blocks yet: call allocate_import first")
        return imp.sink

    def finish_import(self, request_id: str) -> None:
        """The prompt KV is in the request's blocks: cache them and join the running batch."""
        req = self._end(request_id, done=True)
        self.structured.admit(req, self.scheduler.add_running)

    def recompute_import(self, request_id: str) -> None:
        """The transfer failed: drop the blocks and compute the prompt here instead."""
        req = self._end(request_id, done=False)
        self.structured.admit(req, self.scheduler.recompute)

    def _end(self, request_id: str, done: bool) -> Request:
        imp = self.sinks.pop(request_id, None)
        if imp is not None:
            imp.close()
        req = self.scheduler.importing[request_id]
        self.scheduler.end_import(req, done)
        return req

    def abort_import(self, request_id: str) -> bool:
        """Stop writes into an aborted request's blocks without waiting on a peer. True when a
        remote write is still being cancelled: the caller must then keep the blocks, which
        reap_closed frees once it has left; False (not importing, or nothing in flight): the caller
        frees them."""
        imp = self.sinks.pop(request_id, None)
        if imp is None or imp.close(wait=False):
            return False
        self.closing.append(imp)
        return True

    def reap_closed(self) -> int:
        """Free the blocks of aborted imports whose remote write has left; every step starts with
        it. Returns how many are still closing."""
        if self.closing:
            for imp in [imp for imp in self.closing if imp.sink.idle]:
                self.closing.remove(imp)
                self.scheduler.free_blocks(imp.request)
        return len(self.closing)
