"""Faults and overload against a real stack (a prefill and two decode workers behind a router,
internal RPCs token-protected): admission control, worker death on either side, retries,
engine crash and stall, graceful drain. After every test, every live worker's blocks are all free.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from engine.env import KV_READ_GATE_VAR
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from services.common.security import handle_mac
from services.launcher import Stack, StackConfig, wait_ready
from tests.service_testing import (
    ENGINE_ARGS,
    generate,
    inference,
    kv_transfer,
    load,
    metric,
    start_stack,
    wait_until,
    worker,
)

TOKEN = "reliability-test-token"
MAX_IN_FLIGHT = 4


HELD_AT_GATE = "injected fault: NIXL READ from"
"""What a worker logs when its NIXL READ stops at the read gate."""


@pytest.fixture(scope="module")
def read_gate(tmp_path_factory) -> Path:
    """While this file exists, the workers' NIXL reads stop after their first block (PDSERVE_KV_READ_GATE)."""
    return tmp_path_factory.mktemp("read-gate") / "gate"


@pytest.fixture(scope="module")
def started_stack(tiny_model, tmp_path_factory, read_gate):
    """The module's processes, as started; tests take `stack`, which restarts what they killed."""
    st = start_stack(
        tiny_model,
        tmp_path_factory.mktemp("reliability"),
        num_prefill=1,
        num_decode=2,
        env={"PDSERVE_INTERNAL_TOKEN": TOKEN, KV_READ_GATE_VAR: str(read_gate)},
        engine_args=[*ENGINE_ARGS, "--lease-s", "2", "--grace-s", "5"],
        router_args=[
            "--colocate-max-tokens",
            "0",
            "--max-in-flight",
            str(MAX_IN_FLIGHT),
            "--max-queued",
            "0",
            "--probe-interval-s",
            "2",
        ],
    )
    yield st
    st.stop()


@pytest.fixture
def stack(started_stack):
    """The module's stack with every worker up: a worker an earlier test killed is started again
    here, before the next test that needs the stack, rather than by the test that killed it, so
    none is started for nothing after the last kill (the tests after it run their own workers)."""
    for proc in [p for p in started_stack.workers() if p.popen.poll() is not None]:
        _restart(started_stack, proc)
    return started_stack


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    # One thread, as each worker runs (service_testing): torch's two OpenMP threads, in a process
    # beside the stack's, wait on each other for most of each step.
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256, num_threads=1)


def _live_workers(stack):
    return [p for p in stack.workers() if p.popen.poll() is None]


def _idle(endpoint: str) -> bool:
    load_ = load(endpoint, TOKEN)
    return load_.num_free_blocks == load_.num_total_blocks and load_.num_pinned_transfers == 0


def _holds_nothing(endpoint: str, free: int) -> bool:
    """No transfer pinned and the free blocks back at `free`."""
    load_ = load(endpoint, TOKEN)
    return load_.num_pinned_transfers == 0 and load_.num_free_blocks == free


def _every_worker_idle(stack) -> None:
    """Within 5 s every live worker holds no block and pins no transfer (a handover's release
    reaches its producer after the stream has ended)."""
    for proc in _live_workers(stack):
        assert wait_until(lambda p=proc: _idle(p.endpoint), 5.0), (proc.name, load(proc.endpoint, TOKEN))


@pytest.fixture(autouse=True)
def blocks_return_to_baseline(started_stack):
    yield
    _every_worker_idle(started_stack)


def _restart(stack, proc):
    """Start a killed worker again on its endpoint and wait until the router routes to it."""
    port = int(proc.endpoint.rsplit(":", 1)[1])
    role, index = proc.name.split("-")
    stack.procs.remove(proc)
    new = stack.start_worker(role, int(index), port=port)
    wait_ready(new.endpoint, 60, new.popen)
    stack.wait_routable(time.monotonic() + 30)
    return new


# ---- overload -----------------------------------------------------------------------------------


