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
from engine.kv_cache.connector import KVConnector, run_load
from engine.kv_cache.export import ExportOptions, ExportTable
from engine.kv_cache.manager import KVCacheManager, KVStats, history_blocks, size_tables
from engine.kv_cache.offload import make_offloader
from engine.kv_cache.spec import KVCacheSpec
from engine.kv_cache.transfer import KVPort
from engine.kv_handover import KVHandover
from engine.loader import check_model_folder
from engine.log import warn_limited
from engine.outputs import RequestOutput
from engine.parallel.groups import ParallelGroup
from engine.parallel.rebalance import Rebalancer, make_expert_parallel
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, kv_cache_spec
from engine.sampling_params import SamplingParams, validate_request
from engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.spec_decode.stats import SpecStats, speculation_allowed
from engine.structured.manager import StructuredOutputManager
from engine.tokenizer import Tokenizer
from engine.update import StepUpdater

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
        self.num_kv_blocks = history_blocks(self.kv_spec, self.kv_blocks)
        """The history a request can hold, in blocks (what validate_request bounds a request by)."""
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
        self.kv = KVCacheManager(
            self.kv_spec,
            self.kv_blocks,
            cfg.enable_prefix_caching,
            on_evict=self.connector.on_evict if self.connector is not None else None,
            on_evict_state=self.connector.on_evict_state if self.connector is not None else None,
            # Per-request states (DeepSeek-V4's compressors): a slot per running request, and
            # prefix snapshots (one per block boundary a step crosses) for up to 64 (or 4 per
            # running request) of the blocks that can be cached.
            num_state_slots=cfg.max_num_seqs if self.kv_spec.states else 0,
            num_state_snapshots=min(self.num_kv_blocks or 0, max(64, 4 * cfg.max_num_seqs))
            if self.kv_spec.states
            else 0,
            device=cfg.device,
        )
        """Owns the KV blocks: the scheduler and this class ask it; nothing else allocates or frees."""
        self.runner.states = self.kv.states
        self.kv_port = KVPort(self.kv_spec, self.runner.kv_caches, self.kv.states)
        """The services' only access to the cache (transfer.py says which thread may do what)."""
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
        self.handover = KVHandover(
            self.scheduler, self.kv_port, self.structured, exports if exports is not None else ExportTable()
        )
        """Disaggregated prefill: prefill-only requests' exports and KV imports (kv_handover.py)."""
        self.updater = StepUpdater(
            self.scheduler,
            self.handover,
            self.structured,
            self.spec_stats,
            self.eos_token_ids,
            self.max_model_len,
            self.requests,
            self.detokenizers,
        )
        """Applies each step's results to its requests and builds the outputs (update.py)."""
        self.step_count = 0
        self.stats: EngineStats
        """Republished after every step and by the driver after the commands it runs (publish_stats)."""
        self.publish_stats()
        self.heap = HeapTrimmer(cfg.heap_free_limit_mib << 20)
        torch.manual_seed(cfg.seed)
        logger.info(
            "engine ready: %s, %s, KV blocks per table %s of %d tokens, max_model_len %d",
            self.model_cfg.architecture,
            cfg.dtype,
            "/".join(map(str, self.kv_blocks)),
            self.kv_spec.block_size,
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
            self.kv_spec.block_size,
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
        FINISHED_EXPORTED and its prompt blocks pinned in an export (`handover.exports`, see
        KVHandover.release_export), under the options' lease. client: who it is for (a server's name for
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
        if request_id in self.requests or self.handover.holds(request_id):
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
        # An import whose READ is still being cancelled keeps its blocks until the READ has left
        # (KVHandover.reap_closed): the engine thread does not wait on a peer.
        keep = max(map(len, req.block_ids)) if self.handover.abort_import(request_id) else 0
        self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED, keep_blocks=keep)
        return self.updater.finalize(req, [], "")

    # ---- KV hand-over (engine/kv_handover.py holds the rest) -------------------------------------

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
        `handover.finish_import`; `handover.allocate_import` gives it blocks (engine/kv_handover.py);
        `abort_request` ends it."""
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
                self.updater.finalize(req, [], "")
                raise ValueError(f"sampler_state is not a valid generator state: {e}") from None
        for tok in output_token_ids:
            req.append_token(tok)
        self.detokenizers[request_id].step(list(output_token_ids))  # that text was sent by the producer
        self.handover.begin_import(req)
        return req

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or aborted imports' blocks still to free (the loop steps until they are)."""
        return (
            self.scheduler.num_unfinished > 0 or self.structured.num_held > 0 or bool(self.handover.closing)
        )

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
        waiting = sched.num_waiting + self.structured.num_held
        self.stats = EngineStats(len(sched.running), waiting, self.kv.stats())

    def _abort_unconstrainable(self, req: Request, error: str) -> RequestOutput:
        warn_limited(logger, "request %s cannot run: %s", req.request_id, error)
        req.error = error
        out = self.abort_request(req.request_id)
        assert out is not None
        return out

    def _step(self, stop: bool) -> list[RequestOutput]:
        self.handover.free_ended_exports()
        self.handover.reap_closed()
        sched = self.scheduler.schedule()
        for item in [it for it in sched.scheduled if it.kv_load is not None]:  # _load_kv may drop one
            self._load_kv(item, sched)
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
        return self.updater.apply(sched.scheduled, result, time.monotonic())

    def _load_kv(self, item: ScheduledRequest, sched: SchedulerOutput) -> None:
        """The worker side of an admission's connector load (Scheduler.admit planned it): write the
        blocks; tokens of blocks it could not give are computed in this step instead (their blocks
        are allocated, and registered for the computation). A load that is all or none (several
        tables, states) and failed is taken back: the request waits to be admitted again (a
        window table has no blocks where the loaded tokens would be computed)."""
        req = item.request
        missing = run_load(self.connector, req.request_id, item.kv_load) * self.kv.block_size
        if missing and item.kv_load.all_or_none:
            self.scheduler.unadmit(req, item.kv_load)
            sched.scheduled.remove(item)
            sched.num_batched_tokens -= item.num_new_tokens
        elif missing:
            item.num_computed_tokens -= missing
            item.num_new_tokens += missing
            req.num_computed_tokens -= missing
            sched.num_batched_tokens += missing
            if not req.metrics.num_preemptions:  # first admission: what the output reports as cached
                req.metrics.num_cached_tokens -= missing

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

    def _after_forward(self) -> None:
        if self.rebalancer is not None:
            self.rebalancer.after_step()
