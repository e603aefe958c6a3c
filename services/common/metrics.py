"""Prometheus metrics (prefix `pdserve_`) of the router and the workers, one registry per process."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Metrics:
    """The request-level series both the router and the workers keep, plus the KV-transfer ones."""

    def __init__(self, component: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.component = component
        self.requests = Counter(
            "pdserve_requests", "Finished requests by outcome", ["component", "finish_reason"], registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Arrival to first token",
            ["component"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_inter_token_latency_seconds",
            "Between consecutive tokens",
            ["component"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival to last token",
            ["component"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pdserve_queue_time_seconds",
            "Arrival to first scheduled",
            ["component"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens", ["component"], registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Generated tokens", ["component"], registry=r
        )
        self.cached_tokens = Counter(
            "pdserve_cached_prompt_tokens",
            "Prompt tokens served from a prefix cache",
            ["component"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            "pdserve_kv_transfer_bytes",
            "KV-cache bytes moved between workers",
            ["component", "direction"],
            registry=r,
        )
        self.kv_transfer_seconds = Histogram(
            "pdserve_kv_transfer_seconds",
            "Time to pull one request's KV",
            ["component"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_transfer_phase_seconds = Histogram(
            "pdserve_kv_transfer_phase_seconds",
            "Where a NIXL pull's time went: begin_read (the RPC), prepare (descriptors), transfer "
            "(posted until landed), verify (checksums), release (transfer handles), handoff (to the "
            "read thread and back)",
            ["component", "phase"],
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.kv_transfers = Counter(
            "pdserve_kv_transfers",
            "KV pulls completed, by transport (nixl, grpc)",
            ["component", "transport"],
            registry=r,
        )
        self.kv_transfer_failures = Counter(
            "pdserve_kv_transfer_failures",
            "KV transfers that failed, by status code",
            ["component", "code"],
            registry=r,
        )
        self.retries = Counter(
            "pdserve_request_retries", "Requests retried on another worker", ["component"], registry=r
        )
        self.kv_expired_leases = Counter(
            "pdserve_kv_transfer_expired_leases",
            "Pinned transfers freed by lease expiry",
            ["component"],
            registry=r,
        )

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        """A gauge read when scraped (running/waiting requests, KV usage, ...)."""
        Gauge(name, doc, ["component"], registry=self.registry).labels(self.component).set_function(fn)

    def labels(self, metric, *values):
        return metric.labels(self.component, *values)

    def observe_request(self, ttft: float | None, e2e: float | None, queue: float | None) -> None:
        if ttft is not None:
            self.labels(self.ttft).observe(ttft)
        if e2e is not None:
            self.labels(self.e2e).observe(e2e)
        if queue is not None:
            self.labels(self.queue_time).observe(queue)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
