"""The audit's reproductions against a running stack (router, prefill and decode worker as
processes, the stack's default configuration): each one failed before its fix.

Every test leaves the shared stack as it found it: nothing pinned, KV back to its baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent import futures

import grpc
import pytest

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from pdserve.v1 import worker_pb2 as wpb
from tests.service_testing import inference, kv_transfer, load, wait_until, worker

DISAGGREGATED = pb.SERVING_MODE_DISAGGREGATED


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


@pytest.fixture(scope="module")
def endpoints(stack) -> tuple[str, str]:
    return stack.workers("prefill")[0].endpoint, stack.workers("decode")[0].endpoint


def _baseline(stack, endpoints) -> tuple[int, int]:
    prefill, decode = endpoints
    return load(prefill, stack.token).num_free_blocks, load(decode, stack.token).num_free_blocks


def _back_to(stack, endpoints, base: tuple[int, int], timeout: float) -> bool:
    prefill, decode = endpoints

    def idle() -> bool:
        p, d = load(prefill, stack.token), load(decode, stack.token)
        return (p.num_free_blocks, d.num_free_blocks) == base and p.num_pinned_transfers == 0

    return wait_until(idle, timeout)


def _post(stack, path: str, raw: bytes, timeout: float = 30) -> tuple[int, dict]:
    req = urllib.request.Request(
        stack.http_url + path, data=raw, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_reused_request_id_is_a_label_and_leaks_nothing(stack, endpoints):
    """Audit 1: concurrent requests with one client request_id used to overwrite each other's
    exported KV on the prefill worker, pinning it for good."""
    base = _baseline(stack, endpoints)
    stub = inference(stack)

    def run(i: int) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(
            request_id="X",
            token_ids=pb.TokenIds(ids=[7 + (i * 31 + j * 13) % 3000 for j in range(40)]),
            sampling=pb.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            mode=DISAGGREGATED,
        )
        return list(stub.Generate(request, timeout=60))

    for _ in range(2):
        with futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(run, range(8)))
        for msgs in results:
            assert {m.request_id for m in msgs} == {"X"}  # echoed as given
            assert sum(len(m.token_ids) for m in msgs) == 6
    assert _back_to(stack, endpoints, base, 5.0), (load(endpoints[0], stack.token), base)


def test_cancel_right_after_the_first_token_leaves_nothing_pinned(stack, endpoints):
    """Audit 9: the router counted the KV as handed over before the decode worker had the
    request, so cancelling right after the first token left the transfer pinned until its lease ran out."""
    base = _baseline(stack, endpoints)
    stub = inference(stack)
    for i in range(100):
        call = stub.Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5 + (i * 7 + j) % 3000 for j in range(40)]),
                sampling=pb.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                mode=DISAGGREGATED,
            ),
            timeout=60,
        )
        next(call)  # the first token (sent by the router as soon as the prefill worker has it)
        call.cancel()
    t0 = time.monotonic()
    assert _back_to(stack, endpoints, base, 1.0), (load(endpoints[0], stack.token), base)
    assert time.monotonic() - t0 <= 1.0


def test_oversized_prompts_do_not_stall_a_running_stream(stack, endpoints):
    """Audit 6: the router tokenized on its event loop, before any length check: 16 oversized
    requests froze running streams and /health for seconds. Now a text too long to fit is refused
    from its byte length, and parsing, tokenizing and the length check happen off the loop,
    inside admission."""
    base = _baseline(stack, endpoints)

    def gaps_of_a_stream() -> list[float]:
        call = inference(stack).Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(10, 60))),
                sampling=pb.SamplingParams(temperature=0, max_tokens=300, ignore_eos=True),
                mode=DISAGGREGATED,
            ),
            timeout=120,
        )
        times = [time.monotonic() for _ in call]
        return [b - a for a, b in zip(times[1:], times[2:], strict=False)]

    quiet = gaps_of_a_stream()
    # The hostile client is its own process at the lowest priority: a remote attacker's CPU is
    # not ours. The stream starts once its requests are on their way.
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, stack.http_url],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.nice(19),
    )
    assert flood.stdout.readline().strip() == "sending"
    busy = gaps_of_a_stream()
    answers = [json.loads(line) for line in flood.communicate(timeout=120)[0].splitlines()]
    assert len(answers) == 16
    for status, body in answers:
        assert status == 400 and body["error"]["param"] == "prompt", body
        assert "max_model_len" in body["error"]["message"]
    assert max(busy) <= max(quiet) + 0.1, (max(quiet), max(busy))
    assert _back_to(stack, endpoints, base, 5.0)


# 16 concurrent completions: ~1 MB prompts (refused from their byte length) and ~380 KB ones
# (tokenized, then refused for their token count); prints "sending" once they start, then one
# [status, body] line each.
FLOOD = r"""
import json, sys, threading, urllib.error, urllib.request
url = sys.argv[1] + "/v1/completions"
bodies = [json.dumps({"prompt": "lorem ipsum dolor sit amet " * n, "max_tokens": 4}).encode() for n in (38_000, 14_000)]
out = []
def post(raw):
    req = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            out.append([r.status, json.loads(r.read())])
    except urllib.error.HTTPError as e:
        out.append([e.code, json.loads(e.read())])