def test_overload_refuses_fast_over_grpc_and_the_admitted_complete(stack, offline):
    stub = inference(stack)
    prompt = [3 + (i * 5) % 3000 for i in range(24)]
    sampling = pb.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = offline.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    )[0]

    def one(_):
        start = time.monotonic()
        call = stub.Generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling), timeout=60
        )
        try:
            tokens = [t for m in call for t in m.token_ids]
            return "ok", tokens, time.monotonic() - start, None
        except grpc.RpcError as e:
            hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
            return e.code(), None, time.monotonic() - start, hint

    with futures.ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    refused = [r for r in results if r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    done = [r for r in results if r[0] == "ok"]
    assert len(done) == MAX_IN_FLIGHT and len(refused) == 20 - MAX_IN_FLIGHT, [r[0] for r in results]
    assert all(r[1] == ref.token_ids for r in done)
    assert all(r[2] < 1.0 and int(r[3]) > 0 for r in refused)  # refused at once, with a retry hint


def test_overload_is_429_with_retry_after_over_http(stack):
    body = json.dumps(
        {"model": "pdserve-tiny", "prompt": "hello " * 10, "max_tokens": 40, "ignore_eos": True}
    ).encode()

    def one(_):
        req = urllib.request.Request(
            stack.http_url + "/v1/completions", body, {"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.load(r), None
        except urllib.error.HTTPError as e:
            return e.code, json.load(e), e.headers.get("Retry-After")

    with futures.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(12)))
    statuses = sorted(r[0] for r in results)
    assert statuses == [200] * MAX_IN_FLIGHT + [429] * (12 - MAX_IN_FLIGHT)
    for status, payload, retry_after in results:
        if status == 429:
            assert payload["error"]["code"] == "resource_exhausted" and int(retry_after) >= 1
        else:
            assert payload["usage"]["completion_tokens"] == 40


# ---- worker death ---------------------------------------------------------------------------------


def _handover(prefill, decode, prompt: list[int], sampling) -> list[int]:
    first = worker(prefill.endpoint, TOKEN).Prefill(
        wpb.PrefillRequest(prompt_token_ids=prompt, sampling=sampling), timeout=30
    )
    request = wpb.DecodeRequest(
        prompt_token_ids=prompt,
        sampling=sampling,
        output_token_ids=first.output.token_ids,
        kv_handle=first.kv_handle,
        kv_handle_mac=handle_mac(TOKEN, first.kv_handle),
    )
    return [t for m in worker(decode.endpoint, TOKEN).Decode(request, timeout=30) for t in m.token_ids]


@pytest.mark.parametrize(
    "policy, known",
    [("fail", False), ("recompute", False), ("fail", True)],
    ids=["fail", "recompute", "fail-over-nixl"],
)
def test_prefill_worker_death_before_the_pull(stack, offline, policy, known):
    """The decode side frees its blocks and fails (UNAVAILABLE) or recomputes the prompt. known:
    the decode worker has read from this producer over NIXL before (its agent is loaded), so the
    failure comes from the NIXL path (BeginRead, the READ), not from asking the producer."""
    prefill = stack.workers("prefill")[0]
    decode = stack.workers("decode")[0]
    prompt = [7 + (i * 3) % 3000 for i in range(40)]
    sampling = pb.SamplingParams(temperature=0, max_tokens=6)
    if known:
        _handover(prefill, decode, [8 + i for i in range(20)], sampling)
        assert f"KV from producer {prefill.endpoint} moves over NIXL" in decode.log_path.read_text()
    first = worker(prefill.endpoint, TOKEN).Prefill(
        wpb.PrefillRequest(request_id=f"pd-{policy}", prompt_token_ids=prompt, sampling=sampling), timeout=30
    )
    stack.kill(prefill)
    policy_pb = pb.KV_FAILURE_POLICY_RECOMPUTE if policy == "recompute" else pb.KV_FAILURE_POLICY_FAIL
    request = wpb.DecodeRequest(
        request_id=f"pd-{policy}",
        prompt_token_ids=prompt,
        sampling=sampling,
        output_token_ids=first.output.token_ids,
        kv_handle=first.kv_handle,
        kv_handle_mac=handle_mac(TOKEN, first.kv_handle),
        kv_failure_policy=policy_pb,
    )
    stream = worker(decode.endpoint, TOKEN).Decode(request, timeout=30)
    if policy == "fail":
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    else:
        tokens = list(first.output.token_ids) + [t for m in stream for t in m.token_ids]
        ref = offline.generate(
            prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6)
        )[0]
        assert tokens == ref.token_ids


