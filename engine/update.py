"""The step loop's update (schedule -> execute -> update): a step's results applied to the requests
that ran -- computed tokens, accepted drafts, new tokens and their text, stop checks -- and the
outputs built from them. A request that ends here is finished through the scheduler (its blocks
freed) or, prefill-only, handed to an export (engine/kv_handover.py).

The requests and their detokenizers are EngineCore's tables (it adds to them at admission); the
updater reads them and removes a request when it builds its final output (`finalize`). Engine
thread only.
"""

from __future__ import annotations

from engine.detokenizer import IncrementalDetokenizer
from engine.kv_handover import KVHandover
from engine.outputs import RequestOutput
from engine.request import Request, RequestStatus
from engine.runner import RunnerOutput
from engine.scheduler import ScheduledRequest, Scheduler
from engine.spec_decode.stats import SpecStats
from engine.structured.manager import StructuredOutputManager


class StepUpdater:
    def __init__(
        self,
        scheduler: Scheduler,
        handover: KVHandover,
        structured: StructuredOutputManager,
        spec_stats: SpecStats,
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        requests: dict[str, Request],
        detokenizers: dict[str, IncrementalDetokenizer],
    ):
        self.scheduler = scheduler
        self.handover = handover
        self.structured = structured
        self.spec_stats = spec_stats
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.requests = requests
        self.detokenizers = detokenizers

    def apply(self, items: list[ScheduledRequest], result: RunnerOutput, now: float) -> list[RequestOutput]:
        """Every scheduled request's result -> the outputs of those that produced a token or finished."""
        outputs = []
        for item in items:
            out = self.update(item, result, now)
            if out is not None:
                outputs.append(out)
        return outputs

    def update(self, item: ScheduledRequest, result: RunnerOutput, now: float) -> RequestOutput | None:
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
            status = self.check_stop(req, token, detok.stop_matched)
            if status is None and req.grammar is not None:
                status = self.structured.advance(req, token)
            if status is not None:
                break
        if item.draft_token_ids:
            self.scheduler.kv.cache_blocks(req, req.num_computed_tokens, start=item.num_computed_tokens)
        if status is None and req.kv_export:
            status = RequestStatus.FINISHED_EXPORTED
        if status is None:
            req.draft_token_ids = result.drafts.get(req.request_id, [])
            return self.output(req, new_ids, new_text)
        # An exported request's text goes on at the decode side: hold back what is held back.
        if detok.stop_matched is None and status is not RequestStatus.FINISHED_EXPORTED:
            new_text += detokenizer.finish()  # flushing held-back text may still match a stop string
            if detokenizer.stop_matched is not None:
                req.stop_reason, status = detokenizer.stop_matched, RequestStatus.FINISHED_STOPPED
        export = None
        if status is RequestStatus.FINISHED_EXPORTED:
            export = self.handover.export(req)
        else:
            self.scheduler.finish(req, status)
        out = self.finalize(req, new_ids, new_text)
        out.exported_kv = export
        return out

    def check_stop(self, req: Request, token: int, stop_string: str | None) -> RequestStatus | None:
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

    def output(
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

    def finalize(self, req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        out = self.output(req, new_ids, new_text, finished=True)
        del self.requests[req.request_id]
        del self.detokenizers[req.request_id]
        return out
