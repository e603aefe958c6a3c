"""What the router's fronts (gRPC `Inference`, OpenAI HTTP) call: engine types, no protos.

A front first takes admission for the request's generations (`Frontend.admit`), and only then
tokenizes (off the event loop, fairly among clients: `Frontend.prepare`), validates through
`Frontend`, and iterates `Frontend.generate`
once per generation. Closing the iterator early (client gone) or cancelling the task that
iterates it cancels the request on every worker it touched.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import enum
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TypeVar

from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputsParams
from engine.structured.compiler import ConstraintChecker
from engine.tokenizer import Tokenizer
from services.common.fair import FairExecutor, client_id

T = TypeVar("T")

PREPARATION_THREADS = 2
"""Threads preparing requests (Frontend.prepare). One client uses at most one of them."""
GRAMMAR_THREADS = 1
"""Threads checking structured-output constraints (Frontend.check_constraints)."""
MAX_TEMPERATURE = 2.0
"""API limit on temperature (OpenAI's); the engine itself accepts any temperature >= 0."""
MAX_STOP = 16
"""API limit on the number of stop strings per request."""
CHAT_ROLES = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "developer": "system",
    "tool": "tool",
}
"""The chat roles both public APIs take -> the role the model's chat template renders it as.
OpenAI's `developer` (its newer name for system instructions) renders as `system`; `tool` carries
a tool call's result."""


def check_api_limits(params: SamplingParams) -> None:
    """The public API's limits beyond the engine's own checks; ValueError naming the field."""
    if params.temperature > MAX_TEMPERATURE:
        raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE}], got {params.temperature!r}")
    if len(params.stop) > MAX_STOP:
        raise ValueError(f"stop has {len(params.stop)} strings, more than the limit of {MAX_STOP}")


class ConstraintError(ValueError):
    """A constraint the check refused; `param` names the request field for the API's error."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ConstraintCheck:
    """A structured-output constraint a front checks before it accepts a request
    (Frontend.check_constraints), and how to name it in the error."""

    params: StructuredOutputsParams
    field: str
    """The request field the constraint came in (`response_format`, `sampling.structured_outputs`)."""
    where: str
    """The field holding its value (`response_format.json_schema.schema`): the error names it."""
    param: str
    """The error's `param` (OpenAI's error body)."""
    note: str = ""
    """Added to the error message (what the grammar is, when the server built it)."""


def check_prompt_bytes(num_bytes: int, tokenizer: Tokenizer, max_model_len: int) -> None:
    """Refuse a prompt text too long to fit in max_model_len tokens from its byte length alone,
    before paying for its tokenization; ValueError naming `prompt` and the limit."""
    limit = tokenizer.max_prompt_bytes(max_model_len)
    if num_bytes > limit:
        raise ValueError(
            f"prompt has {num_bytes} bytes of text; more than {limit} bytes cannot fit in "
            f"max_model_len ({max_model_len} tokens)"
        )


MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
"""Most prompt logprob entries (a token's, and each alternative's) one response may hold (echo with
logprobs, prompt_logprobs), all of them at once: 524,288 is ~15 MB of JSON; a 48-prompt echo of 800
tokens with 20 alternatives (806,400) returned 23.8 MB. A 128K-token prompt scored with one
alternative fits."""


def check_prompt_logprobs(prompt_tokens: int, top: int | None, field: str) -> None:
    """ValueError naming `field` and the limit when `top` prompt logprobs over `prompt_tokens`
    tokens (every prompt, times n) would pass MAX_PROMPT_LOGPROB_ENTRIES."""
    if top is None:
        return
    entries = prompt_tokens * (top + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise ValueError(
            f"{field} = {top} over {prompt_tokens:,} prompt tokens (every prompt, n times) asks for "
            f"{entries:,} logprob entries, more than the limit of {MAX_PROMPT_LOGPROB_ENTRIES:,} a response"
        )


def check_generations(num_prompts: int, n: int, limit: int) -> int:
    """A request's admission weight (prompts x n); ValueError naming `n` and the limit when it
    asks for more than `limit` generations."""
    weight = num_prompts * n
    if weight > limit:
        raise ValueError(
            f"n = {n} with {num_prompts} prompt(s) asks for {weight} generations, more than the limit "
            f"of {limit} per request (max_generations_per_request)"
        )
    return weight


def prepare_echo(params: SamplingParams) -> bool:
    """Engine parameters of a request that echoes its prompt, set in place: with logprobs, the
    prompt's logprobs too, with at least as many alternatives; max_tokens 0 (score the prompt,
    generate nothing) runs as max_tokens 1, whose token the router drops (`score_only_delta`).
    Returns whether the request is score-only; ValueError naming min_tokens when it asks for
    tokens of a score-only request."""
    if params.logprobs is not None:
        params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
    if params.max_tokens != 0:
        return False
    if params.min_tokens:
        raise ValueError(f"min_tokens ({params.min_tokens}) must be <= max_tokens (0)")
    params.max_tokens = 1
    return True


def echo_text(
    prompt_text: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer: Tokenizer
) -> str:
    """The text an echo returns: the prompt as the client wrote it, else its tokens decoded as
    the output is (skip_special_tokens applies)."""
    if prompt_text is not None:
        return prompt_text
    return tokenizer.decode(prompt_token_ids, skip_special_tokens=params.skip_special_tokens)


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
    queued: float = 0.0
    """Seconds the request waited for admission before this generation started."""
    score_only: bool = False
    """Score the prompt, generate nothing (max_tokens 0 with echo; see `prepare_echo`): the
    deltas carry the prompt logprobs but no tokens, and end with finish_reason "length"."""
    client: str = ""
    """Who asked (Frontend.client): the router's fair share of its threads and the workers' of
    their pinned KV go by it."""
    prefilled: asyncio.Event | None = None
    """Set once this generation's prompt KV exists on a worker (its first output) or it ended."""
    after: asyncio.Event | None = None
    """Another sample's `prefilled`: this one waits for it, and then finds the prompt in that
    worker's prefix cache instead of computing and pinning a copy of its own."""


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
    error: str | None = None
    """Last delta from a worker only, with "abort": why the request could not go on (the router
    core raises it as the request's error; a front never sees it set)."""


