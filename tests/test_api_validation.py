"""Bad input on both public APIs of a real stack: one case per rule, a clear error naming the
field (HTTP 400 with an OpenAI error body / INVALID_ARGUMENT), never a 5xx or INTERNAL; fuzzed
bodies and messages; and afterwards a normal request still gets the right answer."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import kv_transfer_pb2 as kv_pb
from tests.service_testing import generate, inference, kv_transfer, load

MODEL = "pdserve-tiny"
LONG = 5000  # > the tiny model's max_model_len (4096)
OK = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


def post(stack, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(stack.http_url + path, data, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


HTTP_CASES = [
    ("prompt-empty", {**OK, "prompt": ""}, 400, "prompt"),
    ("prompt-too-long", {**OK, "prompt": [5] * LONG}, 400, "prompt"),
    ("prompt-plus-max-tokens-over-context", {**OK, "prompt": [5] * 100, "max_tokens": 4000}, 400, "prompt"),
    ("token-id-out-of-range", {**OK, "prompt": [5, 10**6]}, 400, "prompt"),
    ("temperature-nan", {**OK, "temperature": math.nan}, 400, "temperature"),
    ("temperature-negative", {**OK, "temperature": -1}, 400, "temperature"),
    ("temperature-above-2", {**OK, "temperature": 2.5}, 400, "temperature"),
    ("top_p-zero", {**OK, "top_p": 0}, 400, "top_p"),
    ("top_k-zero", {**OK, "top_k": 0}, 400, "top_k"),
    ("min_p-above-1", {**OK, "min_p": 1.5}, 400, "min_p"),
    ("n-zero", {**OK, "n": 0}, 400, "n"),
    ("n-above-16", {**OK, "n": 17}, 400, "n"),
    ("logprobs-above-20", {**OK, "logprobs": 21}, 400, "logprobs"),
    ("stop-17-strings", {**OK, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("stop-empty-string", {**OK, "stop": ["ok", ""]}, 400, "stop"),
    ("logit_bias-bad-key", {**OK, "logit_bias": {"nope": 1}}, 400, "logit_bias"),
    ("logit_bias-key-out-of-vocab", {**OK, "logit_bias": {"999999": 1}}, 400, "logit_bias"),
    ("unknown-model", {**OK, "model": "gpt-17"}, 404, "model"),
    ("max_tokens-wrong-type", {**OK, "max_tokens": "x"}, 400, "max_tokens"),
    ("temperature-wrong-type", {**OK, "temperature": "hot"}, 400, "temperature"),
    ("stream-wrong-type", {**OK, "stream": "yes"}, 400, "stream"),
    ("body-not-an-object", [1, 2, 3], 400, None),
]


@pytest.mark.parametrize("body,status,param", [c[1:] for c in HTTP_CASES], ids=[c[0] for c in HTTP_CASES])
def test_http_completions_validation(stack, body, status, param):
    got, payload = post(stack, "/v1/completions", body)
    assert got == status, payload
    assert payload["error"]["param"] == param and payload["error"]["message"]


def test_http_malformed_json_and_chat_rules(stack):
    got, payload = post(stack, "/v1/completions", b'{"model": "pdserve-tiny", "prompt": ')
    assert got == 400 and "JSON" in payload["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for body, param in (
        ({**chat, "messages": []}, "messages"),
        ({**chat, "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({**chat, "top_logprobs": 3}, "top_logprobs"),
        ({**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**chat, "max_completion_tokens": 0}, "max_completion_tokens"),
    ):
        got, payload = post(stack, "/v1/chat/completions", body)
        assert got == 400 and payload["error"]["param"] == param, payload


def _sp(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=kw.pop("max_tokens", 4), **kw)


GRPC_CASES = [
    ("prompt-missing", pb.GenerateRequest(sampling=_sp()), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    ("prompt-empty", pb.GenerateRequest(text="", sampling=_sp()), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
    (
        "prompt-too-long",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * LONG), sampling=_sp()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_model_len",
    ),
    (
        "prompt-plus-max-tokens-over-context",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 100), sampling=_sp(max_tokens=4000)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens",
    ),
    (
        "token-id-out-of-range",
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 10**6]), sampling=_sp()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "prompt_token_ids[1]",
    ),
    (
        "temperature-nan",
        pb.GenerateRequest(text="hi", sampling=_sp(temperature=math.nan)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        "temperature-negative",
        pb.GenerateRequest(text="hi", sampling=_sp(temperature=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        "temperature-above-2",
        pb.GenerateRequest(text="hi", sampling=_sp(temperature=2.5)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "temperature",
    ),
    (
        "top_p-zero",
        pb.GenerateRequest(text="hi", sampling=_sp(top_p=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_p",
    ),
    (
        "top_k-zero",
        pb.GenerateRequest(text="hi", sampling=_sp(top_k=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "top_k",
    ),
    (
        "min_p-above-1",
        pb.GenerateRequest(text="hi", sampling=_sp(min_p=1.5)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "min_p",
    ),
    (
        "max_tokens-zero",
        pb.GenerateRequest(text="hi", sampling=_sp(max_tokens=0)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "max_tokens",
    ),
    (
        "logprobs-above-20",
        pb.GenerateRequest(text="hi", sampling=_sp(logprobs=21)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "logprobs",
    ),
    (
        "stop-17-strings",
        pb.GenerateRequest(text="hi", sampling=_sp(stop=[f"s{i}" for i in range(17)])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop",
    ),
    (
        "stop-empty-string",
        pb.GenerateRequest(text="hi", sampling=_sp(stop=["ok", ""])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop",
    ),
    (
        "logit_bias-key-out-of-vocab",
        pb.GenerateRequest(text="hi", sampling=_sp(logit_bias={999999: 1.0})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "logit_bias",
    ),
    (
        "logit_bias-value",
        pb.GenerateRequest(text="hi", sampling=_sp(logit_bias={5: 1000.0})),
        grpc.StatusCode.INVALID_ARGUMENT,
        "logit_bias",
    ),
    (
        "stop_token_id-out-of-vocab",
        pb.GenerateRequest(text="hi", sampling=_sp(stop_token_ids=[10**6])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "stop_token_ids",
    ),
    (
        "unknown-model",
        pb.GenerateRequest(text="hi", model="gpt-17", sampling=_sp()),
        grpc.StatusCode.NOT_FOUND,
        "gpt-17",
    ),
    (
        "chat-empty",
        pb.GenerateRequest(chat=pb.Chat(), sampling=_sp()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "chat.messages",
    ),
    (
        "chat-unknown-role",  # the template renders no such role: refused, as over HTTP, not dropped
        pb.GenerateRequest(
            chat=pb.Chat(
                messages=[
                    pb.ChatMessage(role="user", content="hi"),
                    pb.ChatMessage(role="wizard", content="x"),
                ]
            ),
            sampling=_sp(),
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "chat.messages[1].role must be one of ['system', 'user', 'assistant', 'developer', 'tool'], got 'wizard'",
    ),
]


@pytest.mark.parametrize("request_,code,field", [c[1:] for c in GRPC_CASES], ids=[c[0] for c in GRPC_CASES])
def test_grpc_generate_validation(stack, request_, code, field):
    with pytest.raises(grpc.RpcError) as err:
        list(inference(stack).Generate(request_, timeout=30))
    assert err.value.code() == code and field in err.value.details(), err.value.details()


def test_developer_role_renders_as_system_over_grpc(stack):
    """OpenAI's developer role is the system prompt under a newer name: the same prompt tokens."""

    def tokens(role: str) -> list[int]:
        chat = pb.Chat(
            messages=[
                pb.ChatMessage(role=role, content="be brief"),
                pb.ChatMessage(role="user", content="hi"),
            ]
        )
        return list(inference(stack).Tokenize(pb.TokenizeRequest(chat=chat), timeout=30).token_ids)

    assert tokens("developer") == tokens("system") != tokens("user")


