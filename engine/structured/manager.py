"""The engine's side of structured output: each constrained request's grammar compiled off the
engine thread, the request held back until it is ready, its matcher advanced with its tokens,
and each step's token bitmask.

A constrained request's life:

    submit (created) -> admit (would enter the scheduler) --ready--> enqueued, req.grammar set
                              |                                       advanced by every appended token
                              +--compiling--> held --poll: ready--> enqueued
                                                   --poll: failed--> returned, the engine aborts it

`admit` takes the scheduler entry the request was headed for (the waiting queue, or the running
batch for a request continued after a KV transfer), so the hold is the same for both. While a
request is held the engine keeps stepping the others. The matcher is built from the request's
output tokens when it is enqueued: a request continued on a decode worker brings the tokens a
prefill worker sampled, and its matcher is rebuilt from them. Preemption keeps the tokens and the
matcher with the request, so recomputing it changes neither.

Engine thread only: compiles run on the compiler's thread, and a step's masks on the mask thread,
which has the step's matchers until the bitmask future resolves (the engine thread meanwhile runs
the forward and touches no matcher).
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import tokenizers
import torch

from engine.log import warn_limited
from engine.request import Request, RequestStatus
from engine.structured.bitmask import TokenBitmask, fill_bitmask
from engine.structured.compiler import MAX_ERROR_CHARS, GrammarCompiler
from engine.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)


def _short(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


@dataclass
class _Compiling:
    request: Request
    matcher: concurrent.futures.Future
    """Resolves to the request's own LLMatcher (or a ValueError naming the field)."""
    enqueue: Callable[[Request], None] | None = None
    """Where it goes once ready; None until admitted."""


class StructuredOutputManager:
    def __init__(self, hf_tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.compiler = GrammarCompiler(hf_tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiling: dict[str, _Compiling] = {}
        self._failed: list[tuple[Request, str]] = []
        """Admitted requests that cannot run, for the next poll."""
        self._executor: llguidance.LLExecutor | None = None
        self._mask_thread: ThreadPoolExecutor | None = None
        self._mask_threads = max(1, min(8, torch.get_num_threads()))
        """The engine's threads, taken when built: a few-token step runs torch on one (runner.py)."""

    def check(self, params: StructuredOutputsParams | None) -> None:
        """Compile the constraint (through the cache) and raise its ValueError if it has one.
        Blocks until compiled: for callers off the engine thread, or before it steps (LLM.generate)."""
        if params is not None:
            self.compiler.submit(params).result()

    @property
    def num_held(self) -> int:
        """Admitted requests waiting for their grammar, or to be reported as failed by `poll`."""
        return len(self._failed) + sum(c.enqueue is not None for c in self._compiling.values())

    def submit(self, req: Request) -> None:
        """Start compiling a new request's constraint (a no-op for an unconstrained one)."""
        if req.params.structured_outputs is not None:
            self._compiling[req.request_id] = _Compiling(
                req, self.compiler.submit(req.params.structured_outputs)
            )

    def admit(self, req: Request, enqueue: Callable[[Request], None]) -> None:
        """enqueue(req) now if it is unconstrained or its grammar is ready; else when `poll` finds
        it ready. A request that cannot run is reported by the next `poll`."""
        entry = self._compiling.get(req.request_id)
        if entry is None:
            enqueue(req)
            return
        entry.enqueue = enqueue
        if entry.matcher.done():
            self._failed.extend(self._start([entry]))

    def poll(self) -> list[tuple[Request, str]]:
        """Enqueue the held requests whose grammar is ready; return (request, error) for those
        that cannot run (the compile failed, or its output so far breaks the constraint)."""
        ready = [c for c in self._compiling.values() if c.enqueue is not None and c.matcher.done()]
        failed, self._failed = self._failed + self._start(ready), []
        return failed

    def _start(self, entries: list[_Compiling]) -> list[tuple[Request, str]]:
        """Give each ready request its matcher, advanced over the output it has, and enqueue it."""
        failed = []
        for entry in entries:
            req = entry.request
            del self._compiling[req.request_id]
            error = entry.matcher.exception()
            if error is None:
                req.grammar = entry.matcher.result()
                if req.output_token_ids and not req.grammar.consume_tokens(req.output_token_ids):
                    error = ValueError(
                        "output_token_ids do not follow structured_outputs: " + req.grammar.get_error()
                    )
            if error is None:
                entry.enqueue(req)
            else:
                failed.append((req, str(error)))
        return failed

    def wait(self, timeout: float) -> None:
        """Block up to timeout seconds until a held request's grammar is ready (an engine with
        nothing else to do, instead of spinning)."""
        pending = [c.matcher for c in self._compiling.values() if c.enqueue is not None]
        if pending:
            concurrent.futures.wait(pending, timeout, concurrent.futures.FIRST_COMPLETED)

    def discard(self, request_id: str) -> None:
        """Forget a request that ended before its grammar was ready."""
        self._compiling.pop(request_id, None)
        self._failed = [(r, e) for r, e in self._failed if r.request_id != request_id]

    def advance(self, req: Request, token: int) -> RequestStatus | None:
        """Advance req's matcher over a token just appended to it. FINISHED_ABORTED, with
        req.error saying why, when the matcher refuses it (a token sampled under the request's
        mask never is: the matcher itself failed, and the row's mask allowed only EOS); FINISHED_STOPPED
        when the constraint is complete and EOS would not end the request (ignore_eos, or short of
        min_tokens): only EOS may follow, so the request ends here."""
        assert req.grammar is not None
        if not req.grammar.consume_token(token):
            # Sampled under the mask, a token never breaks the constraint: the matcher itself
            # failed (past the library's per-step limits after some tokens, or no finite output).
            where = f"structured_outputs.{req.params.structured_outputs.kind.value}"
            req.error = (
                f"{where}: the constraint failed at output token {req.num_output_tokens}: "
                f"{_short(req.grammar.get_error())}"
            )
            warn_limited(logger, "request %s: %s", req.request_id, req.error)
            return RequestStatus.FINISHED_ABORTED
        params = req.params
        if req.grammar.is_stopped() and (params.ignore_eos or req.num_output_tokens < params.min_tokens):
            return RequestStatus.FINISHED_STOPPED
        return None

    def bitmask(self, entries: Sequence[tuple[Request, int, Sequence[int]]]) -> Future[TokenBitmask]:
        """A step's bitmask, filled on the mask thread (llguidance releases the GIL, so the engine
        thread runs the forward meanwhile; on a GPU the masks are off the step's critical path).
        entries: (request with a matcher, its logits row, its drafts). Its matchers are the mask
        thread's until the future resolves."""
        if self._mask_thread is None:
            self._executor = llguidance.LLExecutor(self._mask_threads)
            self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        jobs = [(req.grammar, row, list(drafts)) for req, row, drafts in entries]
        return self._mask_thread.submit(
            fill_bitmask, self._executor, jobs, self.vocab_size, self.eos_token_ids
        )