def test_prefill_worker_killed_in_the_middle_of_a_nixl_read(stack, offline, read_gate):
    """Two decodes pull from the prefill worker over NIXL, one per kv_failure_policy; each READ is
    held after its first block has landed (the read gate), the prefill worker is SIGKILLed, the
    gate opens: the rest of each READ fails, the fail policy ends with UNAVAILABLE and the
    recompute policy gives the offline tokens. Meanwhile and afterwards the decode worker serves
    other requests, and its free blocks come back to where they were."""
    prefill = stack.workers("prefill")[0]
    decode = stack.workers("decode")[0]
    # As in the other gated tests, the decode worker's first contact with a restarted prefill
    # worker (`stack` restarts the one the test before killed) goes before the gate, not inside a
    # gated pull: asked over a connection still backing off, it moved that pull over gRPC, past
    # the gate, and the wait below ran out.
    _every_decode_worker_reads_from(prefill, stack)
    stub = worker(decode.endpoint, TOKEN)
    free = load(decode.endpoint, TOKEN).num_free_blocks
    sampling = pb.SamplingParams(temperature=0, max_tokens=6)
    prompts = {
        "fail": [13 + (i * 7) % 3000 for i in range(40)],
        "recompute": [17 + (i * 11) % 3000 for i in range(40)],
    }
    firsts = {
        policy: worker(prefill.endpoint, TOKEN).Prefill(
            wpb.PrefillRequest(prompt_token_ids=prompt, sampling=sampling), timeout=30
        )
        for policy, prompt in prompts.items()
    }

    def decode_with(policy: str):
        first = firsts[policy]
        request = _decode_request(first, prompts[policy], policy)
        try:
            return list(first.output.token_ids) + [
                t for m in stub.Decode(request, timeout=60) for t in m.token_ids
            ]
        except grpc.RpcError as e:
            return e.code()

    def colocated() -> list[int]:
        request = wpb.DecodeRequest(prompt_token_ids=[5, 6, 7, 8], sampling=sampling)
        return [t for m in stub.Decode(request, timeout=30) for t in m.token_ids]

    alone = offline.generate(
        prompt_token_ids=[[5, 6, 7, 8]], sampling_params=SamplingParams(temperature=0, max_tokens=6)
    )
    said = decode.log_path.read_text().count(HELD_AT_GATE)
    read_gate.touch()
    try:
        with futures.ThreadPoolExecutor(2) as pool:
            calls = {policy: pool.submit(decode_with, policy) for policy in prompts}
            assert wait_until(lambda: decode.log_path.read_text().count(HELD_AT_GATE) == said + 2, 30)
            assert load(decode.endpoint, TOKEN).num_free_blocks < free  # both imports hold blocks
            assert colocated() == alone[0].token_ids  # the worker goes on meanwhile
            stack.kill(prefill)
            read_gate.unlink()
            results = {policy: call.result(timeout=60) for policy, call in calls.items()}
        assert results["fail"] == grpc.StatusCode.UNAVAILABLE
        ref = offline.generate(
            prompt_token_ids=[prompts["recompute"]],
            sampling_params=SamplingParams(temperature=0, max_tokens=6),
        )
        assert results["recompute"] == ref[0].token_ids
        assert wait_until(lambda: load(decode.endpoint, TOKEN).num_free_blocks == free, 5)
        assert colocated() == alone[0].token_ids and decode.popen.poll() is None
    finally:
        read_gate.unlink(missing_ok=True)


def _decode_request(first: wpb.PrefillResponse, prompt: list[int], policy: str) -> wpb.DecodeRequest:
    """The Decode that continues a Prefill of `prompt` (max_tokens 6), signed as the router signs it."""
    return wpb.DecodeRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=6),
        output_token_ids=first.output.token_ids,
        kv_handle=first.kv_handle,
        kv_handle_mac=handle_mac(TOKEN, first.kv_handle),
        kv_failure_policy=pb.KV_FAILURE_POLICY_RECOMPUTE
        if policy == "recompute"
        else pb.KV_FAILURE_POLICY_FAIL,
    )


def _kill_and_expect_unavailable(stack, victim, stream) -> None:
    """SIGKILL the worker serving `stream`: the rest of the stream ends UNAVAILABLE within 5 s."""
    stack.kill(victim)
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - t0 < 5.0