def test_after_all_that_a_normal_request_gets_the_right_answer(stack, tiny_model):
    from engine import LLM

    ref = LLM(tiny_model, dtype="float32", num_kv_blocks=64).generate(
        ["def f(x):"], SamplingParams(temperature=0, max_tokens=4)
    )[0]
    tokens, _ = generate(
        inference(stack), text="def f(x):", sampling=pb.SamplingParams(temperature=0, max_tokens=4)
    )
    assert tokens == ref.token_ids
    got, payload = post(stack, "/v1/completions", OK)
    assert got == 200 and payload["choices"][0]["text"] == ref.text
    for proc in stack.workers():
        idle = load(proc.endpoint, stack.token)
        assert idle.num_running == 0 and idle.num_waiting == 0 and idle.num_pinned_transfers == 0


def test_logit_bias_reaches_the_engine_over_both_apis(stack):
    forced = 1234
    got, payload = post(stack, "/v1/completions", {**OK, "logit_bias": {str(forced): 100}})
    assert got == 200
    tokens, _ = generate(
        inference(stack),
        text="def f(x):",
        sampling=pb.SamplingParams(temperature=0, max_tokens=3, logit_bias={forced: 100.0}),
    )
    assert tokens == [forced] * 3


# ---- fuzz ----------------------------------------------------------------------------------------

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stream",
    "logprobs",
    "top_logprobs",
    "stop",
    "seed",
    "logit_bias",
    "min_tokens",
    "ignore_eos",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "mode",
    "stream_options",
    "echo",
]
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=8,
)


