"""From the engine's outputs to what a worker's callers see: a Decode stream's messages (tokens
that are ready together go in one; the last carries usage and timings) and the metrics of every
request that ends here."""

from __future__ import annotations

import time

from engine.outputs import RequestOutput
from pdserve.v1 import inference_pb2 as pb
from services.common import convert
from services.common.errors import Unavailable
from services.common.metrics import Metrics


def observe(metrics: Metrics, out: RequestOutput) -> None:
    """A finished request's count by finish reason, its latencies and its cached tokens."""
    m, request = metrics, out.metrics
    m.labels(m.requests, out.finish_reason or "unknown").inc()
    if request is not None:
        m.observe_request(request.time_to_first_token, request.e2e_latency, request.queue_time)
        m.labels(m.cached_tokens).inc(request.num_cached_tokens)


class DecodeMessages:
    """One Decode call's messages, built batch by batch from its engine outputs."""

    def __init__(
        self,
        metrics: Metrics,
        label: str,
        disaggregated: bool,
        num_prompt_tokens: int,
        kv_bytes: int,
        kv_seconds: float,
        start: float,
    ):
        """label: the caller's request_id; disaggregated: the first token came from a prefill
        worker (so this stream's first output is not the request's first token); kv_bytes and
        kv_seconds: what the import moved and how long it took; start: time.monotonic() when the
        call came in."""
        self.metrics = metrics
        self.label = label
        self.disaggregated = disaggregated
        self.num_prompt_tokens = num_prompt_tokens
        self.kv_bytes = kv_bytes
        self.kv_seconds = kv_seconds
        self.start = start
        self._first = True
        self._last_token_time: float | None = None
        self._gaps: list[float] = []

    def message(self, batch: list[RequestOutput | BaseException]) -> tuple[pb.GenerateResponse, bool]:
        """The message for outputs that arrived together -> (message, the request finished).
        UNAVAILABLE when the engine failed."""
        msg = None
        for out in batch:
            if isinstance(out, BaseException):
                raise Unavailable(f"engine failed: {out}")
            part = convert.output_to_proto(out, self._first and not self.disaggregated)
            self._first = False
            if msg is None:
                msg = part
                msg.request_id = self.label
            else:
                convert.merge(msg, part)
        now = time.monotonic()
        if self._last_token_time is not None and msg.token_ids:
            self._gaps.append((now - self._last_token_time) / len(msg.token_ids))
        self._last_token_time = now
        if not out.finished:
            return msg, False
        observe(self.metrics, out)
        for gap in self._gaps:
            self.metrics.labels(self.metrics.itl).observe(gap)
        msg.usage.CopyFrom(
            pb.Usage(
                prompt_tokens=self.num_prompt_tokens,
                completion_tokens=len(out.token_ids),
                cached_tokens=out.num_cached_tokens,
                kv_transfer_bytes=self.kv_bytes,
            )
        )
        m = out.metrics
        msg.timings.CopyFrom(
            pb.Timings(
                queue_ns=int((m.queue_time or 0) * 1e9),
                kv_transfer_ns=int(self.kv_seconds * 1e9),
                ttft_ns=int((m.time_to_first_token or 0) * 1e9) if not self.disaggregated else 0,
                e2e_ns=int((time.monotonic() - self.start) * 1e9),
            )
        )
        msg.disaggregated = self.disaggregated
        return msg, True
