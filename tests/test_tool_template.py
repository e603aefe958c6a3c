"""The chat template renders tools, assistant tool calls and tool results as DeepSeek-V3's does.

DEEPSEEK_V3_TEMPLATE is the chat_template of deepseek-ai/DeepSeek-V3's tokenizer_config.json
(the December 2024 release), copied verbatim as the reference. Ours renders every conversation that
DeepSeek's renders correctly to the same text, differs where DeepSeek's is wrong (one call, a
second turn of calls), and adds the `tools` section DeepSeek's template leaves to its API.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest
import transformers

from engine.tokenizer import Tokenizer
from modelkit.bpe_tokenizer import (
    ASSISTANT_TOKEN,
    BOS_TOKEN,
    CHAT_TEMPLATE,
    EOS_TOKEN,
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_OUTPUT_BEGIN,
    TOOL_OUTPUT_END,
    TOOL_OUTPUTS_BEGIN,
    TOOL_OUTPUTS_END,
    TOOL_SEP,
    TOOLS_INTRO,
    TOOLS_USAGE,
    USER_TOKEN,
)

ASSET = Path(__file__).resolve().parents[1] / "assets" / "pdserve-tiny"

DEEPSEEK_V3_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', "
    "is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}"
    "{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}"
    "{% set ns.is_first_sp = false %}{%- else %}"
    "{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}"
    "{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is none %}"
    "{%- set ns.is_tool = false -%}{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + "
    "'```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}"
    "{{'\\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
    "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"
    "{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    "{%- set ns.is_tool = false -%}{%- else %}"
    "{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    "{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    "{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"
    "{%- set ns.is_output_first = false %}{%- else %}"
    "{{'\\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}"
    "{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Today's weather in a city <in °C>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _call(name: str, arguments: dict, i: int) -> dict:
    return {
        "id": f"call_{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


TWO_CALLS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [_call("get_weather", {"city": "Paris"}, 0), _call("get_time", {}, 1)],
    },
    {"role": "tool", "tool_call_id": "call_0", "content": '{"c": 21}'},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    {"role": "assistant", "content": "21 °C at noon."},
    {"role": "user", "content": "Thanks"},
]
PLAIN = [
    {"role": "system", "content": "Be brief."},
    {"role": "system", "content": "Use English."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"},
    {"role": "user", "content": "Again?"},
]


def _reference(messages, add_generation_prompt: bool = True) -> str:
    env = jinja2.Environment()
    return env.from_string(DEEPSEEK_V3_TEMPLATE).render(
        messages=messages, bos_token=BOS_TOKEN, add_generation_prompt=add_generation_prompt
    )


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(ASSET)


def _fence(name: str, arguments: str) -> str:
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{arguments}\n```{TOOL_CALL_END}"


@pytest.mark.parametrize("cut", [3, 5, 6, 7], ids=["ends-with-calls", "ends-with-results", "answer", "user"])
@pytest.mark.parametrize("gen", [True, False], ids=["gen", "no-gen"])
def test_renders_as_deepseek_v3_where_its_template_is_right(tok, cut, gen):
    messages = TWO_CALLS[:cut]
    assert tok.apply_chat_template(messages, add_generation_prompt=gen) == _reference(messages, gen)


@pytest.mark.parametrize("gen", [True, False])
def test_conversations_without_tools_render_as_before(tok, gen):
    assert tok.apply_chat_template(PLAIN, add_generation_prompt=gen) == _reference(PLAIN, gen)
    assert tok.apply_chat_template(PLAIN, add_generation_prompt=gen, tools=[]) == _reference(PLAIN, gen)


def test_a_round_trip_renders_the_calls_results_and_the_turn_after_them(tok):
    args = TWO_CALLS[2]["tool_calls"]
    want = (
        f"{BOS_TOKEN}Be brief.{USER_TOKEN}Weather in Paris, and the time?"
        f"{ASSISTANT_TOKEN}{TOOL_CALLS_BEGIN}"
        + _fence("get_weather", args[0]["function"]["arguments"])
        + "\n"
        + _fence("get_time", args[1]["function"]["arguments"])
        + f"{TOOL_CALLS_END}{EOS_TOKEN}"
        f'{TOOL_OUTPUTS_BEGIN}{TOOL_OUTPUT_BEGIN}{{"c": 21}}{TOOL_OUTPUT_END}\n{TOOL_OUTPUT_BEGIN}12:00{TOOL_OUTPUT_END}'
        f"{TOOL_OUTPUTS_END}"  # the model answers straight after the results
    )
    assert tok.apply_chat_template(TWO_CALLS[:5]) == want
    answered = tok.apply_chat_template(TWO_CALLS[:6], add_generation_prompt=False)
    assert answered == want + f"21 °C at noon.{EOS_TOKEN}"


def test_one_call_and_a_second_turn_of_calls_are_closed_and_opened(tok):
    """Where DeepSeek's template is wrong: a single call is never closed, and a later turn's calls
    lose their opening marker. Ours renders every turn the same way."""
    call = _call("get_weather", {"city": "Oslo"}, 0)
    turn = [
        {"role": "user", "content": "Oslo?"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": "cold"},
    ]
    one = f"{ASSISTANT_TOKEN}Looking.{TOOL_CALLS_BEGIN}{_fence('get_weather', call['function']['arguments'])}"
    one += f"{TOOL_CALLS_END}{EOS_TOKEN}{TOOL_OUTPUTS_BEGIN}{TOOL_OUTPUT_BEGIN}cold{TOOL_OUTPUT_END}"
    rendered = tok.apply_chat_template(turn + turn)
    assert rendered == (
        f"{BOS_TOKEN}{USER_TOKEN}Oslo?{one}{TOOL_OUTPUTS_END}{USER_TOKEN}Oslo?{one}{TOOL_OUTPUTS_END}"
    )
    assert _reference(turn) != tok.apply_chat_template(turn)  # DeepSeek's drops the content and the close


def test_tools_go_after_the_system_prompt_as_json(tok):
    rendered = tok.apply_chat_template(PLAIN[2:3], tools=[WEATHER, TIME])
    functions = "".join("\n" + json.dumps(t["function"], ensure_ascii=False) for t in (WEATHER, TIME))
    assert rendered == f"{BOS_TOKEN}{TOOLS_INTRO}{functions}{TOOLS_USAGE}{USER_TOKEN}Hi{ASSISTANT_TOKEN}"
    with_system = tok.apply_chat_template(PLAIN[:3], tools=[WEATHER])
    assert with_system.startswith(f"{BOS_TOKEN}Be brief.\n\nUse English.\n\n{TOOLS_INTRO}\n")
    assert "<in °C>" in rendered  # HF's tojson: no HTML escapes, no \\u escapes


def test_transformers_renders_the_same(tok):
    hf = transformers.AutoTokenizer.from_pretrained(ASSET)
    for messages, tools in [(TWO_CALLS, [WEATHER, TIME]), (TWO_CALLS[:5], None), (PLAIN, None)]:
        want = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert tok.apply_chat_template(messages, tools=tools) == want


def test_the_shipped_model_carries_the_template(tok):
    assert tok.chat_template == CHAT_TEMPLATE
    # The markers are text to this tokenizer: they encode to ordinary pieces that decode back.
    ids = tok.encode(TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN, add_special_tokens=False)
    assert len(ids) > 2 and tok.decode(ids, skip_special_tokens=True) == TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN
