"""Turns a SchedulerOutput into flat tensors, runs the model and samples.

Owns the model, the paged KV cache (one [num_blocks, block_size, L+R] tensor per layer) and the
sampler. Decodes are placed first in the batch so the model can run them through the absorbed
MLA path in batched calls.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig, ModelConfig
from engine.forward_batch import (
    DecodeGroup,
    ForwardBatch,
    PrefillSeq,
    TableInputs,
    block_table,
    token_tensors,
)
from engine.hugepages import WeightArena, place_parameters
from engine.kv_cache.single_type import table_slots
from engine.kv_cache.spec import KVCacheSpec, model_fingerprint
from engine.kv_cache.state import StatePool
from engine.loader import load_weights
from engine.models.registry import get_model_class
from engine.platform import compute_dtype, pick_decode_attention, use_native_kernels
from engine.sampler import Sampler, argmax, prompt_logprobs
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.spec_decode.draft_vocab import load_draft_vocab
from engine.spec_decode.drafter import draft_cap, draft_with_mtp
from engine.spec_decode.verify import verify_greedy, verify_sampled
from engine.structured.bitmask import TokenBitmask
from engine.structured.manager import StructuredOutputManager
from kernels import native
from kernels.mla import NATIVE_MAX_BATCH

logger = logging.getLogger(__name__)


def num_mtp_layers(model_cfg: ModelConfig, cfg: EngineConfig) -> int:
    """MTP layers the engine runs: one when speculative decoding drafts with MTP, else none."""
    if cfg.spec is None:
        return 0
    if model_cfg.num_nextn_predict_layers < 1:
        raise ValueError(
            "speculative_config method 'mtp' needs a checkpoint with MTP layers (num_nextn_predict_layers >= 1)"
        )
    return 1


def kv_cache_spec(model_cfg: ModelConfig, cfg: EngineConfig) -> KVCacheSpec:
    """What this engine's KV cache holds, as the model class declares it (its kv_cache_spec),
    refused by name where the engine cannot run it yet."""
    spec = get_model_class(model_cfg.architecture).kv_cache_spec(
        model_cfg,
        num_mtp_layers=num_mtp_layers(model_cfg, cfg),
        block_size=cfg.block_size,
        dtype=compute_dtype(cfg.torch_dtype, torch.device(cfg.device)),
        fingerprint=model_fingerprint(cfg.model),
    )
    spec.check_runnable()
    return spec


def table_inputs(spec: KVCacheSpec, t: int, items: list[ScheduledRequest], device) -> TableInputs:
    """Block table t's view of a step whose items are in the batch's order (decodes of equal query
    length together, as `ModelRunner._build_batch` groups them, then the prefills)."""
    bs, table = spec.block_size, spec.tables[t]
    slots: list[int] = []
    groups: list[tuple[int, list[list[int]]]] = []  # (query length, each request's blocks)
    prefills = []
    for item in items:
        start, n = item.num_computed_tokens, item.query_len
        blocks = item.request.block_ids[t]
        slots += table_slots(table, bs, blocks, range(start, start + n))
        if item.is_decode:
            if not groups or groups[-1][0] != n:
                groups.append((n, []))
            groups[-1][1].append(blocks)
        else:
            prefills.append(torch.tensor(blocks[: -(-(start + n) // bs)], dtype=torch.long))
    return TableInputs(
        t,
        torch.tensor(slots, dtype=torch.long, device=device),
        [block_table(tables, device) for _, tables in groups],
        prefills,
    )


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]] = field(default_factory=dict)
    """request_id -> the tokens to append, for requests whose chunk reached their last token: one,
    or with speculative drafts the accepted drafts plus the target's next token."""
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """request_id -> draft tokens proposed by the MTP layer to follow the appended ones."""
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    """request_id -> logprobs of the sampled token and the top-N, when requested."""
    prompt_logprobs: dict[str, list[dict[int, float]]] = field(default_factory=dict)
    """request_id -> logprobs of the prompt tokens this chunk predicted, in order."""


