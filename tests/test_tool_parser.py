"""services/router/tool_parser.py on crafted DeepSeek-V3 outputs: whole, and streamed in chunks split
anywhere (inside markers too), which must release the same content and calls and never a part of a
marker as content."""

from __future__ import annotations

import json
import random

import pytest

from services.router.tool_parser import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
    ToolCallParser,
    parse_tool_calls,
)

MARKERS = (TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP)


def call(name: str, arguments: str) -> str:
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}\n```json\n{arguments}\n```{TOOL_CALL_END}"


def block(*calls: str) -> str:
    return TOOL_CALLS_BEGIN + "\n".join(calls) + TOOL_CALLS_END


ONE = block(call("get_weather", '{"city": "Paris"}'))
TWO = block(call("get_weather", '{"city": "Paris"}'), call("get_time", "{}"))


def stream(text: str, cuts: list[int], max_calls: int | None = None):
    """Feed text in pieces cut at `cuts`; (content pieces, {index: [deltas]}, parser)."""
    parser = ToolCallParser(max_calls)
    bounds = [0, *sorted(cuts), len(text)]
    released = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    released.append(parser.finish())
    content = [r.content for r in released if r.content]
    deltas: dict[int, list] = {}
    for r in released:
        for d in r.calls:
            deltas.setdefault(d.index, []).append(d)
    return content, deltas, parser


def reassemble(deltas: dict[int, list]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call from streamed deltas: the first carries id and name, the rest none."""
    out = []
    for index in sorted(deltas):
        first, *rest = deltas[index]
        assert first.id.startswith("call_") and first.name
        assert all(d.id is None and d.name is None for d in rest)
        out.append((first.id, first.name, "".join(d.arguments for d in deltas[index])))
    return out


@pytest.mark.parametrize(
    "text, content, calls",
    [
        ("Just text, no calls.", "Just text, no calls.", []),
        ("a < b and <｜tool", "a < b and <｜tool", []),  # a marker's prefix at the end is text
        (ONE, "", [("get_weather", '{"city": "Paris"}')]),
        (TWO, "", [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]),
        (
            "Let me check.\n" + TWO,
            "Let me check.\n",
            [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
        ),
        (ONE + "trailing", "", [("get_weather", '{"city": "Paris"}')]),  # after the block: dropped
        (ONE[: -len(TOOL_CALLS_END)], "", [("get_weather", '{"city": "Paris"}')]),  # EOS before the close
        (block(call("f", '{"s": "```"}')), "", [("f", '{"s": "```"}')]),  # a fence inside the arguments
    ],
    ids=["text", "marker-prefix", "one", "two", "text-before", "trailing", "unclosed-block", "fence-in-args"],
)
def test_whole_output(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)
    if calls:
        assert json.loads(got_calls[0].arguments) == json.loads(calls[0][1])


@pytest.mark.parametrize(
    "text",
    [
        TOOL_CALLS_BEGIN + "not a call" + TOOL_CALLS_END,
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "python" + TOOL_SEP + "f\n```json\n{}\n```" + TOOL_CALL_END,
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "bad name!\n```json\n{}",
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "f\n```python\n1\n```",
        TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "x" * 65 + "\n```json\n{}",
        "Before " + TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "get_wea",  # ends early
        "Before " + TOOL_CALLS_BEGIN,
    ],
    ids=[
        "junk",
        "not-function",
        "bad-name",
        "not-json-fence",
        "long-name",
        "unterminated-header",
        "only-begin",
    ],
)
def test_malformed_or_unterminated_markers_are_text(text):
    content, calls = parse_tool_calls(text)
    assert (content, calls) == (text, [])
    for cut in range(len(text) + 1):
        pieces, deltas, _ = stream(text, [cut])
        assert "".join(pieces) == text and not deltas


def test_arguments_cut_short_stay_as_written():
    text = "ok" + TOOL_CALLS_BEGIN + call("f", '{"a": 1}') + "\n" + TOOL_CALL_BEGIN + "function" + TOOL_SEP
    text += 'g\n```json\n{"b": [1, 2'
    content, calls = parse_tool_calls(text)
    assert content == "ok"
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}'), ("g", '{"b": [1, 2')]


def test_junk_after_a_call_is_content():
    text = TOOL_CALLS_BEGIN + call("f", "{}") + " and then some words"
    content, calls = parse_tool_calls(text)
    assert content == "and then some words" and [c.name for c in calls] == ["f"]


def test_max_calls_keeps_the_first():
    content, calls = parse_tool_calls("hm" + TWO, max_calls=1)
    assert content == "hm" and [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    _, deltas, _ = stream(TWO, list(range(0, len(TWO), 3)), max_calls=1)
    assert list(deltas) == [0]


TEXTS = [ONE, TWO, "Checking the weather now. " + TWO, "plain <｜ text with < signs"]


@pytest.mark.parametrize("text", TEXTS, ids=["one", "two", "text-before", "plain"])
def test_every_two_piece_split_gives_the_whole_result(text):
    want_content, want_calls = parse_tool_calls(text)
    for cut in range(len(text) + 1):
        pieces, deltas, parser = stream(text, [cut])
        assert "".join(pieces) == want_content
        assert not any(m in p for p in pieces for m in MARKERS)
        got = reassemble(deltas)
        assert [(n, a) for _, n, a in got] == [(c.name, c.arguments) for c in want_calls]
        assert [i for i, _, _ in got] == [c.id for c in parser.calls]


@pytest.mark.parametrize("seed", range(20))
def test_random_splits_and_single_characters(seed):
    rng = random.Random(seed)
    text = rng.choice(TEXTS[1:3])
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 30))) if seed else list(range(1, len(text)))
    pieces, deltas, _ = stream(text, cuts)
    want_content, want_calls = parse_tool_calls(text)
    assert "".join(pieces) == want_content
    assert not any("<" in p for p in pieces)  # these contents have none: no marker piece leaked
    assert [(n, a) for _, n, a in reassemble(deltas)] == [(c.name, c.arguments) for c in want_calls]
