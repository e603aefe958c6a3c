"""LangChain's ChatOpenAI, unchanged, against a served stack (router, prefill and decode workers as
processes, every request disaggregated): invoke and stream, `with_structured_output` by function
calling, JSON mode and JSON schema, `bind_tools(..., tool_choice="any")`, and an agent's round trip
(the model's call, the tool's result as a ToolMessage, the answer).

Every request LangChain sends is recorded; greedy answers equal the offline engine's for the
messages and tools in that very body, rendered by the model's chat template, under the constraint
its fields ask for; so the server renders LangChain's calls and tool results as the template does.
LangChain's invoke must not need tiktoken (whose BPE files it would download).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, Field

from engine import LLM, SamplingParams
from services.openai.structured import structured_outputs
from services.router.tool_parser import parse_tool_calls
from services.router.tools import tool_request

MODEL = "pdserve-tiny"
QUESTION = "What is the weather in Paris this week?"


# extra="forbid": the schemas say "additionalProperties": false, so the constraint holds the model to
# exactly these keys (without it, a random model may add keys with strings that never end).
class Day(BaseModel):
    model_config = ConfigDict(extra="forbid")

    high: int = Field(ge=-40, le=50)
    sky: Literal["sun", "cloud", "rain"]


class Forecast(BaseModel):
    """A weather forecast for a city."""

    model_config = ConfigDict(extra="forbid")

    city: str = Field(min_length=1, max_length=12, description="the city's name")
    unit: Literal["celsius", "fahrenheit"]
    days: list[Day] = Field(min_length=1, max_length=2)
    tags: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    city: str = Field(max_length=12, description="the city")
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture(scope="module")
def stack(serving_stack):
    return serving_stack


@pytest.fixture(scope="module")
def offline(tiny_model) -> LLM:
    return LLM(tiny_model, dtype="float32", num_kv_blocks=256)


@pytest.fixture(autouse=True)
def no_tiktoken(monkeypatch):
    import tiktoken

    def refuse(*args, **kwargs):
        raise AssertionError("LangChain called tiktoken")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setattr(tiktoken, "encoding_for_model", refuse)


@pytest.fixture
def sent() -> list[dict]:
    """The JSON bodies LangChain posts, in order."""
    return []


@pytest.fixture
def chat(stack, sent):
    """ChatOpenAI as its users point it at an OpenAI-compatible server."""
    from langchain_openai import ChatOpenAI

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    def make(**kw):
        kw = {"temperature": 0, "max_tokens": 400, **kw}
        return ChatOpenAI(
            base_url=stack.http_url + "/v1",
            api_key="unused",
            model=MODEL,
            max_retries=0,
            timeout=120,
            http_client=httpx.Client(event_hooks={"request": [record]}),
            **kw,
        )

    return make


@pytest.fixture(scope="module")
def get_weather():
    from langchain_core.tools import tool

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str, unit: str) -> str:
        """The weather in a city now."""
        return json.dumps({"city": city, "temperature": 21, "unit": unit})

    return get_weather


def _offline(offline: LLM, body: dict):
    """-> (prompt ids, the offline engine's greedy output) for a chat body as sent: its messages
    and tools rendered by the chat template, under the constraint its fields ask for."""
    tools = tool_request(body)
    tok = offline.tokenizer
    text = tok.apply_chat_template(body["messages"], tools=tools.tools if tools else None)
    ids = tok.encode(text, add_special_tokens=False)
    constraint = tools.constraint() if tools else None
    asked = structured_outputs(body)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=body["max_completion_tokens"],
        structured_outputs=constraint or (asked.params if asked else None),
    )
    (out,) = offline.generate(prompt_token_ids=[ids], sampling_params=[params])
    return ids, out


def test_invoke_and_stream_give_the_offline_engines_answer(chat, sent, offline):
    llm = chat(max_tokens=8)
    message = llm.invoke(QUESTION)
    ids, ref = _offline(offline, sent[-1])
    assert message.content == ref.text
    assert message.usage_metadata["input_tokens"] == len(ids)
    assert message.usage_metadata["output_tokens"] == len(ref.token_ids)
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == ref.text


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1, "seed": 7}], ids=["t0", "t1"])
def test_structured_output_returns_a_valid_object(chat, sent, offline, method, sampling):
    """Both methods are enforced by a constraint: the object validates whatever the model."""
    forecast = chat(**sampling).with_structured_output(Forecast, method=method).invoke(QUESTION)
    assert isinstance(forecast, Forecast)
    body = sent[-1]
    if method == "function_calling":  # a named tool_choice
        assert body["tool_choice"] == {"type": "function", "function": {"name": "Forecast"}}
    else:
        assert body["response_format"]["type"] == "json_schema"
        assert body["response_format"]["json_schema"]["strict"] is True
    if sampling["temperature"] == 0 and method == "json_schema":
        # (A forced call's greedy equality is checked below, with bind_tools: the same grammar.)
        _, ref = _offline(offline, body)
        assert forecast == Forecast.model_validate_json(ref.text)


def test_json_mode_returns_a_json_object(chat, sent, offline):
    """JSON mode constrains the output to some JSON object, not to the model's schema: a random
    model fits no particular schema, and an unbounded object only ends when the model closes it,
    which a bias on "}" makes it do. So: the raw output is a JSON object, and LangChain either
    parsed it into a Forecast or says why not."""
    from langchain_core.exceptions import OutputParserException

    brace = offline.tokenizer.encode("}", add_special_tokens=False)
    assert len(brace) == 1
    llm = chat(max_tokens=64, logit_bias={brace[0]: 100})
    out = llm.with_structured_output(Forecast, method="json_mode", include_raw=True).invoke(
        QUESTION + " Answer in JSON."
    )
    assert sent[-1]["response_format"] == {"type": "json_object"}
    raw = out["raw"]
    assert raw.response_metadata["finish_reason"] == "stop"
    assert isinstance(json.loads(raw.content), dict)
    if out["parsing_error"] is None:
        assert isinstance(out["parsed"], Forecast)
    else:
        assert out["parsed"] is None and isinstance(out["parsing_error"], OutputParserException)


def test_bind_tools_any_gives_a_valid_call_and_a_round_trip_answers(chat, sent, offline, get_weather):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.utils.function_calling import convert_to_openai_tool

    llm = chat()
    question = HumanMessage(QUESTION)
    ai = llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).invoke([question])
    assert sent[-1]["tool_choice"] == "required"  # LangChain's "any" is OpenAI's "required"
    assert ai.response_metadata["finish_reason"] == "tool_calls" and not ai.invalid_tool_calls
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], convert_to_openai_tool(get_weather)["function"]["parameters"])
    _, ref = _offline(offline, sent[-1])
    (want,) = parse_tool_calls(ref.text, max_calls=1)[1]
    assert call["args"] == json.loads(want.arguments)

    # The same call streamed: LangChain assembles it from the tool_calls deltas.
    chunks = list(
        llm.bind_tools([get_weather], tool_choice="any", parallel_tool_calls=False).stream([question])
    )
    streamed = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]

    # The agent's next step: the tool runs, its ToolMessage goes back, the model answers.
    result = get_weather.invoke(call)
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    answer = chat(max_tokens=12).bind_tools([get_weather]).invoke([question, ai, result])
    assert isinstance(answer, AIMessage)
    body = sent[-1]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "tool"]
    assert body["messages"][1]["tool_calls"][0]["id"] == call["id"]
    ids, ref = _offline(offline, body)
    prompt = offline.tokenizer.decode(ids, skip_special_tokens=False)
    arguments = body["messages"][1]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == call["args"]
    assert f"function<｜tool▁sep｜>get_weather\n```json\n{arguments}\n```<｜tool▁call▁end｜>" in prompt
    assert prompt.endswith(
        f"<｜tool▁output▁begin｜>{result.content}<｜tool▁output▁end｜><｜tool▁outputs▁end｜>"
    )
    assert answer.usage_metadata["input_tokens"] == len(ids)
    content, calls = parse_tool_calls(ref.text)
    assert answer.content == content
    assert [(c["name"], c["args"]) for c in answer.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
