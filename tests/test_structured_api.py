"""Structured output through the served stack (router, prefill and decode workers as processes,
every request disaggregated): the `openai` client's `chat.completions.parse` with Pydantic models,
OpenAI's response_format, vLLM's structured_outputs and guided_* fields, and the gRPC request;
a bad constraint is a 400 / INVALID_ARGUMENT naming its field. Greedy outputs equal the offline
engine's under the same constraint: the constraint crosses the wire to both workers, the prefill
worker masks the first token and the decode worker rebuilds its matcher from it."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Annotated, Literal

import grpc
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from engine import LLM, SamplingParams
from engine.structured import StructuredOutputsParams as S
from pdserve.v1 import inference_pb2 as pb
from tests.service_testing import ENGINE_ARGS, generate, inference, metric, start_stack
from tests.test_structured_engine import CHOICES, LARK, LARK_AS_REGEX, PERSON, REGEX

DISAGGREGATED = {"mode": "disaggregated"}
MESSAGES = [{"role": "user", "content": "Describe a user of the system as JSON."}]


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(min_length=1, max_length=10)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Annotated[str, Field(max_length=5)]] = Field(max_length=3)
    address: Address


class Item(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}[0-9]{2}$")
    count: int = Field(ge=0, le=99)
    in_stock: bool


class Inventory(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=3)
    status: Literal["open", "closed"]


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256)


def _chat_ids(offline: LLM, messages) -> list[int]:
    tok = offline.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)


@pytest.mark.parametrize("model", [Person, Inventory], ids=lambda m: m.__name__)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)], ids=["t0", "t1"])
def test_parse_returns_the_pydantic_object(client, model, sampling):
    completion = client.chat.completions.parse(
        model="pdserve-tiny",
        messages=MESSAGES,
        response_format=model,
        max_tokens=200,
        extra_body=DISAGGREGATED,
        **sampling,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)
    jsonschema.validate(json.loads(choice.message.content), model.model_json_schema())


def test_parse_streams(client):
    with client.chat.completions.stream(
        model="pdserve-tiny",
        messages=MESSAGES,
        response_format=Inventory,
        max_tokens=200,
        temperature=0.8,
        seed=3,
        extra_body=DISAGGREGATED,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1 and "".join(deltas) == final.choices[0].message.content
    assert isinstance(final.choices[0].message.parsed, Inventory)


def test_greedy_json_schema_equals_the_offline_engine(client, offline):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    chat = client.chat.completions.create(
        model="pdserve-tiny",
        messages=MESSAGES,
        response_format=fmt,
        max_tokens=200,
        temperature=0,
        extra_body=DISAGGREGATED,
    )
    (ref,) = offline.generate(
        prompt_token_ids=[_chat_ids(offline, MESSAGES)],
        sampling_params=[SamplingParams(temperature=0, max_tokens=200, structured_outputs=S(json=PERSON))],
    )
    assert chat.choices[0].message.content == ref.text
    assert chat.usage.completion_tokens == len(ref.token_ids)
    jsonschema.validate(json.loads(ref.text), PERSON)


@pytest.mark.parametrize(
    "extra, holds",
    [
        ({"structured_outputs": {"regex": REGEX}}, lambda t: re.fullmatch(REGEX, t)),
        ({"guided_regex": REGEX}, lambda t: re.fullmatch(REGEX, t)),
        ({"structured_outputs": {"choice": CHOICES}}, lambda t: t in CHOICES),
        ({"guided_choice": CHOICES}, lambda t: t in CHOICES),
        ({"structured_outputs": {"grammar": LARK}}, lambda t: re.fullmatch(LARK_AS_REGEX, t)),
        ({"guided_grammar": LARK}, lambda t: re.fullmatch(LARK_AS_REGEX, t)),
        ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
        (
            {"structured_outputs": {"json": json.dumps(PERSON)}},
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
    ],
    ids=lambda v: next(iter(v)) + "." + str(next(iter(v.values())))[:12] if isinstance(v, dict) else None,
)
def test_vllm_fields_hold_on_every_sample(client, extra, holds):
    r = client.completions.create(
        model="pdserve-tiny",
        prompt="Answer:",
        n=10,
        max_tokens=160,
        temperature=1.0,
        seed=11,
        extra_body={**extra, **DISAGGREGATED},
    )
    assert len(r.choices) == 10
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.text
        assert holds(choice.text), choice.text


def test_json_object_and_text_formats(client, offline):
    # Any JSON object is unbounded: a bias on "}" makes the random model close it at once.
    brace = offline.tokenizer.encode("}", add_special_tokens=False)[0]
    r = client.completions.create(
        model="pdserve-tiny",
        prompt="Answer:",
        max_tokens=40,
        temperature=0,
        logit_bias={str(brace): 100},
        extra_body={"response_format": {"type": "json_object"}, **DISAGGREGATED},
    )
    assert r.choices[0].text == "{}" and r.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(
        model="pdserve-tiny", messages=MESSAGES, max_tokens=5, temperature=0, response_format={"type": "text"}
    )
    assert plain.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "objx"}},
                }
            },
            "response_format",
            r"response_format\.json_schema\.schema is not a valid JSON schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            r"response_format\.json_schema\.schema is required",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format", r"response_format\.type must be one of"),
        (
            {"structured_outputs": {"regex": "[0-9"}},
            "structured_outputs",
            r"structured_outputs\.regex is not a valid regular expression",
        ),
        ({"guided_grammar": "start: nothing"}, "guided_grammar", r"guided_grammar is not a valid grammar"),
        ({"guided_choice": []}, "guided_choice", r"guided_choice must be a non-empty list"),
        ({"guided_regex": "a" * 70000}, "guided_regex", r"more than the limit of 65536"),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs",
            r"unsupported key\(s\) \['structural_tag'\]",
        ),
        (
            {"guided_regex": "a", "response_format": {"type": "json_object"}},
            "guided_regex",
            "only one structured output field may be set",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and "\\" not in v else None,
)
def test_a_bad_constraint_is_a_400_naming_the_field(client, body, param, message):
    for create in (
        lambda: client.completions.create(model="pdserve-tiny", prompt="x", max_tokens=4, extra_body=body),
        lambda: client.chat.completions.create(
            model="pdserve-tiny", messages=MESSAGES, max_tokens=4, extra_body=body
        ),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            create()
        assert e.value.status_code == 400 and e.value.body["param"] == param
        assert re.search(message, e.value.body["message"]), e.value.body["message"]


def test_grpc_structured_outputs(stack, offline):
    stub = inference(stack)
    prompt = "Answer:"
    schema = pb.StructuredOutputs(json_schema=json.dumps(PERSON))
    tokens, msgs = generate(
        stub,
        text=prompt,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=schema),
        mode=pb.SERVING_MODE_DISAGGREGATED,
    )
    (ref,) = offline.generate(
        [prompt], [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=S(json=PERSON))]
    )
    assert tokens == ref.token_ids and msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    assert msgs[-1].disaggregated
    jsonschema.validate(json.loads("".join(m.text for m in msgs)), PERSON)
    choice = pb.StructuredOutputs(choice=pb.Choices(choices=CHOICES))
    for seed in range(3):
        _, msgs = generate(
            stub,
            text=prompt,
            sampling=pb.SamplingParams(temperature=1.0, seed=seed, max_tokens=20, structured_outputs=choice),
        )
        assert "".join(m.text for m in msgs) in CHOICES
    for bad, field in [
        (
            pb.StructuredOutputs(regex="(a"),
            "sampling.structured_outputs.regex is not a valid regular expression",
        ),
        (
            pb.StructuredOutputs(json_schema="[1]"),
            "sampling.structured_outputs.json_schema must be a JSON schema",
        ),
        (pb.StructuredOutputs(), "structured_outputs must set one of"),
    ]:
        with pytest.raises(grpc.RpcError) as e:
            generate(stub, text=prompt, sampling=pb.SamplingParams(max_tokens=4, structured_outputs=bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_parse_with_mtp_equals_parse_without(stack, client, tmp_path_factory):
    """A stack whose workers speculate with MTP (k = 2): greedy parse gives the same object as
    the plain stack's, disaggregated."""
    from modelkit.make_model import make_model

    mtp_model = str(make_model("tiny-mtp", tmp_path_factory.mktemp("models") / "pdserve-tiny"))
    spec = ["--speculative", "mtp", "--num-speculative-tokens", "2"]
    mtp_stack = start_stack(
        mtp_model,
        tmp_path_factory.mktemp("mtp-stack"),
        engine_args=ENGINE_ARGS + spec,
        router_args=["--colocate-max-tokens", "0"],
        worker_metrics=True,
    )
    try:
        mtp_client = openai.OpenAI(base_url=mtp_stack.http_url + "/v1", api_key="unused", max_retries=0)
        for model in (Person, Inventory):
            kw = dict(
                model="pdserve-tiny", messages=MESSAGES, response_format=model, max_tokens=200, temperature=0
            )
            want = client.chat.completions.parse(**kw, extra_body=DISAGGREGATED).choices[0].message
            got = mtp_client.chat.completions.parse(**kw, extra_body=DISAGGREGATED).choices[0].message
            assert got.content == want.content and got.parsed == want.parsed
        scraped = urllib.request.urlopen(mtp_stack.workers("decode")[0].metrics_url).read().decode()
        assert metric(scraped, "pdserve_spec_draft_tokens") > 0
    finally:
        codes = mtp_stack.stop()
    assert codes == {name: 0 for name in codes}
