"""Defects from the public-API audit, one regression test each: input that used to cost quadratic
time, surface as a 500 / INTERNAL, leak exception text, or leak KV blocks is refused with an error
naming the field and the limit, and leaves the engine as it was."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import grpc
import pytest

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_TOTAL_CHARS, SamplingParams
from engine.tokenizer import Tokenizer
from pdserve.v1 import inference_pb2 as pb
from pdserve.v1 import inference_pb2_grpc as pb_grpc
from services.common import convert
from services.common.grpc_utils import new_server
from services.openai.protocol import (
    MAX_JSON_DEPTH,
    MAX_TOP_K,
    ApiError,
    parse_chat,
    parse_completion,
    parse_json,
)
from services.router import api_proto
from services.router.api import KvFailurePolicy, ServingMode
from services.router.grpc_service import InferenceService
from tests.engine_testing import run_finished
from tests.test_openai_front import MODEL, FakeFrontend


@pytest.fixture(scope="module")
def frontend(tiny_model) -> FakeFrontend:
    return FakeFrontend(Tokenizer(tiny_model))


def _api_error(parse, body: dict, frontend) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(body, frontend)
    assert err.value.status == 400
    return err.value


# ---- 1. stop strings are bounded ----------------------------------------------------------------


def test_validate_refuses_long_stop_strings():
    params = SamplingParams(stop=["x" * 40_000] * 4)
    with pytest.raises(ValueError, match=r"^stop\[0\] has 40000 characters, more than the limit of 1024$"):
        params.validate()
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS]).validate()  # the limit itself is fine


def test_validate_refuses_too_many_stop_characters_in_all():
    n = MAX_STOP_TOTAL_CHARS // MAX_STOP_STRING_CHARS
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * n).validate()
    with pytest.raises(ValueError, match=rf"^stop strings have {MAX_STOP_TOTAL_CHARS + 1} characters"):
        SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS] * n + ["y"]).validate()


def test_openai_parse_refuses_long_stop_strings(frontend):
    body = {"model": MODEL, "prompt": "hi", "stop": ["x" * 40_000] * 4}
    err = _api_error(parse_completion, body, frontend)
    assert err.param == "stop"
    assert err.message == "stop[0] has 40000 characters, more than the limit of 1024"


# ---- 2. values the protos cannot carry ----------------------------------------------------------


@pytest.mark.parametrize(
    "convert_fn, value, message",
    [
        (api_proto.serving_mode_from_proto, 99, "mode must be one of SERVING_MODE_AUTO, "),
        (api_proto.serving_mode_from_proto, -1, "mode must be one of "),
        (
            api_proto.kv_failure_policy_from_proto,
            7,
            "kv_failure_policy must be one of KV_FAILURE_POLICY_FAIL, ",
        ),
    ],
    ids=["mode-99", "mode-negative", "kv_failure_policy-7"],
)
def test_unknown_proto_enum_is_a_value_error(convert_fn, value, message):
    with pytest.raises(ValueError) as err:
        convert_fn(value)
    assert str(err.value).startswith(message) and str(err.value).endswith(f"got {value}")


def test_known_proto_enums_convert():
    assert api_proto.serving_mode_from_proto(pb.SERVING_MODE_COLOCATED) is ServingMode.COLOCATED
    policy = api_proto.kv_failure_policy_from_proto(pb.KV_FAILURE_POLICY_RECOMPUTE)
    assert policy is KvFailurePolicy.RECOMPUTE


@pytest.mark.parametrize(
    "field, value, in_message",
    [
        ("seed", 2**63, "[-2**63, 2**63)"),
        ("seed", -(2**63) - 1, "[-2**63, 2**63)"),
        ("top_k", MAX_TOP_K + 1, "< 2**31"),
        ("top_k", -2, "< 2**31"),
    ],
    ids=["seed-2**63", "seed-below", "top_k-2**31", "top_k-minus-2"],
)
def test_openai_parse_refuses_values_outside_the_proto_types(frontend, field, value, in_message):
    err = _api_error(parse_completion, {"model": MODEL, "prompt": "hi", field: value}, frontend)
    assert err.param == field and in_message in err.message, err.message


def test_extreme_api_values_reach_the_proto(frontend):
    """The largest seed (with n=2: seed + 1 wraps inside int64) and top_k encode without error."""
    body = {"model": MODEL, "prompt": "hi", "seed": 2**63 - 1, "top_k": MAX_TOP_K, "n": 2}
    parsed = parse_completion(body, frontend)
    seeds = []
    for inp in parsed.generate_inputs("r"):
        msg = convert.sampling_to_proto(inp.params)
        assert msg.top_k == MAX_TOP_K
        seeds.append(msg.seed)
    assert seeds == [2**63 - 1, -(2**63)]


# ---- 3. JSON bodies: nesting and lone surrogates ------------------------------------------------


def _nested(depth: int) -> bytes:
    """A body whose prompt is nested so that the whole body has `depth` levels of [ / {."""
    inner = depth - 1
    return b'{"model": "m", "prompt": ' + b"[" * inner + b"]" * inner + b"}"


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 2_000, 10_000, 100_000])
def test_deep_json_is_a_400_naming_the_limit(depth):
    with pytest.raises(ApiError) as err:
        parse_json(_nested(depth))
    assert err.value.status == 400
    assert err.value.message == f"prompt nests deeper than {MAX_JSON_DEPTH} levels"
    assert err.value.param == "prompt"  # the field it nests in, found however deep


def test_json_at_the_depth_limit_parses():
    body = parse_json(_nested(MAX_JSON_DEPTH))
    assert body["model"] == "m"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a\ud800b"}, "prompt"),
        ({"prompt": ["ok", "\udfff"]}, "prompt"),
        ({"stop": ["x", "\ud83d"]}, "stop"),
        ({"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, "messages"),
        ({"messages": [{"role": "user", "\ud800": "x"}]}, "messages"),  # a key inside a field
        ({"\ud800": 1}, None),  # a top-level key: no field to name
    ],
    ids=["prompt", "prompt-batch", "stop", "content", "content-part", "nested-key", "top-level-key"],
)
def test_lone_surrogate_is_a_400_naming_the_field(body, param):
    raw = json.dumps({"model": "m", **body}).encode()  # ensure_ascii: "\ud800" escapes, as a client sends
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400 and err.value.param == param
    assert re.search(
        r"contains a lone surrogate \(\\u[0-9a-f]{4}\), which is not valid Unicode", err.value.message
    )
    assert err.value.message.startswith(param) if param else "field name" in err.value.message


def test_surrogate_pairs_and_other_unicode_pass(frontend):
    text = "😀 日本語 naïve"
    raw = json.dumps({"model": MODEL, "prompt": text, "stop": ["😀"]}).encode()  # "\ud83d\ude00" escaped
    body = parse_json(raw)
    assert body["prompt"] == text
    assert parse_completion(body, frontend).params.stop == ["😀"]
    chat = parse_json(json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode())
    assert parse_chat(chat, frontend).prompts[0]


# ---- 2 and 4 over a real gRPC server ------------------------------------------------------------


class _FailingFrontend(FakeFrontend):
    """The OpenAI tests' fake router core, whose generate fails with internal details."""

    def reset(self) -> None:
        super().reset()
        self.generated = 0

    async def generate(self, inp):
        self.generated += 1
        raise RuntimeError("worker state at /srv/secret/path: request 'other-tenant' holds blocks [3, 4]")
        yield  # an async generator


async def _generate(core: _FailingFrontend, request: pb.GenerateRequest) -> grpc.aio.AioRpcError:
    server = new_server()
    pb_grpc.add_InferenceServicer_to_server(InferenceService(core), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in pb_grpc.InferenceStub(channel).Generate(request, timeout=30):
                    pass
            return err.value
    finally:
        await server.stop(None)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"mode": 99}, "mode must be one of SERVING_MODE_AUTO, SERVING_MODE_DISAGGREGATED, "),
        ({"kv_failure_policy": 5}, "kv_failure_policy must be one of KV_FAILURE_POLICY_FAIL, "),
    ],
    ids=["mode", "kv_failure_policy"],
)
def test_grpc_unknown_enum_is_invalid_argument(tiny_model, fields, message):
    core = _FailingFrontend(Tokenizer(tiny_model))
    request = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[5, 6]), **fields)
    err = asyncio.run(_generate(core, request))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(message), err.details()
    assert core.generated == 0


