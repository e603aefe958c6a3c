"""Structured output that cannot work says so, through the served stack (real processes, the
`openai` client and gRPC): constraints that compiled but ended their request at once are refused
before any worker sees them (400 naming the field; they used to answer 200 with finish_reason
"abort" and a one-character text, or "stop" with an empty one), and a constraint that fails after
some tokens ends the request with an error the client sees: a 400 when nothing was sent yet, an
error event in a stream, INVALID_ARGUMENT over gRPC; never a silent abort."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from pdserve.v1 import inference_pb2 as pb
from tests.service_testing import inference
from tests.test_structured_output import _REF_CYCLE, _REF_EVERY_LEVEL

MODEL = "pdserve-tiny"
# Passes the check (its first tokens are fine), then grows past the library's per-step limits once
# the output reaches "child" (at its 7th token, whatever the model).
FAILS_LATER = {
    "type": "object",
    "properties": {"k": {"enum": ["a", "b"]}, "child": {"$ref": "#/$defs/n"}},
    "required": ["k", "child"],
    "$defs": _REF_EVERY_LEVEL["$defs"],
}


@pytest.fixture(scope="module")
def client(serving_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=serving_stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize(
    "extra, field, message",
    [
        ({"guided_json": _REF_EVERY_LEVEL}, "guided_json", "fails at its first token"),
        ({"guided_json": _REF_CYCLE}, "guided_json", "fails at its first token"),
        ({"guided_grammar": 'start: a\na: "x" a'}, "guided_grammar", "fails at its first token"),
        ({"guided_regex": "(?:)"}, "guided_regex", "accepts only the empty string"),
        (
            {
                "structured_outputs": {
                    "json": {"type": "object", "properties": {f"p{i}": {} for i in range(1200)}}
                }
            },
            "structured_outputs",
            "fails at its first token",
        ),
    ],
    ids=["ref-every-level", "ref-cycle", "lark-no-end", "empty-only", "1200-optional"],
)
@pytest.mark.parametrize("stream", [False, True])
def test_constraints_that_would_end_at_once_are_refused_naming_their_field(
    client, extra, field, message, stream
):
    with pytest.raises(openai.BadRequestError) as e:
        out = client.completions.create(
            model=MODEL, prompt="x", max_tokens=8, stream=stream, extra_body=extra
        )
        list(out) if stream else None
    assert e.value.status_code == 400 and message in e.value.message
    assert e.value.body["param"] == field


def test_tool_parameters_that_would_end_at_once_are_refused_naming_the_tool(client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": _REF_EVERY_LEVEL}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required"
        )
    assert (
        "tools[0].function.parameters is not a valid JSON schema: fails at its first token" in e.value.message
    )
    assert e.value.body["param"] == "tools[0].function.parameters"


def test_a_constraint_failing_after_some_tokens_is_an_error_the_client_sees(client, serving_stack):
    body = {"guided_json": FAILS_LATER, "ignore_eos": True}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=40, temperature=0, extra_body=body)
    assert "structured_outputs.json: the constraint failed at output token" in e.value.message
    assert "Too many items" in e.value.message

    stream = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=40, temperature=0, stream=True, extra_body=body
    )
    texts = []
    with pytest.raises(openai.APIError, match="the constraint failed at output token"):
        for chunk in stream:  # the tokens before the failure, then the error event
            texts.append(chunk.choices[0].text)
    assert "".join(texts).startswith('{"k":"')

    request = pb.GenerateRequest(
        text="hello",
        sampling=pb.SamplingParams(
            temperature=0,
            max_tokens=40,
            structured_outputs=pb.StructuredOutputs(json_schema=json.dumps(FAILS_LATER)),
        ),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(inference(serving_stack).Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the constraint failed at output token" in e.value.details()