def _offline_tokens(offline: LLM, prompt: list[int]) -> list[int]:
    return offline.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=6)
    )[0].token_ids


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_decode_worker_killed_in_the_middle_of_a_nixl_read(stack, offline, read_gate, policy):
    """A disaggregated request through the router; its decode worker's READ is held after the
    first block (the read gate) and that worker is SIGKILLed. The first token has reached the
    client, so the router does not retry it elsewhere, whatever the kv_failure_policy (the client
    would see the token twice): the stream ends UNAVAILABLE within 5 s. The router releases the
    export the dead worker never answered for: the prefill worker pins nothing and has its free
    blocks back within 5 s (the stack's lease is 2 s; the READ's hold on the blocks alone would
    last far longer), and serves the same request again with the offline tokens."""
    prefill = stack.workers("prefill")[0]
    _every_decode_worker_reads_from(prefill, stack)
    free = load(prefill.endpoint, TOKEN).num_free_blocks
    # New to every decode worker: a READ of one block (the rest cached) is not held at the gate.
    prompt = [23 + len(policy) + (i * 17) % 3000 for i in range(40)]
    sampling = pb.SamplingParams(temperature=0, max_tokens=6)
    policy_pb = pb.KV_FAILURE_POLICY_RECOMPUTE if policy == "recompute" else pb.KV_FAILURE_POLICY_FAIL
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=sampling,
        mode=pb.SERVING_MODE_DISAGGREGATED,
        kv_failure_policy=policy_pb,
    )
    ref = _offline_tokens(offline, prompt)
    reading = _held_at_gate_from_now(stack)
    stub = inference(stack)
    read_gate.touch()
    try:
        stream = iter(stub.Generate(request, timeout=60))
        assert list(next(stream).token_ids) == ref[:1]  # from the prefill worker
        assert wait_until(lambda: len(reading()) == 1, 30), _log_tails(stack)
        victim = reading()[0]
        assert load(prefill.endpoint, TOKEN).num_pinned_transfers == 1  # under the READ
        _kill_and_expect_unavailable(stack, victim, stream)
        assert wait_until(lambda: _holds_nothing(prefill.endpoint, free), 5.0), load(prefill.endpoint, TOKEN)
        read_gate.unlink()
        tokens, _ = generate(
            stub,
            token_ids=pb.TokenIds(ids=prompt),
            sampling=sampling,
            mode=pb.SERVING_MODE_DISAGGREGATED,
            kv_failure_policy=policy_pb,
        )
        assert tokens == ref and prefill.popen.poll() is None
    finally:
        read_gate.unlink(missing_ok=True)


_WARM_UP_PROMPTS = itertools.count()


def _every_decode_worker_reads_from(prefill, stack) -> None:
    """Each decode worker takes one ungated handover from `prefill` (a prompt new to it), so a
    gated request after this does not also carry the decode worker's first contact with a
    restarted producer -- GetEngineInfo, loading its NIXL agent, UCX's wire-up -- inside the
    stack's 2 s lease. A first contact that fails or hangs fails here, saying so. Returns once
    every worker is idle again, so a caller's baseline of free blocks is not read while the
    prefill worker still pins a warm-up's export (its release comes after the stream ends: CI
    at 124d9be read one such baseline and failed)."""
    sampling = pb.SamplingParams(temperature=0, max_tokens=2)
    for decode in stack.workers("decode"):
        n = next(_WARM_UP_PROMPTS)
        prompt = [2000 + (n * 31 + i * 7) % 900 for i in range(20)]
        assert len(_handover(prefill, decode, prompt, sampling)) == 1, _log_tails(stack)
    _every_worker_idle(stack)


def _log_tails(stack, lines: int = 12) -> str:
    """The last lines of every stack process's log, for a failed wait's message."""
    return "\n".join(
        f"--- {p.name}:\n" + "\n".join(p.log_path.read_text().splitlines()[-lines:]) for p in stack.procs
    )


def _held_at_gate_from_now(stack):
    """-> a call that lists the decode workers whose NIXL READ stopped at the gate since now."""
    said = {p.name: p.log_path.read_text().count(HELD_AT_GATE) for p in stack.workers("decode")}

    def reading() -> list:
        return [
            p for p in stack.workers("decode") if p.log_path.read_text().count(HELD_AT_GATE) > said[p.name]
        ]

    return reading


