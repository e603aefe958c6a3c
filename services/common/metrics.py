"""Prometheus metrics (prefix `pdserve_`) of the router and the workers, one registry per process."""

from __future__ import annotations

import bisect
import gc
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
_GC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)


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

    def watch_gc(self) -> Callable[[], None]:
        """Time every garbage collection of this process (GcPauses), and report the objects
        frozen out of the collections' scans (engine/gc_heap.py) -> a function that stops the
        timing."""
        self.gauge(
            "pdserve_gc_frozen_objects", "Objects frozen out of the collector's scans", gc.get_freeze_count
        )
        pauses = GcPauses(self.component)
        self.registry.register(pauses)
        gc.callbacks.append(pauses.callback)

        def stop() -> None:
            gc.callbacks.remove(pauses.callback)
            self.registry.unregister(pauses)

        return stop


class GcPauses:
    """pdserve_gc_pause_seconds{generation}: how long each collection held the GIL, which stops
    every thread of the process (the event loop and the engine thread alike). The collector's
    callback only counts into lists (it runs inside a collection, on whichever thread set it
    off); a scrape reads a copy of them."""

    def __init__(self, component: str):
        self.component = component
        self.counts = [[0] * (len(_GC_BUCKETS) + 1) for _ in range(3)]  # per generation, per bucket
        self.sums = [0.0, 0.0, 0.0]
        self._start = 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        seconds, generation = time.perf_counter() - self._start, info["generation"]
        self.counts[generation][bisect.bisect_left(_GC_BUCKETS, seconds)] += 1
        self.sums[generation] += seconds

    def collect(self):
        pauses = HistogramMetricFamily(
            "pdserve_gc_pause_seconds",
            "Garbage collections by generation, how long each held the GIL (every thread waits)",
            labels=["component", "generation"],
        )
        for generation in range(3):
            counts, total = list(self.counts[generation]), 0
            buckets = []
            for bound, count in zip((*map(str, _GC_BUCKETS), "+Inf"), counts, strict=True):
                total += count
                buckets.append((bound, total))
            pauses.add_metric([self.component, str(generation)], buckets, self.sums[generation])
        yield pauses
