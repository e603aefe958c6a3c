"""The engine's step loop: schedule -> execute -> update.

`add_request` validates everything about a request before it enters the queues, so a bad
request raises `ValueError` (naming the field and the limit) and the running ones are
untouched. `step` runs one batch and returns an output for every request that produced a token
or finished. Not thread-safe: one thread owns an EngineCore (the services run it in their own
engine thread).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import env
from engine.config import EngineConfig, ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.heap import HeapTrimmer
from engine.kv_cache.connector import KVConnector
from engine.kv_cache.export import Export, ExportOptions, ExportTable
from engine.kv_cache.hashing import hash_blocks
from engine.kv_cache.manager import KVCacheManager, KVStats, size_tables
from engine.kv_cache.offload import make_offloader
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import ImportSink, KVPort
from engine.loader import check_model_folder
from engine.log import warn_limited
from engine.outputs import RequestOutput
from engine.parallel.groups import ParallelGroup
from engine.parallel.rebalance import Rebalancer, make_expert_parallel
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, kv_cache_spec
from engine.sampling_params import SamplingParams, validate_request
from engine.scheduler import Admission, ScheduledRequest, Scheduler
from engine.spec_decode.stats import SpecStats, speculation_allowed
from engine.structured.manager import StructuredOutputManager
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01
"""How long an engine whose only requests wait for their structured-output grammar blocks on
the compile per step (instead of spinning)."""


def _generation_eos(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


@dataclass(frozen=True)
class EngineStats:
    """The engine after its last step, for other threads: a worker's /metrics, load reports and
    registry record read this snapshot, never the scheduler's or the KV manager's own state."""

    num_running: int
    num_waiting: int
    """Queued, waiting for a grammar, for remote KV or for an import's blocks."""
    kv: KVStats


@dataclass
class KVImport:
    """A request continued here whose prompt KV comes from another engine."""

    request: Request
    sink: ImportSink | None = None
    """Writes into its blocks, from allocate_import until the import ends."""

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