def test_a_request_cancelled_in_the_middle_of_its_nixl_read(stack, offline, read_gate):
    """The client cancels a disaggregated request while its decode worker's READ is held after the
    first block (the read gate): the router cancels the Decode, the READ is cancelled and lets go
    of its handle, and both sides free what they held exactly once -- every worker's free blocks
    come back to where they were, not below and not above, and nothing stays pinned -- while the
    gate is still shut. Then the same request gives the offline tokens."""
    prompt = [37 + (i * 13) % 3000 for i in range(40)]
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0, max_tokens=6),
        mode=pb.SERVING_MODE_DISAGGREGATED,
    )
    ref = _offline_tokens(offline, prompt)
    prefill = stack.workers("prefill")[0]
    _every_decode_worker_reads_from(prefill, stack)
    free = {p.name: load(p.endpoint, TOKEN).num_free_blocks for p in stack.workers()}
    reading = _held_at_gate_from_now(stack)
    stub = inference(stack)
    read_gate.touch()
    try:
        call = stub.Generate(request, timeout=60)
        assert list(next(call).token_ids) == ref[:1]
        assert wait_until(lambda: len(reading()) == 1, 30), _log_tails(stack)
        assert load(prefill.endpoint, TOKEN).num_pinned_transfers == 1  # under the READ
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert wait_until(
            lambda: all(_holds_nothing(p.endpoint, free[p.name]) for p in stack.workers()), 5.0
        ), {p.name: load(p.endpoint, TOKEN) for p in stack.workers()}
        assert read_gate.exists()  # the READ ended by its cancellation, not by the gate
    finally:
        read_gate.unlink(missing_ok=True)
    tokens, _ = generate(
        stub, token_ids=pb.TokenIds(ids=prompt), sampling=request.sampling, mode=request.mode
    )
    assert tokens == ref and all(p.popen.poll() is None for p in stack.workers())


def test_a_nixl_read_outlives_a_lease_that_runs_out_under_it(stack, offline, read_gate):
    """The export's lease (300 ms) runs out while the decode worker's READ is held at the gate:
    the READ's hold keeps the blocks pinned (the sweep does not end an export being read), the
    READ completes with the offline tokens once the gate opens, and the decode worker's release
    then frees the blocks on the prefill worker."""
    prefill, decode = stack.workers("prefill")[0], stack.workers("decode")[0]
    free = load(prefill.endpoint, TOKEN).num_free_blocks
    prompt = [29 + (i * 19) % 3000 for i in range(40)]
    first = worker(prefill.endpoint, TOKEN).Prefill(
        wpb.PrefillRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(temperature=0, max_tokens=6), lease_ms=300
        ),
        timeout=30,
    )
    said = decode.log_path.read_text().count(HELD_AT_GATE)
    stub = worker(decode.endpoint, TOKEN)
    read_gate.touch()
    try:
        with futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(
                lambda: [
                    t
                    for m in stub.Decode(_decode_request(first, prompt, "fail"), timeout=30)
                    for t in m.token_ids
                ]
            )
            assert wait_until(lambda: decode.log_path.read_text().count(HELD_AT_GATE) == said + 1, 30)
            # Time itself is what we wait for here: the lease's end, and the sweeps after it.
            time.sleep(max(0.0, first.kv_handle.lease_expiry_unix_ms / 1000 - time.time()) + 1.0)
            assert load(prefill.endpoint, TOKEN).num_pinned_transfers == 1
            read_gate.unlink()
            tokens = list(first.output.token_ids) + call.result(timeout=30)
        assert tokens == _offline_tokens(offline, prompt)
        assert wait_until(lambda: _holds_nothing(prefill.endpoint, free), 5.0), load(prefill.endpoint, TOKEN)
    finally:
        read_gate.unlink(missing_ok=True)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("end", ["expired", "aborted"])
