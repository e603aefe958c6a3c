"""What the engine returns for a request: cumulative tokens and text, plus this step's delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.request import RequestMetrics


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    """All generated token ids so far (a stop token is included, as it was generated)."""
    text: str
    """Detokenized output so far; never contains a matched stop string or broken UTF-8."""
    new_token_ids: list[int] = field(default_factory=list)
    """Tokens generated since the previous output for this request."""
    new_text: str = ""
    """Text released since the previous output for this request."""
    logprobs: list[dict[int, float]] | None = None
    """Per generated token: token id -> logprob for the sampled token and the top-N. (The
    request's own list, which later steps extend: read `new_logprobs` for this step's.)"""
    new_logprobs: list[dict[int, float]] | None = None
    """The logprobs of new_token_ids, taken when the output was made: another thread may read an
    output while the engine thread goes on appending to `logprobs`."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """Per prompt token (None for the first): the same, for the prompt."""
    finished: bool = False
    finish_reason: str | None = None
    """"stop" (EOS, stop token or stop string), "length" (max_tokens / max_model_len) or "abort"."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended the request, if any."""
    error: str | None = None
    """With finish_reason "abort": why the request could not go on (Request.error), for the
    client; None when the abort was asked for."""
    metrics: RequestMetrics | None = None
    exported_kv: Any = None
    """For a prefill-only request that handed over (finish_reason "exported"): its pinned
    `engine.kv_cache.export.Export`."""

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens if self.metrics else 0
