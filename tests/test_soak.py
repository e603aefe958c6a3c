"""A bounded soak: a few hundred mixed requests against a stack registered in Redis, with ~10%
cancelled, some deadlines too short to meet, hostile clients mixed in (a shared request id,
oversized and malformed bodies, a request for every slot, forged internal calls) and a decode
worker killed and restarted midway. Every request must end with its result or a clear status,
and blocks, Redis keys, streams, threads, file descriptors and memory must come back to their
baseline. Prints what was injected and what happened."""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import redis

from engine import LLM, SamplingParams
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.threads import IO_THREADS
from services.kv_transfer.nixl_pull import READ_THREADS
from tests.redis_server import RedisServer
from tests.service_testing import ENGINE_ARGS, inference, load, start_stack, wait_until, worker

NUM_REQUESTS = 600
CLIENTS = 8
MAX_TOKENS = 16
ALLOWED = {"ok", "cancelled", "DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}
HOSTILE = {  # kind -> the one outcome it may have
    "oversized body": "400",
    "lone surrogate": "400",
    "every slot": "400",
    "forged prefill": "UNAUTHENTICATED",
    "forged drain": "UNAUTHENTICATED",
}
MAX_RSS_GROWTH_MB = 40
"""Growth allowed per process over the soak, after warm-up (5,000 requests measured flat within 2 MB)."""
MODES = [pb.SERVING_MODE_AUTO, pb.SERVING_MODE_DISAGGREGATED, pb.SERVING_MODE_COLOCATED]


BOUNDED_POOLS = {"nixl-read": READ_THREADS, "io_": IO_THREADS}
"""Thread pools that fill up to a fixed size as work overlaps (not per request): held to their
bound, not to the baseline."""


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return names


def _threads(pid: int) -> int:
    """Threads outside the bounded pools; each pool is checked against its bound."""
    names = _thread_names(pid)
    for prefix, bound in BOUNDED_POOLS.items():
        assert sum(n.startswith(prefix) for n in names) <= bound, (pid, prefix, names)
    return sum(not n.startswith(tuple(BOUNDED_POOLS)) for n in names)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _rss_mb(pid: int) -> float:
    """Resident memory in MB, to the kB /proc gives (not rounded down to whole MB: the bounds
    below are a few MB)."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS"))


def _hostile(stack, kind: str) -> str:
    """One misbehaving client's request -> its outcome (HTTP status or gRPC code name)."""
    if kind.startswith("forged"):
        stub = worker(stack.workers("prefill")[0].endpoint)  # no token
        try:
            if kind == "forged prefill":
                stub.Prefill(wpb.PrefillRequest(prompt_token_ids=[1, 2, 3]), timeout=10)
            else:
                stub.Drain(wpb.DrainRequest(), timeout=10)
        except grpc.RpcError as e:
            return e.code().name
        return "ok"
    body = {
        "oversized body": b'{"prompt": "' + b"lorem ipsum " * 80_000 + b'", "max_tokens": 2}',
        "lone surrogate": b'{"prompt": "a \\ud800 b", "max_tokens": 2}',
        "every slot": json.dumps({"prompt": ["a"] * 64, "n": 16, "max_tokens": 2}).encode(),
    }[kind]
    req = urllib.request.Request(
        stack.http_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return str(resp.status)
    except urllib.error.HTTPError as e:
        return str(e.code)


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def test_soak_with_cancellations_deadlines_and_a_worker_restart(tiny_model, tmp_path, redis_server, capsys):
    stack = start_stack(
        tiny_model,
        tmp_path,
        num_prefill=1,
        num_decode=2,
        registry=redis_server.url,
        engine_args=[*ENGINE_ARGS, "--heartbeat-ttl-s", "2", "--lease-s", "3"],
        router_args=["--colocate-max-tokens", "16", "--max-in-flight", "64"],
    )
    try:
        _soak(stack, tiny_model, redis_server, capsys)
    finally:
        stack.stop()


def _soak(stack, tiny_model, redis_server, capsys):
    rng = random.Random(1)
    prompts = [[3 + (i * 37 + j * 11) % 3000 for j in range(8 + 9 * i)] for i in range(8)]
    # One thread, as each worker runs (service_testing): torch's two OpenMP threads, in a process
    # beside the stack's, wait on each other for most of each step.
    refs = LLM(tiny_model, dtype="float32", num_kv_blocks=256, num_threads=1).generate(
        prompt_token_ids=prompts,
        sampling_params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )
    stub = inference(stack)
    client = redis.Redis.from_url(redis_server.url)

    def run(i: int, kind: str) -> tuple[str, str]:
        if kind in HOSTILE:
            return kind, _hostile(stack, kind)
        p = i % len(prompts)
        n = 1 + (i * 7) % MAX_TOKENS
        request = pb.GenerateRequest(
            request_id="shared" if kind == "shared id" else "",
            token_ids=pb.TokenIds(ids=prompts[p]),
            sampling=pb.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
            mode=MODES[i % 3],
        )
        timeout = 0.02 if kind == "short deadline" else 60
        call = stub.Generate(request, timeout=timeout)
        tokens = []
        try:
            for msg in call:
                tokens += msg.token_ids
                if kind == "cancel" and tokens:
                    call.cancel()
                    return kind, "cancelled"
        except grpc.RpcError as e:
            return (
                kind,
                "cancelled" if e.code() == grpc.StatusCode.CANCELLED and kind == "cancel" else e.code().name,
            )
        assert tokens == refs[p].token_ids[:n], f"request {i}: wrong tokens"
        return kind, "ok"

    # Warm up every path (thread pools, channels) before taking the baseline.
    with futures.ThreadPoolExecutor(CLIENTS) as pool:
        assert all(r[1] == "ok" for r in pool.map(lambda i: run(i, "normal"), range(3 * CLIENTS)))
    time.sleep(1.0)
    pids = {p.name: p.popen.pid for p in stack.procs}
    keep = {name: pid for name, pid in pids.items() if name != "decode-1"}  # decode-1 gets restarted
    base_threads = {name: _threads(pid) for name, pid in keep.items()}
    base_names = {name: sorted(_thread_names(pid)) for name, pid in keep.items()}
    base_fds = {name: _fds(pid) for name, pid in keep.items()}
    base_rss = {name: _rss_mb(pid) for name, pid in keep.items()}
    base_keys = len(client.keys("pdserve:worker:*"))
    assert base_keys == 3

    def kind() -> str:
        r = rng.random()
        if r < 0.1:
            return "cancel"
        if r < 0.14:
            return "short deadline"
        if r < 0.24:
            return "shared id"
        if r < 0.29:
            return rng.choice(sorted(HOSTILE))
        return "normal"

    kinds = [kind() for _ in range(NUM_REQUESTS)]
    victim = stack.workers("decode")[1]
    injected = collections.Counter(kinds)
    done = threading.Event()

    def chaos() -> None:
        nonlocal victim
        time.sleep(3.0)
        os.kill(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait()
        injected["decode worker killed (kill -9)"] += 1
        time.sleep(4.0)
        port = int(victim.endpoint.rsplit(":", 1)[1])
        stack.procs.remove(victim)
        victim = stack.start_worker("decode", 1, port=port)
        injected["decode worker restarted"] += 1
        done.set()

    chaos_thread = threading.Thread(target=chaos)
    start = time.monotonic()
    chaos_thread.start()
    with futures.ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(lambda ik: run(*ik), enumerate(kinds)))
    chaos_thread.join()
    elapsed = time.monotonic() - start
    assert done.is_set()

    outcomes = collections.Counter(results)
    with capsys.disabled():
        print(f"\nsoak: {NUM_REQUESTS} requests by {CLIENTS} clients in {elapsed:.1f} s")
        print("  injected:", ", ".join(f"{k} x{v}" for k, v in sorted(injected.items())))
        for (kind, outcome), count in sorted(outcomes.items()):
            print(f"  {kind:<15} -> {outcome:<20} {count:>4}")
    assert {outcome for kind, outcome in results if kind not in HOSTILE} <= ALLOWED, outcomes
    assert all(outcome == HOSTILE[kind] for kind, outcome in results if kind in HOSTILE), outcomes
    assert (
        outcomes[("normal", "ok")] >= 0.8 * injected["normal"]
    )  # the kill costs only requests in flight there

    # Everything back to baseline: the restarted worker is routed to again and every block is free.
    stack.wait_routable(time.monotonic() + 30)
    for proc in stack.workers():
        assert wait_until(
            lambda p=proc: (
                lambda x: (
                    x.num_free_blocks == x.num_total_blocks
                    and x.num_pinned_transfers == 0
                    and x.num_running == 0
                )
            )(load(p.endpoint, stack.token)),
            10.0,
        ), proc.name
    assert wait_until(lambda: len(client.keys("pdserve:worker:*")) == base_keys, 5.0)
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert len(info.workers) == 3 and all(w.healthy for w in info.workers)
    # What the sleep before this was for (threads and descriptors of the last requests going
    # away), but done as soon as it is: the same second at most, then the same checks.
    wait_until(
        lambda: all(
            _threads(pid) <= base_threads[name] + 2 and _fds(pid) <= base_fds[name] + 4
            for name, pid in keep.items()
        ),
        1.0,
    )
    for name, pid in keep.items():
        assert _threads(pid) <= base_threads[name] + 2, (name, base_names[name], sorted(_thread_names(pid)))
        assert _fds(pid) <= base_fds[name] + 4, (
            name,
            base_fds[name],
            _fds(pid),
            sorted(os.listdir(f"/proc/{pid}/fd")),
        )
    for name, pid in keep.items():
        assert _rss_mb(pid) <= base_rss[name] + MAX_RSS_GROWTH_MB, (name, base_rss[name], _rss_mb(pid))
    assert Path(f"/proc/{keep['router']}").exists()


MEMORY_WARM_UP = 200
MEMORY_REQUESTS = 1_200
MAX_RSS_GROWTH_MEMORY_MB = 7
"""Growth allowed per process over MEMORY_REQUESTS requests after MEMORY_WARM_UP of warm-up.
The leak this is here for: the audit saw a decode worker grow ~5 MB per 500 requests, ~10 KB a
request, which is 12 MB over MEMORY_REQUESTS, 5 MB over the bound. Without a leak every process
stays well within it: by 200 requests each has grown its pools and allocator arenas most of the
way, and the 1,200 after them moved RSS by at most +2.2 MB (RSS read every 50 / 100 requests in
two runs on the 2-core machine, up to 1,600 and 3,000; 1-6 MB over 5,000 when this ran 5,000).
So a leak of more than ~6 KB a request fails it, in under half the requests (and time) of the
500 + 2,500 it ran before."""


def test_memory_stays_flat_over_1200_requests(serving_stack, capsys):
    """The audit saw a decode worker grow ~5 MB per 500 requests: after warm-up, 1,200 more
    (disaggregated, a tenth cancelled after their first token, a tenth sharing one request id)
    leave every process's RSS within the bound, and nothing pinned or held."""
    stack = serving_stack
    stub = inference(stack)

    def run(i: int) -> None:
        request = pb.GenerateRequest(
            request_id="same" if i % 10 == 1 else "",
            token_ids=pb.TokenIds(ids=[3 + (i * 37 + j * 11) % 3000 for j in range(20 + i % 40)]),
            sampling=pb.SamplingParams(temperature=0, max_tokens=2 + i % 5, ignore_eos=True),
        )
        call = stub.Generate(request, timeout=60)
        if i % 10 == 0:
            next(call)
            call.cancel()
            return
        assert sum(len(m.token_ids) for m in call) == 2 + i % 5

    with futures.ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(run, range(MEMORY_WARM_UP)))
        base = {p.name: _rss_mb(p.popen.pid) for p in stack.procs}
        list(pool.map(run, range(MEMORY_WARM_UP, MEMORY_WARM_UP + MEMORY_REQUESTS)))
    after = {p.name: _rss_mb(p.popen.pid) for p in stack.procs}
    with capsys.disabled():
        print(
            f"\nRSS (MB) after {MEMORY_WARM_UP} and after {MEMORY_REQUESTS} more requests:",
            {name: round(mb, 1) for name, mb in base.items()},
            {name: round(mb, 1) for name, mb in after.items()},
        )
    for proc in stack.workers():
        assert wait_until(
            lambda p=proc: (lambda x: x.num_pinned_transfers == 0 and x.num_running == 0)(
                load(p.endpoint, stack.token)
            ),
            5.0,
        ), proc.name
    assert all(after[name] <= base[name] + MAX_RSS_GROWTH_MEMORY_MB for name in base), (base, after)