def test_a_nixl_handle_whose_export_ended_before_the_read(stack, offline, end, policy):
    """The export behind a handle ended before the decode worker's BeginRead: its lease ran out
    (the decode side came too late), or someone released it (abort; the router does when it gave
    up on the decode side). BeginRead is refused, so what the READ posted meanwhile (the handle
    names the blocks) is dropped: the fail policy ends the
    Decode with NOT_FOUND naming the end, the recompute policy gives the offline tokens; the
    decode worker's free blocks come back and the prefill worker pins nothing."""
    prefill, decode = stack.workers("prefill")[0], stack.workers("decode")[0]
    _handover(prefill, decode, [9 + i for i in range(20)], pb.SamplingParams(temperature=0, max_tokens=2))
    assert f"KV from producer {prefill.endpoint} moves over NIXL" in decode.log_path.read_text()
    free = load(decode.endpoint, TOKEN).num_free_blocks
    prompt = [31 + len(end) + len(policy) + (i * 23) % 3000 for i in range(40)]
    first = worker(prefill.endpoint, TOKEN).Prefill(
        wpb.PrefillRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0, max_tokens=6),
            lease_ms=300 if end == "expired" else 0,
        ),
        timeout=30,
    )
    transfer_id = first.kv_handle.transfer_id
    if end == "aborted":
        kv_transfer(prefill.endpoint, TOKEN).Release(
            kv_pb.ReleaseRequest(transfer_id=transfer_id, reason=kv_pb.RELEASE_REASON_ABORT), timeout=5
        )
    assert wait_until(lambda: load(prefill.endpoint, TOKEN).num_pinned_transfers == 0, 5.0)
    stream = worker(decode.endpoint, TOKEN).Decode(_decode_request(first, prompt, policy), timeout=30)
    if policy == "fail":
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND, err.value.details()
        assert f"BeginRead of transfer {transfer_id}" in err.value.details()
        assert f"has ended ({end})" in err.value.details()
    else:
        tokens = list(first.output.token_ids) + [t for m in stream for t in m.token_ids]
        assert tokens == _offline_tokens(offline, prompt)
        assert f"KV transfer failed (BeginRead of transfer {transfer_id}" in decode.log_path.read_text()
    assert wait_until(lambda: load(decode.endpoint, TOKEN).num_free_blocks == free, 5.0)
    assert load(prefill.endpoint, TOKEN).num_pinned_transfers == 0


def test_a_new_channel_to_a_restarted_peer_connects_at_once():
    """What a decode worker relies on to retry a pull on a fresh connection: a channel opened
    after the peer came back does not inherit the failed channel's reconnect backoff."""
    from grpc_health.v1 import health

    from services.common.grpc_utils import channel
    from services.launcher import free_port

    port = free_port()
    endpoint = f"127.0.0.1:{port}"

    async def serve() -> grpc.aio.Server:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(endpoint)
        await server.start()
        return server

    async def check(ch) -> grpc.StatusCode:
        try:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return grpc.StatusCode.OK
        except grpc.RpcError as e:
            return e.code()

    async def scenario() -> list[grpc.StatusCode]:
        server = await serve()
        old = channel(endpoint)
        codes = [await check(old)]
        await server.stop(None)
        codes.append(await check(old))  # the peer is gone: the old channel backs off
        server = await serve()
        fresh = channel(endpoint)
        codes.append(await check(fresh))
        await server.stop(None)
        await old.close()
        await fresh.close()
        return codes

    assert asyncio.run(scenario()) == [grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.OK]


def test_decode_worker_killed_mid_stream(stack):
    """The client stream ends within 5 s with UNAVAILABLE, the router marks the worker unhealthy
    and routes around it, the prefill side holds nothing."""
    stub = inference(stack)
    prompt = [11 + (i * 9) % 3000 for i in range(40)]
    call = stub.Generate(
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0, max_tokens=500, ignore_eos=True),
            mode=pb.SERVING_MODE_DISAGGREGATED,
        ),
        timeout=120,
    )
    it = iter(call)
    seen = 0
    while seen < 3:
        seen += len(next(it).token_ids)
    victim = next(p for p in stack.workers("decode") if load(p.endpoint, TOKEN).num_running > 0)
    _kill_and_expect_unavailable(stack, victim, it)
    info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
    assert [w.healthy for w in info.workers if w.endpoint == victim.endpoint] == [False]
    tokens, msgs = generate(
        stub,
        text="after the crash",
        sampling=pb.SamplingParams(temperature=0, max_tokens=5),
        mode=pb.SERVING_MODE_DISAGGREGATED,
    )
    assert len(tokens) == 5


