"""Tool calling through the served stack (router, prefill and decode workers as processes, every
request disaggregated) with the `openai` client: tool_choice "required" and a named function give
calls whose arguments validate against the tool's schema (a random model, held to the grammar),
streamed deltas reassemble to the same calls, greedy outputs equal the offline engine's under the
same prompt and constraint, a round trip (calls, then their results) renders and generates, and bad
fields are 400s naming the field. Over gRPC the same conversation (Chat.tools, ChatMessage.tool_calls
and tool_call_id) renders to the same prompt; Chat.tool_choice required / named gives parsed calls
(GenerateResponse.tool_calls, FINISH_REASON_TOOL_CALLS) valid against the schema, the same from
Complete, from Generate's deltas put together and from the HTTP API; none gives the text that auto
parses; a bad tool_choice is INVALID_ARGUMENT worded as the HTTP API's 400."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from pdserve.v1 import inference_pb2 as pb
from services.router.tool_parser import TOOL_CALL_BEGIN, TOOL_CALLS_BEGIN, TOOL_SEP, parse_tool_calls
from services.router.tools import tool_request
from tests.service_testing import generate, inference

DISAGGREGATED = {"mode": "disaggregated"}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["utc_offset"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    # One thread, as each worker runs (service_testing): torch's two OpenMP threads, in a process
    # beside the stack's, wait on each other for most of each step.
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256, num_threads=1)


_GREEDY: dict = {}
"""(client, request) -> the response to a greedy, unstreamed _create. Four tests make the same
greedy request for "required" and for the named function (one checks the call, one compares it
with the offline engine, two hold a stream and the gRPC API to it): a greedy answer is a function
of the request, so the first makes it and the others check the same response."""


def _create(client, **kw):
    args = dict(
        model="pdserve-tiny", messages=MESSAGES, tools=TOOLS, max_tokens=160, extra_body=DISAGGREGATED
    )
    args |= kw
    if args.get("temperature") != 0.0 or args.get("stream"):
        return client.chat.completions.create(**args)
    key = (id(client), json.dumps(args, sort_keys=True))
    if key not in _GREEDY:
        _GREEDY[key] = client.chat.completions.create(**args)
    return _GREEDY[key]


def _validate(calls) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


_OFFLINE: dict = {}
"""(engine, prompt, constraint, max_tokens) -> _offline's output: tool_choice auto and none give
the same prompt (the tools are rendered either way) and no constraint, so one run serves both."""


def _offline(offline: LLM, body: dict, messages=MESSAGES, max_tokens: int = 160):
    """The offline engine's greedy output for the same prompt and constraint."""
    tools = tool_request(body)
    tok = offline.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, tools=tools.tools), add_special_tokens=False)
    constraint = tools.constraint()
    key = (id(offline), tuple(ids), repr(constraint), max_tokens)
    if key not in _OFFLINE:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=constraint)
        (_OFFLINE[key],) = offline.generate(prompt_token_ids=[ids], sampling_params=[params])
    return ids, _OFFLINE[key]


@pytest.mark.parametrize(
    "choice, parallel",
    [("required", False), (NAMED, True), (NAMED, False)],
    ids=["required-one", "named", "named-one"],
)
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=5)], ids=["t0", "t1"])
def test_an_enforced_choice_gives_one_valid_call(client, choice, parallel, sampling):
    r = _create(client, tool_choice=choice, parallel_tool_calls=parallel, **sampling)
    (c,) = r.choices
    assert c.finish_reason == "tool_calls" and c.message.content is None
    (call,) = c.message.tool_calls
    if choice == NAMED:
        assert call.function.name == "get_time"
    _validate(c.message.tool_calls)