def score_only_delta(delta: Delta) -> Delta:
    """A score-only request's delta as its client sees it: the prompt logprobs and timings, no
    tokens (the engine sampled one: it always does), "length" for the finish ("abort" stays)
    and no completion tokens in the usage."""
    out = Delta(
        prompt_logprobs=delta.prompt_logprobs, timings=delta.timings, disaggregated=delta.disaggregated
    )
    if delta.finish_reason is not None:
        out.finish_reason = "abort" if delta.finish_reason == "abort" else "length"
    if delta.usage is not None:
        out.usage = dataclasses.replace(delta.usage, completion_tokens=0)
    return out


class Frontend(abc.ABC):
    """The router as its fronts see it. All methods are called from the router's event loop."""

    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    vocab_size: int
    max_generations_per_request: int
    """Most generations (prompts x n) one request may ask for; more is a 400 naming the limit."""

    keyed: bool = False
    """Whether the public API checks API keys: a client is then known by its key, else by its
    address (an unchecked key names nobody: anyone may send any)."""
    _preparation: FairExecutor | None = None

    def client(self, authorization: str | bytes | None, address: str | None) -> str:
        """Who a request comes from (services/common/fair.py client_id), from its Authorization
        header or metadata and its peer address."""
        key = None
        if self.keyed and authorization is not None:
            text = (
                authorization.decode(errors="replace") if isinstance(authorization, bytes) else authorization
            )
            key = text.removeprefix("Bearer ")
        return client_id(key, address)

    _grammar: FairExecutor | None = None
    _checker: ConstraintChecker | None = None

    async def check_constraints(self, client: str, checks: Sequence[ConstraintCheck]) -> None:
        """Check each constraint as a worker would compile it (engine/structured/compiler.py
        ConstraintChecker: its cost bounded by the library's limits, verdicts cached) on a
        GRAMMAR_THREADS pool of its own, fairly among clients, so that costly checks queue neither
        other clients' checks nor the preparation of requests without one. Raises ConstraintError
        naming the check's field."""
        if not checks:
            return
        if self._grammar is None:
            self._grammar = FairExecutor(GRAMMAR_THREADS, "grammar")
            self._checker = ConstraintChecker(self.tokenizer.tokenizer, [self.tokenizer.eos_token_id])
        for check in checks:
            try:
                await self._grammar.run(client, self._checker.check, check.params, check.field, check.where)
            except ValueError as e:
                raise ConstraintError(f"{e}{check.note}", check.param) from None

    async def prepare(self, client: str, fn: Callable[..., T], *args) -> T:
        """Run a request's CPU-bound preparation (JSON parsing, template rendering, tokenizing,
        encoding a large response) off the event loop, on PREPARATION_THREADS threads shared
        fairly among clients: each client's jobs run one at a time, and a client's backlog never
        queues another's work behind it. The loop keeps serving streams, and one client's flood
        takes at most one core."""
        if self._preparation is None:
            self._preparation = FairExecutor(PREPARATION_THREADS, "prepare")
        return await self._preparation.run(client, fn, *args)

    def not_ready(self) -> str | None:
        """Why a request cannot be routed now (what both fronts' readiness reports: HTTP /health
        503, gRPC readiness NOT_SERVING); None when one can."""
        return None

    @abc.abstractmethod
    def admit(self, weight: int, timeout: float | None) -> AbstractAsyncContextManager[float]:
        """Hold admission for `weight` generations (1 <= weight <= max_generations_per_request)
        while the body runs; yields the seconds spent queued. Raises ResourceExhausted when the
        router is full (at once, or after the queue timeout)."""

    def check_fits(self, prompts: list[list[int]], n: int, mode: ServingMode) -> None:  # noqa: B027
        """Raise ValueError naming `prompt` or `n` and the limit when the request's generations
        could never run at once (the KV they would hold pinned). Default: they always can."""

    @abc.abstractmethod
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit (prompt length, max_tokens, sampling ranges)."""

    @abc.abstractmethod
    def generate(self, inp: GenerateInput) -> AsyncIterator[Delta]:
        """Stream the request's deltas; the last one has finish_reason set (a score-only input's
        pass through `score_only_delta`). Raises `services.common.errors.ServiceError` (with a
        status code) when the request fails."""