def test_unavailable_before_the_first_token_is_retried_on_another_worker(stack, offline):
    """With both decode workers idle the router picks the first by endpoint; kill it and the next
    colocated request fails there (UNAVAILABLE, nothing sent yet) and completes on the other."""
    stub = inference(stack)
    first = min(stack.workers("decode"), key=lambda p: p.endpoint)
    metrics_text = lambda: urllib.request.urlopen(stack.http_url + "/metrics").read().decode()
    retries_before = metric(metrics_text(), "pdserve_request_retries_total")
    stack.kill(first)
    prompt = [13 + (i * 11) % 3000 for i in range(20)]
    tokens, _ = generate(
        stub,
        token_ids=pb.TokenIds(ids=prompt),
        sampling=pb.SamplingParams(temperature=0, max_tokens=5),
        mode=pb.SERVING_MODE_COLOCATED,
    )
    ref = offline.generate(
        prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=5)
    )[0]
    assert tokens == ref.token_ids
    assert metric(metrics_text(), "pdserve_request_retries_total") == retries_before + 1


# ---- the engine thread dying or stalling, drain --------------------------------------------------------


def _standalone(tiny_model, *extra: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    engine = [*ENGINE_ARGS, "--num-threads", "1", *extra]
    env = {"PDSERVE_INTERNAL_TOKEN": TOKEN, **(env or {})}
    worker = Stack(StackConfig(tiny_model, engine_args=engine, env=env)).start_worker("colocated", 0)
    wait_ready(worker.endpoint, 60, worker.popen)
    return worker.popen, worker.endpoint


def _liveness(endpoint: str):
    try:
        with grpc.insecure_channel(endpoint) as ch:
            request = health_pb2.HealthCheckRequest(service="liveness")
            return health_pb2_grpc.HealthStub(ch).Check(request, timeout=1).status
    except grpc.RpcError:
        return None  # gone


@pytest.mark.parametrize("fault", ["engine_crash_after_steps=3", "engine_stall_after_steps=3"])
def test_engine_crash_or_stall_fails_liveness_and_exits_nonzero(tiny_model, fault):
    """The request in flight ends with an error status, liveness turns NOT_SERVING (while the
    process still answers), and the process exits non-zero."""
    proc, endpoint = _standalone(tiny_model, "--stall-timeout-s", "1", env={"PDSERVE_FAULT": fault})
    try:
        assert _liveness(endpoint) == health_pb2.HealthCheckResponse.SERVING
        sampling = pb.SamplingParams(max_tokens=50, ignore_eos=True)
        request = wpb.DecodeRequest(
            request_id="doomed", prompt_token_ids=list(range(5, 25)), sampling=sampling
        )
        with futures.ThreadPoolExecutor(1) as pool:
            outcome = pool.submit(lambda: list(worker(endpoint, TOKEN).Decode(request, timeout=30)))
            seen = wait_until(
                lambda: _liveness(endpoint) == health_pb2.HealthCheckResponse.NOT_SERVING, 10.0, 0.02
            )
            with pytest.raises(grpc.RpcError) as err:
                outcome.result(timeout=30)
        assert seen
        assert err.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        assert proc.wait(timeout=30) != 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_drains_in_flight_streams_refuses_new_work_and_exits_zero(tiny_model, offline):
    proc, endpoint = _standalone(tiny_model, "--grace-s", "30")
    stub = worker(endpoint, TOKEN)
    prompt = list(range(40, 60))
    sampling = pb.SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    call = stub.Decode(
        wpb.DecodeRequest(request_id="in-flight", prompt_token_ids=prompt, sampling=sampling), timeout=60
    )
    it = iter(call)
    tokens = list(next(it).token_ids)
    proc.send_signal(signal.SIGTERM)
    with grpc.insecure_channel(endpoint) as ch:
        ready = lambda: (
            health_pb2_grpc.HealthStub(ch)
            .Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
            .status
        )
        assert wait_until(lambda: ready() == health_pb2.HealthCheckResponse.NOT_SERVING, 2.0)
    with pytest.raises(grpc.RpcError) as err:
        list(
            stub.Decode(
                wpb.DecodeRequest(request_id="late", prompt_token_ids=prompt, sampling=sampling), timeout=10
            )
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.value.details()
    tokens += [t for m in it for t in m.token_ids]
    ref = offline.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(temperature=0, max_tokens=120, ignore_eos=True),
    )[0]
    assert tokens == ref.token_ids  # the in-flight stream finished in full
    assert proc.wait(timeout=30) == 0
