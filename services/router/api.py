"""What the router's fronts (gRPC `Inference`, OpenAI HTTP) call: engine types, no protos.

A front validates and tokenizes through `Frontend`, then iterates `Frontend.generate`. Closing
the iterator early (client gone) or cancelling the task that iterates it cancels the request on
every worker it touched.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

MAX_TEMPERATURE = 2.0
"""API limit on temperature (OpenAI's); the engine itself accepts any temperature >= 0."""
MAX_STOP = 16
"""API limit on the number of stop strings per request."""


def check_api_limits(params: SamplingParams) -> None:
    """The public API's limits beyond the engine's own checks; ValueError naming the field."""
    if params.temperature > MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {params.temperature!r}")
    if len(params.stop) > MAX_STOP:
        raise ValueError(f"stop has {len(params.stop)} strings, more than the limit of {MAX_STOP}")


class ServingMode(enum.Enum):
    AUTO = "auto"
    DISAGGREGATED = "disaggregated"
    COLOCATED = "colocated"


class KvFailurePolicy(enum.Enum):
    FAIL = "fail"
    RECOMPUTE = "recompute"


@dataclass
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mode: ServingMode = ServingMode.AUTO
    kv_failure_policy: KvFailurePolicy = KvFailurePolicy.FAIL
    timeout: float | None = None
    """Seconds the whole request may take; propagated to every internal RPC as a deadline."""


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    """Prompt tokens served from the prefill worker's prefix cache."""
    kv_transfer_bytes: int = 0
    """KV bytes pulled from the prefill worker to the decode worker (0 when colocated)."""


@dataclass
class Timings:
    """Seconds; 0 when a stage did not happen."""

    queue: float = 0.0
    prefill: float = 0.0
    kv_transfer: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0


@dataclass
class Delta:
    """The output since the previous delta of one request."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    """One dict per token in token_ids when params.logprobs is set: the chosen token first, then the top N."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """First delta only, when params.prompt_logprobs is set: None for the first prompt token."""
    finish_reason: str | None = None
    """Last delta only: "stop", "length" or "abort"."""
    stop_reason: int | str | None = None
    usage: Usage | None = None
    """Last delta only."""
    timings: Timings | None = None
    """Last delta only."""
    disaggregated: bool = False


class Frontend(abc.ABC):
    """The router as its fronts see it. All methods are called from the router's event loop."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int

    @abc.abstractmethod
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit (prompt length, max_tokens, sampling ranges)."""

    @abc.abstractmethod
    def generate(self, inp: GenerateInput) -> AsyncIterator[Delta]:
        """Stream the request's deltas; the last one has finish_reason set. Raises
        `services.errors.ServiceError` (with a status code) when the request fails."""
