"""Two prefill and two decode workers found through a real Redis registry: requests spread,
prefix-cache affinity, workers dropping out and coming back, Redis restarting empty."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent import futures

import pytest
import redis

from engine import LLM, SamplingParams
from pdserve.v1 import inference_pb2 as pb
from tests.redis_server import RedisServer
from tests.service_testing import ENGINE_ARGS, generate, inference, metric, start_stack, wait_until

TTL_S = 2.0


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory, redis_server):
    st = start_stack(
        tiny_model,
        tmp_path_factory.mktemp("scale"),
        num_prefill=2,
        num_decode=2,
        registry=redis_server.url,
        engine_args=[*ENGINE_ARGS, "--heartbeat-ttl-s", str(TTL_S)],
        worker_metrics=True,
        router_args=["--colocate-max-tokens", "0"],
    )
    yield st
    st.stop()


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256)


def _listed(stack) -> set[str]:
    info = inference(stack).GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    return {w.endpoint for w in info.workers if w.healthy}


def _requests_on(proc) -> float:
    return metric(urllib.request.urlopen(proc.metrics_url).read().decode(), "pdserve_requests_total")


def test_requests_spread_over_every_worker_and_stay_correct(stack, offline):
    prompts = [[3 + (i * 7 + j * 13) % 3000 for j in range(40 + i)] for i in range(8)]
    refs = offline.generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8)
    )
    stub = inference(stack)
    sampling = pb.SamplingParams(temperature=0, max_tokens=8)
    with futures.ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda p: generate(stub, token_ids=pb.TokenIds(ids=p), sampling=sampling), prompts)
        )
    for (tokens, msgs), ref in zip(results, refs, strict=True):
        assert tokens == ref.token_ids
        assert msgs[-1].disaggregated and msgs[-1].usage.kv_transfer_bytes > 0
    per_worker = {p.name: _requests_on(p) for p in stack.workers()}
    assert all(n > 0 for n in per_worker.values()), per_worker


def test_worker_metrics_count_what_moved(stack):
    """Every worker serves Prometheus metrics; what prefill ranks sent is what decode ranks received."""
    scraped = {p.name: urllib.request.urlopen(p.metrics_url).read().decode() for p in stack.workers()}
    sent = sum(metric(t, "pdserve_kv_transfer_bytes_total", direction="sent") for t in scraped.values())
    received = sum(
        metric(t, "pdserve_kv_transfer_bytes_total", direction="received") for t in scraped.values()
    )
    assert sent > 0 and sent == received
    for name, text in scraped.items():
        assert metric(text, "pdserve_time_to_first_token_seconds_count") > 0, name
        assert metric(text, "pdserve_kv_cache_usage") >= 0 and "pdserve_prefix_cache_hit_rate" in text
        assert "pdserve_kv_transfer_expired_leases_total" in text and "pdserve_num_requests_waiting" in text
    for name in ("decode-0", "decode-1"):
        assert metric(scraped[name], "pdserve_kv_transfer_seconds_count") > 0
        # every worker has NIXL (--kv-transport auto): no pull fell back to the chunk stream
        assert metric(scraped[name], "pdserve_kv_transfers_total", transport="nixl") > 0
        assert metric(scraped[name], "pdserve_kv_transfers_total", transport="grpc") == 0
        assert metric(scraped[name], "pdserve_inter_token_latency_seconds_count") > 0
        # the router's outputs from each decode worker come on one subscription, not a stream per call
        assert metric(scraped[name], "pdserve_decode_subscriptions") == 1
    for name in ("prefill-0", "prefill-1"):
        assert metric(scraped[name], "pdserve_decode_subscriptions") == 0
    # every process froze what it started with and times its collections, the router too
    scraped["router"] = urllib.request.urlopen(stack.http_url + "/metrics").read().decode()
    for name, text in scraped.items():
        assert metric(text, "pdserve_gc_frozen_objects") > 10_000, name
        assert metric(text, "pdserve_gc_pause_seconds_count", generation="2") >= 1, name  # the freeze's


def test_a_shared_prefix_goes_back_to_the_rank_that_cached_it(stack, offline):
    prefix = [17 + (j * 11) % 3000 for j in range(64)]
    stub = inference(stack)
    cached = []
    for i in range(4):
        prompt = prefix + [100 + i] * 8
        tokens, msgs = generate(
            stub, token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(temperature=0, max_tokens=4)
        )
        ref = offline.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=4)
        )[0]
        assert tokens == ref.token_ids
        cached.append(msgs[-1].usage.cached_tokens)
    assert cached[0] == 0 and all(c == 64 for c in cached[1:]), cached


def test_a_worker_whose_heartbeats_stop_drops_out_within_its_ttl_and_comes_back(stack):
    victim = stack.workers("decode")[1]
    assert victim.endpoint in _listed(stack)
    os.kill(victim.popen.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert wait_until(lambda: victim.endpoint not in _listed(stack), TTL_S + 2.0)
        assert time.monotonic() - t0 <= TTL_S + 2.0
        tokens, _ = generate(
            inference(stack), text="still serving", sampling=pb.SamplingParams(temperature=0, max_tokens=4)
        )
        assert len(tokens) == 4
    finally:
        os.kill(victim.popen.pid, signal.SIGCONT)
    assert wait_until(lambda: victim.endpoint in _listed(stack), TTL_S + 3.0)


def test_redis_restarted_empty_refills_within_a_heartbeat_and_routing_never_stops(stack, redis_server):
    everyone = {p.endpoint for p in stack.workers()}
    assert wait_until(lambda: _listed(stack) == everyone, 5.0)
    redis_server.stop()
    # Last-known state: the router keeps routing while Redis is down.
    tokens, _ = generate(
        inference(stack), text="redis is down", sampling=pb.SamplingParams(temperature=0, max_tokens=4)
    )
    assert len(tokens) == 4
    redis_server.start()
    client = redis.Redis.from_url(redis_server.url)
    t0 = time.monotonic()
    assert wait_until(lambda: len(client.keys("pdserve:worker:*")) == len(everyone), TTL_S / 3 + 1.5)
    assert time.monotonic() - t0 <= TTL_S / 3 + 1.5
    assert wait_until(lambda: _listed(stack) == everyone, 3.0)


def test_sigterm_deregisters_at_once_and_exits_zero(stack, redis_server):
    """Graceful drain: the worker leaves the registry right away (not when its TTL runs out)."""
    client = redis.Redis.from_url(redis_server.url)
    victim = stack.workers("decode")[1]
    key = f"pdserve:worker:{victim.endpoint}"
    assert client.exists(key)
    victim.popen.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    assert wait_until(lambda: not client.exists(key), TTL_S / 2)
    assert time.monotonic() - t0 < TTL_S / 2
    assert victim.popen.wait(timeout=30) == 0
    assert wait_until(lambda: victim.endpoint not in _listed(stack), 3.0)