threads = [threading.Thread(target=post, args=(bodies[i % 2],)) for i in range(16)]
[t.start() for t in threads]
print("sending", flush=True)
[t.join() for t in threads]
print("\n".join(json.dumps(o) for o in out))
"""


@pytest.mark.parametrize(
    "raw, param, words",
    [
        (b"[" * 10_000 + b"]" * 10_000, None, "deeper"),
        (b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt", "surrogate"),
        (b'{"prompt": "hi", "stop": ["\\udfff"], "max_tokens": 2}', "stop", "surrogate"),
        (b'{"prompt": "hi", "seed": 9223372036854775808, "max_tokens": 2}', "seed", "2**63"),
        (b'{"prompt": "hi", "top_k": 2147483648, "max_tokens": 2}', "top_k", "2**31"),
        (json.dumps({"prompt": "hi", "stop": ["x" * 40_000] * 4}).encode(), "stop", "limit"),
        (json.dumps({"prompt": ["a"] * 64, "n": 16}).encode(), "n", "max_generations_per_request"),
    ],
    ids=["nested", "surrogate-prompt", "surrogate-stop", "seed-2^63", "top_k-2^31", "stop-40k", "64x16"],
)
def test_hostile_completion_bodies_get_a_400_naming_the_field(stack, raw, param, words):
    """Audit 10 and 8: each of these was a 500 (or took every router slot)."""
    status, body = _post(stack, "/v1/completions", raw)
    assert status == 400, body
    assert body["error"]["param"] == param and words in body["error"]["message"], body


def test_hostile_chat_content_gets_a_400(stack):
    raw = b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}'
    status, body = _post(stack, "/v1/chat/completions", raw)
    assert status == 400 and "surrogate" in body["error"]["message"], body


def test_unknown_enum_values_over_grpc_are_invalid_argument(stack):
    stub = inference(stack)
    for request in (
        pb.GenerateRequest(text="hi", mode=99),
        pb.GenerateRequest(text="hi", kv_failure_policy=42),
    ):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_forged_internal_calls_are_refused_on_a_default_stack(stack, endpoints):
    """Audit 3-5: with the stack's defaults nobody without the internal token can Prefill,
    Decode, Drain or renew a lease; the workers keep serving."""
    prefill, decode = endpoints
    calls = [
        lambda stub, kv: stub.Prefill(wpb.PrefillRequest(prompt_token_ids=[1, 2, 3]), timeout=5),
        lambda stub, kv: list(stub.Decode(wpb.DecodeRequest(prompt_token_ids=[1, 2, 3]), timeout=5)),
        lambda stub, kv: stub.Drain(wpb.DrainRequest(), timeout=5),
        lambda stub, kv: kv.RenewLease(kv_pb.RenewLeaseRequest(transfer_id="t", lease_ms=10**9), timeout=5),
        lambda stub, kv: kv.Release(kv_pb.ReleaseRequest(transfer_id="t"), timeout=5),
    ]
    for endpoint in (prefill, decode):
        for token, code in (
            (None, grpc.StatusCode.UNAUTHENTICATED),
            ("guess", grpc.StatusCode.PERMISSION_DENIED),
        ):
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call(worker(endpoint, token), kv_transfer(endpoint, token))
                assert err.value.code() == code
    for endpoint in (prefill, decode):
        assert not load(endpoint, stack.token).draining
    tokens = [
        t
        for m in inference(stack).Generate(
            pb.GenerateRequest(text="hello", sampling=pb.SamplingParams(max_tokens=2, temperature=0)),
            timeout=60,
        )
        for t in m.token_ids
    ]
    assert len(tokens) >= 1
