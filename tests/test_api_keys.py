"""API keys on the public API: a stack whose router takes two keys (PDSERVE_API_KEY from the
launcher and an --api-key-file), driven by the `openai` client, raw HTTP and gRPC; missing and
wrong keys are refused (401 in OpenAI's error shape / UNAUTHENTICATED; the tokenizer routes too),
streaming or not, before any work; health, reflection and /metrics stay open; the keys never reach
the logs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from services.cli import main as cli_main
from services.common.security import MAX_API_KEY_CHARS, MAX_API_KEYS, ApiKeys
from tests.service_testing import start_stack

MODEL = "pdserve-tiny"
KEY = "sk-pdserve-test-key-1"
FILE_KEY = "sk-from-the-key-file"
BODY = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 3, "temperature": 0}


# ---- loading and checking keys ----------------------------------------------------------------


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    assert not ApiKeys.load()  # nothing configured: an open API
    path = tmp_path / "keys"
    path.write_text(f"# rotated monthly\n\n  {FILE_KEY}  \nsk-two\n{FILE_KEY}\n")
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-env")
    keys = ApiKeys.load(["sk-flag"], str(path))
    assert keys.keys == ("sk-flag", FILE_KEY, "sk-two", "sk-env")
    assert FILE_KEY not in repr(keys) and "sk-flag" not in repr(keys)
    assert ApiKeys.load(from_env=False).keys == ()


def test_check_wants_bearer_and_an_exact_key():
    keys = ApiKeys(("sk-a", "sk-b"))
    assert keys.check("Bearer sk-a") and keys.check(b"Bearer sk-b")
    for bad in (None, "", "sk-a", "Bearer sk-", "Bearer sk-a ", "Bearer sk-ab", "bearer sk-a", "Basic sk-a"):
        assert not keys.check(bad), bad


@pytest.mark.parametrize(
    "flags, file_text, in_message",
    [
        ([""], None, "from --api-key must be 1 to"),
        (["two words"], None, "without whitespace"),
        (["x" * (MAX_API_KEY_CHARS + 1)], None, f"1 to {MAX_API_KEY_CHARS} characters"),
        ([], "# only a comment\n", "holds no key"),
        ([], "".join(f"k{i}\n" for i in range(MAX_API_KEYS + 1)), f"more than {MAX_API_KEYS}"),
    ],
    ids=["empty", "whitespace", "too-long", "empty-file", "too-many"],
)
def test_bad_keys_are_refused_naming_the_source_and_limit(
    tmp_path, monkeypatch, flags, file_text, in_message
):
    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    path = None
    if file_text is not None:
        path = tmp_path / "keys"
        path.write_text(file_text)
    with pytest.raises(ValueError, match="API key|api-key-file") as err:
        ApiKeys.load(flags, None if path is None else str(path))
    assert in_message in str(err.value)


def test_router_cli_exits_2_on_an_unreadable_key_file(tmp_path, capsys):
    missing = tmp_path / "nope"
    code = cli_main(["router", "--model", "m", "--workers", "127.0.0.1:1", "--api-key-file", str(missing)])
    assert code == 2 and f"--api-key-file {missing} cannot be read" in capsys.readouterr().err


# ---- a stack that requires a key -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("keyed")
    key_file = folder / "api-keys"
    key_file.write_text(f"{FILE_KEY}\n")
    st = start_stack(tiny_model, folder, api_key=KEY, router_args=["--api-key-file", str(key_file)])
    yield st
    st.stop()


def _request(stack, path: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict, str]:
    """(status, JSON body, WWW-Authenticate) of a GET (no body) or POST."""
    headers = {"content-type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(stack.http_url + path, data, headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw, status, auth = resp.read(), resp.status, resp.headers.get("WWW-Authenticate", "")
    except urllib.error.HTTPError as e:
        raw, status, auth = e.read(), e.code, e.headers.get("WWW-Authenticate", "")
    try:
        return status, json.loads(raw), auth
    except json.JSONDecodeError:
        return status, {"raw": raw.decode()}, auth


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", BODY),
        ("/v1/completions", {**BODY, "stream": True}),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ),
        ("/v1/models", None),
        (f"/v1/models/{MODEL}", None),
        ("/v1/no-such-route", None),
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [1, 2]}),
        ("/tokenizer_info", None),
    ],
    ids=[
        "completions",
        "completions-stream",
        "chat",
        "models",
        "model",
        "unknown-route",
        "tokenize",
        "detokenize",
        "tokenizer_info",
    ],
)
def test_http_without_the_right_key_is_401_in_openai_shape(stack, path, body):
    for key, message in (
        (None, "missing API key"),
        ("sk-wrong", "invalid API key"),
        (KEY + "x", "invalid API key"),
    ):
        status, payload, auth = _request(stack, path, body, key)
        assert status == 401 and auth == "Bearer", (key, payload)
        assert payload == {
            "error": {
                "message": payload["error"]["message"],
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        assert message in payload["error"]["message"]


def test_http_with_either_key_is_served_and_health_and_metrics_stay_open(stack):
    for key in (KEY, FILE_KEY):
        status, payload, _ = _request(stack, "/v1/completions", BODY, key)
        assert status == 200 and len(payload["choices"][0]["text"]) > 0
        assert _request(stack, "/v1/models", None, key)[0] == 200
        assert _request(stack, "/tokenize", {"prompt": "hi"}, key)[1]["count"] >= 1
    assert _request(stack, "/v1/no-such-route", None, KEY)[0] == 404  # past the key: the route's own answer
    assert _request(stack, "/health")[:2] == (200, {"status": "ok"})
    with urllib.request.urlopen(stack.http_url + "/metrics", timeout=30) as resp:
        assert resp.status == 200 and b"pdserve_" in resp.read()


def test_openai_client_needs_the_key_streaming_or_not(stack):
    wrong = openai.OpenAI(base_url=stack.http_url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        wrong.completions.create(model=MODEL, prompt="def f(x):", max_tokens=2)
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        list(
            wrong.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True
            )
        )
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()

    right = openai.OpenAI(base_url=stack.http_url + "/v1", api_key=KEY, max_retries=0)
    out = right.completions.create(model=MODEL, prompt="def f(x):", max_tokens=3, temperature=0)
    streamed = right.completions.create(
        model=MODEL, prompt="def f(x):", max_tokens=3, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.choices[0].text
    assert [m.id for m in right.models.list()] == [MODEL]


def _grpc_calls(stub: pb_grpc.InferenceStub):
    sampling = pb.SamplingParams(temperature=0, max_tokens=3)
    return {
        "Generate": lambda md: list(
            stub.Generate(pb.GenerateRequest(text="def f(x):", sampling=sampling), timeout=60, metadata=md)
        ),
        "Complete": lambda md: stub.Complete(
            pb.GenerateRequest(text="def f(x):", sampling=sampling), timeout=60, metadata=md
        ),
        "Tokenize": lambda md: stub.Tokenize(pb.TokenizeRequest(text="hi"), timeout=30, metadata=md),
        "ListModels": lambda md: stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=md),
        "GetServerInfo": lambda md: stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=30, metadata=md),
    }


def test_grpc_inference_needs_the_key_health_and_reflection_do_not(stack):
    with grpc.insecure_channel(stack.grpc_endpoint) as channel:
        calls = _grpc_calls(pb_grpc.InferenceStub(channel))
        for name, call in calls.items():
            for metadata, message in (
                (None, "missing API key"),
                ([("authorization", "Bearer sk-wrong")], "invalid API key"),
                ([("authorization", KEY)], "invalid API key"),  # no Bearer
            ):
                with pytest.raises(grpc.RpcError) as err:
                    call(metadata)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
                assert message in err.value.details() and KEY not in err.value.details()
        for key in (KEY, FILE_KEY):
            msgs = calls["Generate"]([("authorization", f"Bearer {key}")])
            assert (
                sum(len(m.token_ids) for m in msgs) == 3 and msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH
            )
            assert calls["ListModels"]([("authorization", f"Bearer {key}")]).models[0].id == MODEL

        health = health_pb2_grpc.HealthStub(channel)
        ready = health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
        assert ready.status == health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service="liveness"), timeout=10)
        assert next(iter(watch)).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        [answer] = list(
            reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
        assert "pdserve.v1.Inference" in {s.name for s in answer.list_services_response.service}


def test_the_keys_stay_out_of_the_logs(stack):
    _request(stack, "/v1/completions", BODY, "sk-wrong")
    text = "".join(p.log_path.read_text(errors="replace") for p in stack.procs if p.log_path)
    assert "API key" in text or "public API" in text  # the router says the API needs a key
    assert KEY not in text and FILE_KEY not in text