def test_required_with_parallel_calls_gives_valid_calls(client):
    for seed in range(3):
        r = _create(client, tool_choice="required", temperature=1.0, seed=seed, max_tokens=400)
        (c,) = r.choices
        assert c.finish_reason in ("tool_calls", "length")
        calls = c.message.tool_calls
        complete = calls if c.finish_reason == "tool_calls" else calls[:-1]  # length may cut the last
        assert len(calls) >= 1
        _validate(complete)


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_streamed_deltas_reassemble_to_the_same_calls(client, choice):
    whole = _create(client, tool_choice=choice, parallel_tool_calls=False, temperature=0.0).choices[0]
    chunks = list(
        _create(client, tool_choice=choice, parallel_tool_calls=False, temperature=0.0, stream=True)
    )
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert not any(d.content and ("<｜" in d.content) for d in deltas)  # no marker text as content
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    first, *rest = parts
    assert (
        first.index == 0 and first.id.startswith("call_") and first.function.name and first.type == "function"
    )
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    arguments = "".join(p.function.arguments or "" for p in parts)
    assert (first.function.name, arguments) == (
        whole.message.tool_calls[0].function.name,
        whole.message.tool_calls[0].function.arguments,
    )
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    # The openai client's own stream helper assembles the same call.
    with client.chat.completions.stream(
        model="pdserve-tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=0.0,
    ) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.message.tool_calls[0].function.arguments == arguments
    assert final.finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["required", NAMED, "auto", "none"])
def test_greedy_output_is_the_offline_engines_parsed(client, offline, choice):
    body = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
    ids, ref = _offline(offline, body)
    r = _create(client, tool_choice=choice, parallel_tool_calls=False, temperature=0.0)
    (c,) = r.choices
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    if choice == "none":  # not parsed: the text as the model wrote it
        assert (c.message.content, c.message.tool_calls) == (ref.text, None)
        return
    content, calls = parse_tool_calls(ref.text, max_calls=1)
    assert c.message.content == (content if content or not calls else None)
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []] == [
        (t.name, t.arguments) for t in calls
    ]