def test_grpc_internal_error_hides_the_exception(tiny_model, caplog):
    core = _FailingFrontend(Tokenizer(tiny_model))
    request = pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[5, 6]))
    with caplog.at_level(logging.ERROR, logger="services.common.grpc_utils"):
        err = asyncio.run(_generate(core, request))
    assert err.code() == grpc.StatusCode.INTERNAL
    match = re.fullmatch(r"internal error \(error id ([0-9a-f]{12})\)", err.details())
    assert match, err.details()
    # The log has the id, the method and the whole exception; the caller has neither.
    (record,) = [r for r in caplog.records if match.group(1) in r.getMessage()]
    assert "Generate" in record.getMessage()
    assert record.exc_info is not None and "/srv/secret/path" in str(record.exc_info[1])


# ---- 5. the engine never overwrites state it owns -----------------------------------------------


@pytest.fixture(scope="module")
def core(tiny_model) -> EngineCore:
    cfg = EngineConfig(model=tiny_model, dtype="float32", block_size=4, num_kv_blocks=32, num_threads=1)
    return EngineCore(cfg)


def test_exported_request_id_cannot_be_reused(core):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(10, 23))  # 13 tokens: 4 blocks of 4
    pool = core.kv
    free_at_start = pool.num_free_blocks
    core.add_request("p", prompt, params, kv_export=True)
    assert run_finished(core)["p"].finish_reason == "exported"
    exported = list(core.handover.exports.find("p").block_ids)
    assert len(exported) == 4
    free_while_exported = pool.num_free_blocks
    assert free_while_exported == free_at_start - 4

    for reuse in (
        lambda: core.add_request("p", prompt, params, kv_export=True),
        lambda: core.add_request("p", [7, 8, 9], params),
        lambda: core.begin_import("p", prompt, [5], params),
    ):
        with pytest.raises(ValueError, match=r"^request_id 'p' is already in use$"):
            reuse()
        assert pool.num_free_blocks == free_while_exported
        assert core.handover.exports.find("p").block_ids == exported
        assert "p" not in core.requests and "p" not in core.detokenizers
        assert not core.has_unfinished_requests()

    assert core.handover.release_export("p")
    assert pool.num_free_blocks == free_at_start  # everything back
    # Released, the id is free again.
    core.add_request("p", prompt, params)
    assert run_finished(core)["p"].finish_reason == "length"
    assert pool.num_free_blocks == free_at_start


def test_importing_request_id_cannot_be_reused(core):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(30, 39))
    pool = core.kv
    free_at_start = pool.num_free_blocks
    core.begin_import("i", prompt, [5], params)
    assert core.handover.allocate_import("i") is not None
    free_while_importing = pool.num_free_blocks
    with pytest.raises(ValueError, match="already in use"):
        core.add_request("i", prompt, params, kv_export=True)
    assert pool.num_free_blocks == free_while_importing and "i" in core.scheduler.importing
    core.abort_request("i")
    assert pool.num_free_blocks == free_at_start