def _quick(body: dict) -> dict:
    """Keep valid requests short: a missing or large integer max_tokens becomes 2 (chat would
    otherwise default to the rest of the context window)."""
    value = body.get("max_tokens")
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and not 1 <= value <= 3):
        return {**body, "max_tokens": 2}
    return body


bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).map(_quick)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@FUZZ
@given(body=bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_http_bodies_never_5xx(serving_stack, body, path):
    status, payload = post(serving_stack, path, body)
    assert status < 500, (status, payload)
    if status >= 400:
        assert payload["error"]["message"]


sampling_msgs = st.builds(
    pb.SamplingParams,
    temperature=st.floats(allow_nan=True) | st.none(),
    top_p=st.floats(allow_nan=True) | st.none(),
    top_k=st.integers(-(2**31), 2**31 - 1) | st.none(),
    min_p=st.floats(allow_nan=True) | st.none(),
    max_tokens=st.integers(-(2**31), 3) | st.none(),
    min_tokens=st.integers(-(2**31), 2**31 - 1) | st.none(),
    logprobs=st.integers(-(2**31), 2**31 - 1) | st.none(),
    stop=st.lists(st.text(max_size=5), max_size=20),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
    logit_bias=st.dictionaries(st.integers(-(2**31), 2**31 - 1), st.floats(allow_nan=True), max_size=3),
    seed=st.integers(-(2**63), 2**63 - 1) | st.none(),
)
generate_msgs = st.builds(
    pb.GenerateRequest,
    request_id=st.text(max_size=10),
    model=st.sampled_from(["", MODEL, "other"]),
    text=st.text(max_size=40) | st.none(),
    sampling=sampling_msgs,
    mode=st.integers(0, 2),
)


@FUZZ
@given(request_=generate_msgs)
def test_fuzzed_generate_messages_never_internal(serving_stack, request_):
    try:
        list(inference(serving_stack).Generate(request_, timeout=30))
    except grpc.RpcError as e:
        assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), e.details()


@FUZZ
@given(
    request_=st.builds(
        kv_pb.PullRequest,
        transfer_id=st.text(max_size=40),
        epoch=st.integers(0, 2**64 - 1),
        first_block=st.integers(-(2**31), 2**31 - 1),
        max_chunk_bytes=st.integers(-(2**63), 2**63 - 1),
    )
)
def test_fuzzed_pull_requests_never_internal(serving_stack, request_):
    stub = kv_transfer(serving_stack.workers("prefill")[0].endpoint, serving_stack.token)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Pull(request_, timeout=10))
    assert err.value.code() in (
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
    )


def test_the_stack_is_alive_after_the_fuzz(serving_stack):
    assert all(p.popen.poll() is None for p in serving_stack.procs)
    tokens, _ = generate(
        inference(serving_stack), text="alive?", sampling=pb.SamplingParams(temperature=0, max_tokens=2)
    )
    assert len(tokens) == 2