class ModelRunner:
    def __init__(
        self,
        model_cfg: ModelConfig,
        cfg: EngineConfig,
        kv_spec: KVCacheSpec,
        max_model_len: int,
        kv_blocks: int | tuple[int, ...],
        eos_token_ids: tuple[int, ...],
        ep=None,
        structured: StructuredOutputManager | None = None,
    ):
        """kv_spec: from kv_cache_spec(); ep: an engine.parallel.ep_moe.ExpertParallel (this rank
        then loads only its experts); structured: fills the token bitmask of requests with a
        structured-output matcher (without it, none may have one)."""
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.block_size = kv_spec.block_size
        self.kv_table = kv_spec.table_index(kv_spec.groups[0].kind)
        """The block table of the spec's first group (the latent caches', DeepSeek-V4's window):
        the batch's slot mapping and block tables are in it."""
        self.other_tables = [t for t in range(len(kv_spec.tables)) if t != self.kv_table]
        """A hybrid spec's other block tables: the batch carries their slots and blocks too."""
        self.dtype = compute_dtype(cfg.torch_dtype, self.device)
        self.native_kernels = use_native_kernels(self.dtype, self.device)
        """Decode's one-row products run in kernels/native (bf16 on a CPU with AVX512F: engine/platform.py)."""
        if cfg.batch_invariant and not self.native_kernels:
            raise ValueError(
                "batch_invariant needs the native bf16 kernels (dtype bfloat16 on a CPU with AVX512F or AVX2); "
                f"this engine computes in {str(self.dtype).removeprefix('torch.')} on {self.device.type}"
            )
        self.threads = torch.get_num_threads()  # the engine's, set before the runner is built
        self.spec = cfg.spec
        self.num_mtp_layers = num_mtp_layers(model_cfg, cfg)
        self.max_model_len = max_model_len
        draft_vocab = None  # read before the weights, so a bad file fails fast
        if self.spec is not None and self.spec.draft_vocab is not None:
            draft_vocab = load_draft_vocab(self.spec.draft_vocab, model_cfg.vocab_size)
        model_cls = get_model_class(model_cfg.architecture)
        with torch.device(self.device):
            self.model = model_cls(
                model_cfg,
                dtype=self.dtype,
                max_positions=max_model_len,
                ep=ep,
                num_mtp_layers=self.num_mtp_layers,
            )
        # The weights on huge pages, a layer's together (engine/hugepages.py), read there from the
        # checkpoint: loading holds them once, plus one tensor of the checkpoint at a time.
        arena = WeightArena()
        place_parameters(self.model, arena, values=False)
        load_weights(
            self.model, model_cfg, cfg.model, expert_map=ep.local_experts if ep is not None else None
        )
        self.model.process_weights(arena.place)
        self.weight_bytes = arena.placed_bytes
        """Bytes of the weights as the engine keeps them: the checkpoint's and those derived at load."""
        if draft_vocab is not None:
            self.model.use_draft_vocab(draft_vocab)
        self.model.eval()
        self.states: StatePool | None = None
        """The per-request state pool, where the spec has states (the engine sets it with its KV
        cache manager's)."""
        if self.native_kernels and model_cfg.v4 is None:  # on the AMX tiles or through VDPBF16PS
            pick_decode_attention(
                model_cfg.num_attention_heads,
                model_cfg.kv_lora_rank,
                model_cfg.qk_rope_head_dim,
                self.block_size,
                cfg.max_num_seqs,
            )
        self.kv_spec = kv_spec
        start = time.perf_counter()
        self.kv_caches = kv_spec.allocate(kv_blocks, self.device, cfg.kv_prefault)  # the MTP group last
        if cfg.kv_prefault:
            logger.info(
                "KV cache resident from the start: %d MiB in %.2f s",
                sum(c.numel() * c.element_size() for c in self.kv_caches) >> 20,
                time.perf_counter() - start,
            )
        self.sampler = Sampler(model_cfg.vocab_size, eos_token_ids)
        self.structured = structured

    def _build_batch(
        self, items: list[ScheduledRequest]
    ) -> tuple[ForwardBatch, list[int], list[tuple[int, int]]]:
        """items: decodes first, those of equal query length together (see `execute`).
        -> (batch, sample_rows, prompt_rows): sample_rows[i] is the logits row of items[i] if it
        samples (else -1); prompt_rows[i] = (first logits row, first target token index, count) of
        its prompt-logprob positions."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSeq] = []
        groups: list[tuple[int, int, list[list[int]], list[int]]] = []  # (start, s, tables, seq lens)
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int]] = []
        for item in items:
            req, start, n = item.request, item.num_computed_tokens, item.query_len
            q_start = len(input_ids)
            input_ids.extend(req.token_ids[start : start + item.num_new_tokens])
            input_ids.extend(item.draft_token_ids)  # verified in this forward
            positions.extend(range(start, start + n))
            blocks = req.block_ids[self.kv_table]
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            if item.is_decode:
                if not groups or groups[-1][1] != n:
                    groups.append((q_start, n, [], []))
                groups[-1][2].append(blocks)
                groups[-1][3].append(start + n)
            else:
                ctx = start + n
                prefills.append(
                    PrefillSeq(q_start, n, ctx, torch.tensor(blocks[: -(-ctx // bs)], dtype=torch.long))
                )
            # Prompt logprobs: position p predicts token p + 1; only prompt targets not yet reported.
            first_target = max(start + 1, len(req.prompt_logprobs))  # it starts as [None]
            last_target = min(start + n, req.num_prompt_tokens - 1)
            if req.wants_prompt_logprobs and first_target <= last_target:
                prompt_rows.append((len(logits_indices), first_target, last_target - first_target + 1))
                logits_indices.extend(q_start + (t - 1 - start) for t in range(first_target, last_target + 1))
            else:
                prompt_rows.append((-1, 0, 0))
            if item.samples:
                sample_rows.append(len(logits_indices))
                first = q_start + n - 1 - len(item.draft_token_ids)  # the last known token, then each draft
                logits_indices.extend(range(first, q_start + n))
            else:
                sample_rows.append(-1)
        dev = self.device
        ids, pos, slot_mapping = token_tensors(input_ids, positions, slots, dev)
        batch = ForwardBatch(
            input_ids=ids,
            positions=pos,
            slot_mapping=slot_mapping,
            decodes=[DecodeGroup.of(start, s_q, tables, lens, dev) for start, s_q, tables, lens in groups],
            prefills=prefills,
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=dev),
            tables=tuple(table_inputs(self.kv_spec, t, items, dev) for t in self.other_tables),
        )
        if self.states is not None:
            batch.states = self.states.tensors
            batch.state_rows = torch.tensor(
                [self.states.row(item.request.request_id) for item in items], dtype=torch.long, device=dev
            )
            batch.snapshots = [self._snapshot_rows(item) for item in items]
        return batch, sample_rows, prompt_rows

    def _snapshot_rows(self, item: ScheduledRequest) -> list[tuple[int, int]]:
        """Prefix snapshots of the state at the block boundaries the item's chunk crosses, where
        the block is hashed (prefix caching) and none is kept yet: [(boundary, pool row)]."""
        bs, req = self.block_size, item.request
        start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
        rows = []
        for b in range((start // bs + 1) * bs, min(end, len(req.block_hashes) * bs) + 1, bs):
            row = self.states.reserve_snapshot(req.block_hashes[b // bs - 1])
            if row is not None:
                rows.append((b, row))
        return rows

    @torch.inference_mode()
    def execute_dummy(self) -> None:
        """One token through the model, writing no KV and sampling nothing: what an idle rank runs
        so that the expert-parallel collectives of a step match on every rank."""
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.zeros(1, dtype=torch.long, device=dev),
            positions=torch.zeros(1, dtype=torch.long, device=dev),
            slot_mapping=torch.full((1,), -1, dtype=torch.long, device=dev),
            decodes=[],
            prefills=[PrefillSeq(0, 1, 1, torch.zeros(1, dtype=torch.long))],
            logits_indices=torch.zeros(0, dtype=torch.long, device=dev),
        )
        self._share_native_work(batch)
        self.model(batch, self.kv_caches)

    def _grammar_bitmask(
        self, items: list[ScheduledRequest], sample_rows: list[int]
    ) -> Future[TokenBitmask] | None:
        """The step's structured-output bitmask, filled while the model runs: the rows of every
        sampling request with a matcher, its drafts' rows included (a draft the constraint refuses
        is then never accepted)."""
        entries = [
            (it.request, row, it.draft_token_ids)
            for it, row in zip(items, sample_rows, strict=True)
            if row >= 0 and it.request.grammar is not None
        ]
        if not entries:
            return None
        assert self.structured is not None, "a request has a grammar but the runner has no structured outputs"
        return self.structured.bitmask(entries)

    def _share_native_work(self, batch: ForwardBatch) -> None:
        """A decode step that runs all its work in the native kernels (attention, products,
        experts, LM head): up to NATIVE_MAX_BATCH tokens (batch 1, a speculative verification),
        each layer in its one-call kernels, or a step the model runs as one native call
        (runs_in_one_call: up to native.max_rows() tokens where the attention runs on the AMX
        tile unit). They share it over their own pool, whose caller never waits on a helper that
        is not running, and torch's few small ops in it (the logits' argmax, an index) stay on
        one thread.
        Other steps leave it to torch's OpenMP threads: the two pools spinning at once on the same
        cores starve each other (kernels/native/common.h has the figures; an MTP step's argmax
        over 2 rows of logits woke OpenMP's threads and cost the native calls after it 160 µs).
        Process-wide, like torch's thread count; set every step, so engines sharing a process
        each get theirs."""
        if self.native_kernels:
            native.set_batch_invariant(self.cfg.batch_invariant)
            few = not batch.prefills and batch.input_ids.numel() <= NATIVE_MAX_BATCH
            native_step = few or self.model.runs_in_one_call(batch, self.kv_caches)
            native.use_pool(self.threads if native_step else 0)
            torch.set_num_threads(1 if native_step else self.threads)

    def _argmax_only(self, items: list[ScheduledRequest], sample_rows: list[int], prompt_rows) -> bool:
        """Whether each logits row's argmax is all the step needs: no prompt logprobs, and every
        request that samples (or verifies drafts) is plain greedy (Sampler.only_argmax)."""
        return all(count == 0 for _, _, count in prompt_rows) and self.sampler.only_argmax(
            [it.request for it, row in zip(items, sample_rows, strict=True) if row >= 0]
        )

    def _greedy_spec_step(
        self, items: list[ScheduledRequest], batch: ForwardBatch, sample_rows: list[int]
    ) -> RunnerOutput | None:
        """A step of greedy decodes (the caller has found every logits row's argmax all it needs)
        that all speculate, of one query length (each verifying its drafts, or none), as one native
        call: the model's forward, verify_greedy and draft_with_mtp's tokens, drafts and MTP cache
        rows in one (the model's greedy_spec_step). At batch 1 their Python between the native calls
        cost a step with a draft twice a plain step's. None: the step is not such a step, or the
        model does not run it in one call."""
        if (
            batch.prefills
            or len(batch.decodes) != 1
            or not all(
                it.request.spec_enabled and row >= 0 for it, row in zip(items, sample_rows, strict=True)
            )
        ):
            return None
        k, limit = self.spec.num_speculative_tokens, self.spec.disable_by_batch_size
        if limit is not None and len(items) >= limit:
            k = 0  # no drafts this step (the MTP cache rows are still written)
        caps = [draft_cap(it.request, self.max_model_len) for it in items]
        result = self.model.greedy_spec_step(batch, self.kv_caches, caps, k)
        if result is None:
            return None
        tokens, accepted, drafts = result
        s, out = batch.decodes[0].query_len, RunnerOutput()
        for i, it in enumerate(items):
            rid = it.request.request_id
            out.sampled[rid] = tokens[i * s : i * s + accepted[i] + 1]
            if drafts[i] and drafts[i][0] >= 0:
                out.drafts[rid] = [t for t in drafts[i] if t >= 0]
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # Decodes first, grouped by query length: the model runs each group as one absorbed-MLA call.
        items = sorted(sched.scheduled, key=lambda it: (not it.is_decode, it.query_len))
        batch, sample_rows, prompt_rows = self._build_batch(items)
        self._share_native_work(batch)
        filling = self._grammar_bitmask(items, sample_rows)
        argmax_only = filling is None and self._argmax_only(items, sample_rows, prompt_rows)
        if argmax_only and self.spec is not None:
            out = self._greedy_spec_step(items, batch, sample_rows)
            if out is not None:
                return out
        hidden = self.model(batch, self.kv_caches)
        out = RunnerOutput()
        if argmax_only:
            # The common greedy step (decodes, and greedy verifications of drafts): each logits
            # row's argmax, from the bf16 logits, nothing widened.
            greedy = self.model.greedy_tokens(hidden[batch.logits_indices], self.sampler.vocab_size)
            for it, row in zip(items, sample_rows, strict=True):
                if row >= 0:  # a sampled token is a verification without drafts
                    end = row + len(it.draft_token_ids) + 1
                    out.sampled[it.request.request_id] = verify_greedy(greedy[row:end], it.draft_token_ids)
            if self.spec is not None:
                draft_with_mtp(self, items, batch, hidden, out)
            return out
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [M, V] float32
        samplers = [
            (it, row)
            for it, row in zip(items, sample_rows, strict=True)
            if row >= 0 and not it.draft_token_ids
        ]
        # Structured output: one bitmask for every constrained row of the step, the sampled rows
        # and each speculating request's verification rows (masked here: the sampler masks its own
        # rows after taking their raw logprobs).
        bitmask = filling.result() if filling is not None else None
        if bitmask is not None:
            bitmask.without([row for _, row in samplers]).apply(logits)
        if samplers:
            sampler_rows = [row for _, row in samplers]
            if sampler_rows == list(range(logits.shape[0])):  # every row (a decode step): no gather
                sampled_logits = logits
            else:
                sampled_logits = logits[torch.tensor(sampler_rows, dtype=torch.long, device=logits.device)]
            result = self.sampler(
                sampled_logits,
                [it.request for it, _ in samplers],
                bitmask=bitmask.select(sampler_rows) if bitmask is not None else None,
            )
            for (it, _), token, lps in zip(samplers, result.token_ids, result.logprobs, strict=True):
                out.sampled[it.request.request_id] = [token]
                if lps is not None:
                    out.logprobs[it.request.request_id] = lps
        greedy = None  # the target's greedy token at every logits row, fetched once for the step
        for it, row in zip(items, sample_rows, strict=True):
            if it.draft_token_ids:
                req, end = it.request, row + len(it.draft_token_ids) + 1
                if req.params.greedy:
                    greedy = argmax(logits).tolist() if greedy is None else greedy
                    out.sampled[req.request_id] = verify_greedy(greedy[row:end], it.draft_token_ids)
                else:
                    out.sampled[req.request_id] = verify_sampled(
                        logits[row:end], it.draft_token_ids, req.params, req.generator
                    )
        if self.spec is not None:
            draft_with_mtp(self, items, batch, hidden, out)

        for it, (first, first_target, count) in zip(items, prompt_rows, strict=True):
            if count:
                req = it.request  # (speculation is off for prompt-logprob requests)
                targets = torch.tensor(
                    req.token_ids[first_target : first_target + count], device=logits.device
                )
                out.prompt_logprobs[req.request_id] = prompt_logprobs(
                    logits[first : first + count], targets, req.params.prompt_logprobs
                )
        return out
