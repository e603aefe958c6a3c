"""A request's state inside the engine: tokens, progress, cache blocks and results so far."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import llguidance
    import torch

    from engine.kv_cache.export import ExportOptions


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    """Not admitted until KV from outside arrives: a connector's off-thread lookup of its prefix
    blocks (Scheduler.waiting_for_kv), or an import whose blocks are not allocated yet."""
    LOADING_REMOTE_KV = "loading_remote_kv"
    """Blocks allocated, being written from outside (a KV transfer into an importing request)."""
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_EXPORTED = "exported"
    """Prefill-only request done: first token sampled, prompt KV pinned for a decode worker."""

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_EXPORTED,
        )


@dataclass
class RequestMetrics:
    arrival_time: float
    """time.monotonic() when the request entered the engine."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache the first time the request was scheduled."""
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    token_ids: list[int] = field(default_factory=list)
    """Prompt then output tokens."""
    num_computed_tokens: int = 0
    """Leading tokens whose KV is in this request's cache blocks."""
    block_ids: list[list[int]] = field(default_factory=list)
    """One block table per table of the KV cache spec (KVCacheSpec.tables; engine/kv_cache/manager.py
    owns them): [] while the request holds no blocks."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained content hashes of the request's full blocks, computed once each."""
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    stop_reason: int | str | None = None
    error: str | None = None
    """Why the request was aborted when it could not go on (its structured-output constraint failed
    at run time), for its client; None for an abort asked for (a cancel, a client gone)."""
    client: str = ""
    """Who the request is for (a server's name for its client; "" offline): the scheduler takes
    waiting requests fairly among clients."""
    fair_tag: float = 0.0
    """The scheduler's start tag for it (Scheduler.add): waiting requests run in tag order."""
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    draft_token_ids: list[int] = field(default_factory=list)
    """Tokens the MTP layer proposed to follow token_ids; verified in the next step."""
    spec_enabled: bool = False
    """The request drafts and verifies (speculative decoding on, and its sampling allows it)."""
    kv_export: ExportOptions | None = None
    """Prefill-only (disaggregated prefill): after the first token the request ends with its prompt's
    KV blocks pinned in an export (engine/kv_cache/export.py) instead of freed."""
    grammar: llguidance.LLMatcher | None = None
    """The structured-output matcher (params.structured_outputs), advanced over every token
    appended; set when the request enters the scheduler (engine/structured/manager.py)."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None:
            import torch  # here: the router builds its outputs from this module without torch

            self.generator = torch.Generator().manual_seed(self.params.seed)
        if self.params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first prompt token has no prediction

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still owed (they are computed once, in the first prefill)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