def test_a_round_trip_renders_and_generates(client, offline):
    first = _create(client, tool_choice=NAMED, temperature=0.0).choices[0].message
    call = first.tool_calls[0]
    messages = [
        {"role": "system", "content": "You are terse."},
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_time", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'},
    ]
    body = {"tools": TOOLS, "tool_choice": "auto"}
    ids, ref = _offline(offline, body, messages, max_tokens=12)
    prompt = offline.tokenizer.decode(ids, skip_special_tokens=False)
    assert (
        f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}function{TOOL_SEP}get_time\n```json\n{call.function.arguments}"
        in prompt
    )
    assert prompt.endswith(
        '<｜tool▁output▁begin｜>{"time": "12:00"}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>'
    )
    r = client.chat.completions.create(
        model="pdserve-tiny",
        messages=messages,
        tools=TOOLS,
        max_tokens=12,
        temperature=0.0,
        extra_body=DISAGGREGATED,
    )
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(ref.token_ids)
    content, calls = parse_tool_calls(ref.text)
    assert (r.choices[0].message.content or "") == content and not calls


BAD = [
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type", "must be 'function'"),
    (
        {"tools": [TOOLS[0], {"type": "function", "function": {"name": "a b"}}]},
        "tools[1].function.name",
        "letters",
    ),
    ({"tools": [{"type": "function", "function": {"name": "f" * 65}}]}, "tools[0].function.name", "64"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "twice"),
    ({"tools": [TOOLS[0]] * 129}, "tools", "limit of 128"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        "tools[0].function.parameters",
        "JSON schema",
    ),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "x": "y" * 70000}},
                }
            ]
        },
        "tools[0].function.parameters",
        "limit of 65536",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objx"}}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters",
        "not a valid JSON schema",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "tool_choice.function.name",
        "not one of",
    ),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", "must be 'none', 'auto', 'required'"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
        "cannot be combined",
    ),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "send tools"),
    ({"function_call": "auto"}, "function_call", "send tools"),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": 5}}],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "JSON string",
    ),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "non-empty string"),
]


@pytest.mark.parametrize("body, param, message", BAD, ids=[p + ":" + m for _, p, m in BAD])
def test_a_bad_tool_field_is_a_400_naming_it(client, body, param, message):
    args = dict(model="pdserve-tiny", messages=MESSAGES, max_tokens=4) | body
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            **{k: v for k, v in args.items() if k in ("model", "messages", "max_tokens")},
            extra_body={k: v for k, v in args.items() if k not in ("model", "messages", "max_tokens")},
        )
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    assert re.search(re.escape(message), e.value.body["message"]), e.value.body["message"]


def test_tool_messages_without_tools_render(client):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "done"}]},
    ]
    r = client.chat.completions.create(model="pdserve-tiny", messages=messages, max_tokens=3, temperature=0.0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


# ---- gRPC: the same conversation renders to the same prompt ------------------------------------

GRPC_TOOLS = [
    pb.Tool(
        name=t["function"]["name"],
        description=t["function"]["description"],
        parameters=json.dumps(t["function"]["parameters"]),
    )
    for t in TOOLS
]


def _grpc_chat(call_id: str, arguments: str, **tool_kw) -> pb.Chat:
    return pb.Chat(
        messages=[
            pb.ChatMessage(role="user", content=MESSAGES[0]["content"]),
            pb.ChatMessage(
                role="assistant", tool_calls=[pb.ToolCall(id=call_id, name="get_time", arguments=arguments)]
            ),
            pb.ChatMessage(role="tool", tool_call_id=call_id, content='{"time": "12:00"}'),
        ],
        tools=GRPC_TOOLS + [pb.Tool(**tool_kw)] * bool(tool_kw),
    )


def test_grpc_renders_tools_calls_and_results_as_http(stack, offline):
    arguments = '{"utc_offset":1}'
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c7", "type": "function", "function": {"name": "get_time", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c7", "content": '{"time": "12:00"}'},
    ]
    ids, ref = _offline(offline, {"tools": TOOLS}, messages, max_tokens=8)
    stub = inference(stack)
    got = list(stub.Tokenize(pb.TokenizeRequest(chat=_grpc_chat("c7", arguments)), timeout=30).token_ids)
    assert got == ids
    tokens, msgs = generate(
        stub, chat=_grpc_chat("c7", arguments), sampling=pb.SamplingParams(temperature=0.0, max_tokens=8)
    )
    assert tokens == ref.token_ids and msgs[-1].usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "chat, field",
    [
        (_grpc_chat("c1", "{}", name="bad name"), "chat.tools[2].function.name must be 1 to 64 letters"),
        (_grpc_chat("c1", "{}", name="get_time"), "chat.tools[2].function.name 'get_time' is given twice"),
        (_grpc_chat("c1", "{}", name="f", parameters="{"), "chat.tools[2].parameters is not valid JSON"),
        (
            pb.Chat(messages=[pb.ChatMessage(role="tool", content="x")]),
            "chat.messages[0].tool_call_id must be set",
        ),
        (
            pb.Chat(messages=[pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(name="f")])]),
            "chat.messages[0].tool_calls is only allowed on an assistant message",
        ),
    ],
    ids=["name", "twice", "parameters", "tool_call_id", "tool_calls-on-user"],
)
def test_grpc_bad_tool_fields_are_invalid_argument(stack, chat, field):
    with pytest.raises(grpc.RpcError) as err:
        generate(inference(stack), chat=chat, sampling=pb.SamplingParams(max_tokens=2))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details(), (
        err.value.details()
    )


# ---- gRPC: tool_choice and parsed calls, unary (Complete) and streamed (Generate) -------------

GRPC_CHOICES = {
    "required": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED),
    "named": pb.ToolChoice(function=pb.FunctionName(name="get_time")),
    "auto": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_AUTO),
    "none": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE),
}
HTTP_CHOICES = {"required": "required", "named": NAMED, "auto": "auto", "none": "none"}


def _grpc_request(
    choice: str | None, tools=GRPC_TOOLS, parallel: bool | None = False, max_tokens: int = 160, **sampling
) -> pb.GenerateRequest:
    chat = pb.Chat(messages=[pb.ChatMessage(role="user", content=MESSAGES[0]["content"])], tools=tools)
    if choice is not None:
        chat.tool_choice.CopyFrom(GRPC_CHOICES[choice])
    if parallel is not None:
        chat.parallel_tool_calls = parallel
    return pb.GenerateRequest(
        chat=chat,
        sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),
        mode=pb.SERVING_MODE_DISAGGREGATED,
    )


@pytest.mark.parametrize("choice", ["required", "named"])
def test_grpc_enforced_choice_gives_parsed_calls_unary_and_streamed(stack, client, choice):
    stub = inference(stack)
    whole = stub.Complete(_grpc_request(choice), timeout=60)
    assert whole.finish_reason == pb.FINISH_REASON_TOOL_CALLS and whole.text == ""
    (call,) = whole.tool_calls
    assert call.index == 0 and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.name in (("get_time",) if choice == "named" else SCHEMAS)
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    # Streamed: the call's first part names it, the others carry its arguments on; together they
    # are the unary answer (the same greedy tokens).
    msgs = list(stub.Generate(_grpc_request(choice), timeout=60))
    parts = [part for m in msgs for part in m.tool_calls]
    first, *rest = parts
    assert first.index == 0 and first.id.startswith("call_") and first.name == call.name
    assert all(p.index == 0 and p.id == "" and p.name == "" for p in rest)
    assert "".join(p.arguments for p in parts) == call.arguments
    assert "".join(m.text for m in msgs) == "" and not any(m.finish_reason for m in msgs[:-1])
    assert msgs[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [t for m in msgs for t in m.token_ids] == list(whole.token_ids)
    # One implementation: the HTTP API gives the same call for the same request.
    http = _create(client, tool_choice=HTTP_CHOICES[choice], parallel_tool_calls=False, temperature=0.0)
    (http_call,) = http.choices[0].message.tool_calls
    assert (http_call.function.name, http_call.function.arguments) == (call.name, call.arguments)
    assert http.usage.completion_tokens == len(whole.token_ids)


def test_grpc_none_gives_the_text_and_auto_parses_the_same_text(stack):
    stub = inference(stack)
    none = stub.Complete(_grpc_request("none", max_tokens=24), timeout=60)
    assert not none.tool_calls and none.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert len(none.token_ids) == none.usage.completion_tokens
    content, calls = parse_tool_calls(none.text, max_calls=1)
    for choice in ("auto", None):  # an unset tool_choice is auto
        auto = stub.Complete(_grpc_request(choice, max_tokens=24), timeout=60)
        assert auto.token_ids == none.token_ids  # the same prompt: the tools are rendered either way
        assert auto.text == content
        assert [(c.name, c.arguments) for c in auto.tool_calls] == [(c.name, c.arguments) for c in calls]


def _http_error(client, **body) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="pdserve-tiny", messages=MESSAGES, max_tokens=4, extra_body=body)
    return e.value.body["message"]


@pytest.mark.parametrize(
    "request_kw, http_body, field",
    [
        (
            dict(
                choice=None,
                tools=GRPC_TOOLS,
                tool_choice=pb.ToolChoice(function=pb.FunctionName(name="nope")),
            ),
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "chat.tool_choice.function.name 'nope' is not one of the tools given",
        ),
        (
            dict(choice="required", tools=[]),
            {"tool_choice": "required"},
            "chat.tool_choice is only allowed when tools are given",
        ),
        (
            dict(choice="named", tools=[]),
            {"tool_choice": NAMED},
            "chat.tool_choice is only allowed when tools are given",
        ),
        (
            dict(choice=None, tool_choice=pb.ToolChoice(mode=7)),
            None,
            "chat.tool_choice.mode must be one of TOOL_CHOICE_MODE_AUTO, TOOL_CHOICE_MODE_NONE, "
            "TOOL_CHOICE_MODE_REQUIRED, got 7",
        ),
        (dict(choice=None, tool_choice=pb.ToolChoice()), None, "chat.tool_choice must set mode or function"),
        (
            dict(choice="required", structured=pb.StructuredOutputs(json_object=True)),
            None,
            "chat.tool_choice 'required' cannot be combined with sampling.structured_outputs",
        ),
    ],
    ids=["unknown-name", "required-without-tools", "named-without-tools", "mode", "empty", "conflict"],
)
def test_grpc_bad_tool_choice_is_invalid_argument_worded_as_http(stack, client, request_kw, http_body, field):
    kw = dict(request_kw)
    tool_choice, structured = kw.pop("tool_choice", None), kw.pop("structured", None)
    request = _grpc_request(**kw)
    if tool_choice is not None:
        request.chat.tool_choice.CopyFrom(tool_choice)
    if structured is not None:
        request.sampling.structured_outputs.CopyFrom(structured)
    stub = inference(stack)
    for unary in (False, True):
        with pytest.raises(grpc.RpcError) as err:
            if unary:
                stub.Complete(request, timeout=30)
            else:
                list(stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(
            field
        ), err.value.details()
    if http_body is not None:  # the HTTP API's 400 says the same, without the chat. prefix
        assert "chat." + _http_error(client, **http_body) == err.value.details()