class EngineCore:
    def __init__(
        self,
        cfg: EngineConfig,
        group: ParallelGroup | None = None,
        connector: Callable[[KVCacheSpec, list[torch.Tensor]], KVConnector] | None = None,
        exports: ExportTable | None = None,
    ):
        """group: this rank's DP/EP group (expert parallelism); every rank of it must call step()
        the same number of times. connector: builds the KV connector from the spec and the
        caches, instead of the one cfg asks for (embedders, tests). exports: where prefill-only
        requests' KV is pinned, with the embedder's lease limits (default: ExportTable())."""
        torch.set_num_threads(cfg.num_threads or env.num_threads() or env.available_cores())
        folder = check_model_folder(cfg.model)
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_pretrained(folder)
        self.tokenizer = Tokenizer(folder)
        max_pos = self.model_cfg.max_position_embeddings
        if cfg.max_model_len is not None and cfg.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len ({cfg.max_model_len}) exceeds the model's max_position_embeddings ({max_pos})"
            )
        self.max_model_len = cfg.max_model_len or max_pos
        eos = [*self.model_cfg.eos_token_ids, *_generation_eos(folder)]
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(dict.fromkeys(eos))

        self.kv_spec = kv_cache_spec(self.model_cfg, cfg)
        self.kv_blocks = size_tables(
            self.kv_spec,
            int(cfg.kv_cache_memory_gib * 2**30),
            cfg.max_num_seqs,
            self.max_model_len,
            cfg.max_num_batched_tokens,
            lookahead=2 * cfg.spec.num_speculative_tokens if cfg.spec else 0,
            num_blocks=cfg.num_kv_blocks,
        )
        """Engine blocks per block table (KVCacheSpec.tables)."""
        self.num_kv_blocks = self.kv_blocks[0]
        """The history a request can hold, in blocks: the first table's, full attention (the one
        table of every spec the engine runs: KVCacheSpec.check_runnable)."""
        self.group = group
        self.ep = make_expert_parallel(cfg, self.model_cfg, group) if group is not None else None
        self.structured = StructuredOutputManager(
            self.tokenizer.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids
        )
        """Compiles constraints off the engine thread, holds their requests until ready, fills
        the token bitmask."""
        self.runner = ModelRunner(
            self.model_cfg,
            cfg,
            self.kv_spec,
            self.max_model_len,
            self.kv_blocks,
            self.eos_token_ids,
            ep=self.ep,
            structured=self.structured,
        )
        self.rebalancer = (
            Rebalancer(self.ep, self.runner.model, cfg) if self.ep is not None and cfg.eplb_interval else None
        )
        self.stop_requested = False
        """Set on every rank of a group at the step where all ranks asked to stop (see step)."""
        make_connector = connector or (lambda spec, caches: make_offloader(cfg, spec, caches))
        self.connector = make_connector(self.kv_spec, self.runner.kv_caches)
        """The KV connector (the offload tiers) when one is configured."""
        self.kv_port = KVPort(self.kv_spec, self.runner.kv_caches)
        """The services' only access to the cache (transfer.py says which thread may do what)."""
        self.kv = KVCacheManager(
            self.kv_spec,
            self.kv_blocks,
            cfg.enable_prefix_caching,
            on_evict=self.connector.on_evict if self.connector is not None else None,
        )
        """Owns the KV blocks: the scheduler and this class ask it; nothing else allocates or frees."""
        self.spec = cfg.spec
        self.scheduler = Scheduler(
            self.kv,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            num_speculative=self.spec.num_speculative_tokens if self.spec else 0,
            connector=self.connector,
        )
        self.spec_stats = SpecStats(self.spec.num_speculative_tokens if self.spec else 0)
        self.requests: dict[str, Request] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.exports = exports if exports is not None else ExportTable()
        """Prefill-only requests' prompt blocks, pinned under leases (disaggregated prefill)."""
        self.importing: dict[str, KVImport] = {}
        """Requests whose prompt KV is written from outside (a KV transfer), until it is in."""
        self.step_count = 0
        self.stats: EngineStats
        """Republished after every step and by the driver after the commands it runs (publish_stats)."""
        self.publish_stats()
        self.heap = HeapTrimmer(cfg.heap_free_limit_mib << 20)
        torch.manual_seed(cfg.seed)
        logger.info(
            "engine ready: %s, %s, %d KV blocks of %d tokens, max_model_len %d",
            self.model_cfg.architecture,
            cfg.dtype,
            self.num_kv_blocks,
            cfg.block_size,
            self.max_model_len,
        )

    # ---- requests -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; changes nothing. A structured-output
        constraint is compiled (through the cache) to find its errors, which may take a while
        the first time: call it off the engine thread or before stepping (LLM.generate does)."""
        self._check(prompt_token_ids, params)
        self.structured.check(params.structured_outputs)

    def _check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The checks of validate that cost next to nothing (run on every request added)."""
        validate_request(
            prompt_token_ids,
            params,
            self.model_cfg.vocab_size,
            self.max_model_len,
            self.cfg.block_size,
            self.num_kv_blocks,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        kv_export: bool | ExportOptions = False,
        client: str = "",
    ) -> Request:
        """Queue a request. kv_export: prefill only; it ends after its first token with status
        FINISHED_EXPORTED and its prompt blocks pinned in an export (`exports`, see
        release_export), under the options' lease. client: who it is for (a server's name for
        its client): waiting requests are taken fairly among clients (Scheduler.add)."""
        req = self._new_request(request_id, prompt_token_ids, params, prompt)
        req.client = client
        req.kv_export = ExportOptions() if kv_export is True else kv_export or None
        self.structured.admit(req, self.scheduler.add)
        return req

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> Request:
        # A finished prefill-only request still owns its pinned blocks under its id until its
        # export ends and the blocks are freed: reusing the id would orphan them.
        if request_id in self.requests or self.exports.holds(request_id) or request_id in self.importing:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self._check(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, prompt=prompt)
        req.spec_enabled = self.spec is not None and speculation_allowed(params)
        self.requests[request_id] = req
        self.structured.submit(req)
        self.detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer.tokenizer,
            req.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
        )
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self.structured.discard(request_id)
        imp = self.importing.pop(request_id, None)
        if imp is not None:
            imp.close()  # no transfer writes into the blocks from here on; finish frees them
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        return self._finalize(req, [], "")

    # ---- KV transfer: the producer side ------------------------------------------------------

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

    # ---- KV transfer: the consumer side ------------------------------------------------------

    def begin_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        generator_state: torch.Tensor | None = None,
    ) -> Request:
        """Create a request that continues after output_token_ids (sampled elsewhere) once its
        prompt KV has been written into its blocks from outside. It is not scheduled until
        `finish_import`; `allocate_import` gives it blocks; `abort_request` ends it."""
        if not output_token_ids:
            raise ValueError("output_token_ids must hold the prefill worker's first token")
        if len(output_token_ids) >= params.max_tokens:
            raise ValueError(
                f"{len(output_token_ids)} tokens already generated, max_tokens is {params.max_tokens}"
            )
        vocab = self.model_cfg.vocab_size
        for i, tok in enumerate(output_token_ids):
            if not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(f"output_token_ids[{i}] = {tok!r} is outside the vocabulary [0, {vocab})")
        if generator_state is not None and params.seed is None:
            raise ValueError("sampler_state is set but the request has no seed")
        req = self._new_request(request_id, prompt_token_ids, params, None)
        if generator_state is not None:
            try:
                req.generator.set_state(generator_state)
            except (RuntimeError, TypeError) as e:
                self._finalize(req, [], "")
                raise ValueError(f"sampler_state is not a valid generator state: {e}") from None
        for tok in output_token_ids:
            req.append_token(tok)
        self.detokenizers[request_id].step(list(output_token_ids))  # that text was sent by the producer
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.importing[request_id] = KVImport(req)
        return req

    def allocate_import(self, request_id: str) -> int | None:
        """Give an importing request blocks for its prompt, reusing prefix-cache hits and what the
        connector holds. Returns how many leading prompt blocks need no transfer, or None when
        that is not known yet (the connector is looking them up) or the cache has no room yet:
        retry after a step."""
        imp = self.importing[request_id]
        req = imp.request
        num_prompt = req.num_prompt_tokens
        admitted = self.scheduler.admit(req, num_prompt, num_prompt, cache_blocks=False)
        if isinstance(admitted, Admission):
            return None
        cached, _ = admitted
        req.status = RequestStatus.LOADING_REMOTE_KV
        req.metrics.num_cached_tokens = cached
        imp.sink = self.kv_port.sink(request_id, req.block_ids[0][: -(-num_prompt // self.cfg.block_size)])
        return cached // self.cfg.block_size

    def import_sink(self, request_id: str) -> ImportSink:
        """Where the transfer writes an importing request's prompt KV (after allocate_import)."""
        sink = self.importing[request_id].sink
        if sink is None:
            raise RuntimeError(f"request {request_id!r} has no blocks yet: call allocate_import first")
        return sink

    def finish_import(self, request_id: str) -> None:
        """The prompt KV is in the request's blocks: cache them and join the running batch."""
        imp = self.importing.pop(request_id)
        imp.close()
        req = imp.request
        req.num_computed_tokens = req.num_prompt_tokens
        self.kv.cache_blocks(req, req.num_computed_tokens)
        req.metrics.first_scheduled_time = time.monotonic()
        self.structured.admit(req, self.scheduler.add_running)

    def recompute_import(self, request_id: str) -> None:
        """The transfer failed: drop the blocks and compute the prompt here instead."""
        imp = self.importing.pop(request_id)
        imp.close()
        self.structured.admit(imp.request, self.scheduler.recompute)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self.structured.num_held > 0

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    # ---- the step --------------------------------------------------------------------------

    def step(self, stop: bool = False) -> list[RequestOutput]:
        """One schedule -> execute -> update. In a group, every rank calls it in lockstep: ranks
        first agree whether any has work (a rank without runs a dummy batch) and whether all asked
        to stop. Requests whose structured-output grammar got ready join the queues first; those
        that cannot run (an invalid constraint) end as aborted."""
        if self.structured.num_held and not self.scheduler.num_unfinished:
            self.structured.wait(GRAMMAR_WAIT_S)
        failed = [self._abort_unconstrainable(req, error) for req, error in self.structured.poll()]
        outputs = self._step(stop)
        self.publish_stats()
        return failed + outputs if failed else outputs

    def publish_stats(self) -> None:
        """Snapshot the queues and the KV memory into `stats` (engine thread only)."""
        sched = self.scheduler
        waiting = (
            len(sched.waiting) + len(sched.waiting_for_kv) + len(self.importing) + self.structured.num_held
        )
        self.stats = EngineStats(len(sched.running), waiting, self.kv.stats())

    def _abort_unconstrainable(self, req: Request, error: str) -> RequestOutput:
        warn_limited(logger, "request %s cannot run: %s", req.request_id, error)
        req.error = error
        out = self.abort_request(req.request_id)
        assert out is not None
        return out

    def _step(self, stop: bool) -> list[RequestOutput]:
        self.free_ended_exports()
        sched = self.scheduler.schedule()
        if self.group is not None:
            busy, self.stop_requested = self.group.sync(not sched.empty, stop)
            if not busy or self.stop_requested:
                return []
            if sched.empty:
                self.runner.execute_dummy()
                self._after_forward()
                return []
        elif sched.empty:
            return []
        try:
            result = self.runner.execute(sched)
        except Exception:
            logger.exception(
                "step %d failed; batch: %s",
                self.step_count,
                [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in sched.scheduled],
            )
            raise
        self.step_count += 1
        self._after_forward()
        self.heap.maybe_trim(prefilled=any(not it.is_decode for it in sched.scheduled))
        now = time.monotonic()
        outputs = []
        for item in sched.scheduled:
            out = self._update(item, result, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def parallel_stats(self) -> dict:
        """Expert-parallel state of this rank: placement and EPLB results (empty without EP)."""
        if self.ep is None:
            return {}
        stats = {"rank": self.group.rank, "phy2log": self.ep.placement.phy2log.tolist(), "eplb_rebalances": 0}
        if self.rebalancer is not None:
            stats["eplb_rebalances"] = self.rebalancer.num_rebalances
            stats["balance_ratio"] = self.rebalancer.last_ratio
            stats["rank_load"] = self.rebalancer.last_rank_load
        return stats

    def _update(self, item: ScheduledRequest, result, now: float) -> RequestOutput | None:
        """Apply one request's step result: computed tokens, new tokens (with speculation, the
        accepted drafts and the target's token), stop checks, drafts for the next step."""
        req = item.request
        req.num_computed_tokens += item.num_new_tokens
        if req.request_id in result.prompt_logprobs:
            req.prompt_logprobs.extend(result.prompt_logprobs[req.request_id])
        tokens = result.sampled.get(req.request_id)
        req.draft_token_ids = []
        if not tokens:
            return None
        if item.draft_token_ids:  # the accepted drafts' KV is valid now
            self.spec_stats.record(len(item.draft_token_ids), len(tokens) - 1)
            req.num_computed_tokens += len(tokens) - 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        detokenizer = self.detokenizers[req.request_id]
        new_ids, new_text, status, detok = [], "", None, None
        for token in tokens:
            req.append_token(token)
            new_ids.append(token)
            if req.request_id in result.logprobs:
                req.logprobs.append(result.logprobs[req.request_id])
            detok = detokenizer.step([token])
            new_text += detok.text
            status = self._check_stop(req, token, detok.stop_matched)
            if status is None and req.grammar is not None:
                status = self.structured.advance(req, token)
            if status is not None:
                break
        if item.draft_token_ids:
            self.kv.cache_blocks(req, req.num_computed_tokens, start=item.num_computed_tokens)
        if status is None and req.kv_export:
            status = RequestStatus.FINISHED_EXPORTED
        if status is None:
            req.draft_token_ids = result.drafts.get(req.request_id, [])
            return self._output(req, new_ids, new_text)
        # An exported request's text goes on at the decode side: hold back what is held back.
        if detok.stop_matched is None and status is not RequestStatus.FINISHED_EXPORTED:
            new_text += detokenizer.finish()  # flushing held-back text may still match a stop string
            if detokenizer.stop_matched is not None:
                req.stop_reason, status = detokenizer.stop_matched, RequestStatus.FINISHED_STOPPED
        export = None
        if status is RequestStatus.FINISHED_EXPORTED:
            export = self._export(req)
        else:
            self.scheduler.finish(req, status)
        out = self._finalize(req, new_ids, new_text)
        out.exported_kv = export
        return out

    def _export(self, req: Request) -> Export:
        """End a prefill-only request, its prompt blocks pinned in an export."""
        n, bs = req.num_prompt_tokens, self.cfg.block_size
        # Speculation may hold lookahead blocks past the prompt: those are freed.
        self.scheduler.finish(req, RequestStatus.FINISHED_EXPORTED, keep_blocks=-(-n // bs))
        hashes = req.block_hashes[: n // bs]
        if len(hashes) < n // bs:  # prefix caching off: not kept on the way
            hashes = hash_blocks(req.prompt_token_ids, bs)
        state = req.generator.get_state() if req.generator is not None else None
        return self.exports.add(req, hashes, state, req.kv_export)

    def _after_forward(self) -> None:
        if self.rebalancer is not None:
            self.rebalancer.after_step()

    def _check_stop(self, req: Request, token: int, stop_string: str | None) -> RequestStatus | None:
        params = req.params
        if stop_string is not None:
            req.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(
        self, req: Request, new_ids: list[int], new_text: str, finished: bool = False
    ) -> RequestOutput:
        status = req.status
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids,
            text=self.detokenizers[req.request_id].text,
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            new_logprobs=req.logprobs[len(req.logprobs) - len(new_ids) :]
            if req.params.logprobs is not None
            else None,
            prompt_logprobs=req.prompt_logprobs if req.params.prompt_logprobs is not None else None,
            finished=finished,
            finish_reason=status.value if finished else None,
            stop_reason=req.stop_reason,
            metrics=req.metrics,
            error=req.error if finished else None,
        )

    def _finalize(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        out = self._output(req, new_ids, new_text, finished=True)
        del self.requests[req.request_id]
        del self.detokenizers[req.request_id]
        return out
