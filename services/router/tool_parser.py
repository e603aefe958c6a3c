"""DeepSeek-V3 tool calls in a model's output text, as OpenAI `tool_calls`, streamed or whole.

The model writes (chat template: modelkit/bpe_tokenizer.py; vLLM's deepseek_v3 parser reads the same)

    [content]<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    ARGUMENTS
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers are parsed as text, whatever the tokenizer makes of them: the shipped models' byte-level
BPE spells them with ordinary pieces, DeepSeek's own tokenizer has them as added tokens that are not
special, so decoding never strips them.

The HTTP and the gRPC fronts both run a choice's deltas through `ToolCallParser.feed_delta`.
`ToolCallParser.feed` takes the text as it streams, in chunks split anywhere, and returns what can
be released: content (the text before the markers; never a part of a marker, since a tail that may
still become one is held back) and call deltas in OpenAI's streaming shape (the first delta of a
call carries its id and name, the next ones fragments of its arguments). Feeding the whole text at
once gives the same calls, so the streamed and the whole responses agree by construction.

A call is taken once its header (`function<｜tool▁sep｜>NAME` and the opening fence) is complete.
Anything else after `<｜tool▁calls▁begin｜>` before a call was taken (a malformed header, output that
ends early) is content after all, markers included: the model wrote text, not a call, and the
client sees it. Text after a malformed piece later in the block is content too; text after
`<｜tool▁calls▁end｜>` is dropped (the model should end there; under tool_choice "required" the
constraint ends it). Arguments cut short by max_tokens stay as written, with finish_reason
"length", as OpenAI's API returns them.
"""

from __future__ import annotations

import enum
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
ARGS_OPEN = "\n```json\n"
"""Between a call's name and its arguments."""
ARGS_CLOSE = "\n```" + TOOL_CALL_END
"""After a call's arguments."""
_HEAD = "function" + TOOL_SEP
_NAME = re.compile(r"[A-Za-z0-9_.:\-]*")
MAX_NAME_CHARS = 64
"""Longest function name (OpenAI's limit); a longer one is not a call."""


@dataclass
class ToolCall:
    """One call as the response's message.tool_calls[i] holds it."""

    id: str
    name: str
    arguments: str = ""
    """The arguments' JSON text, as the model wrote it."""

    def json(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class CallDelta:
    """A part of call `index`: its id and name the first time, then argument fragments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def json(self) -> dict:
        """OpenAI's streaming delta.tool_calls[i]."""
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {
            "index": self.index,
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Released:
    """What one feed (or finish) releases."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def add_arguments(self, index: int, text: str, header: ToolCall | None = None) -> None:
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        elif header is not None:
            self.calls.append(CallDelta(index, text, header.id, header.name))
        elif text:
            self.calls.append(CallDelta(index, text))


class _State(enum.Enum):
    CONTENT = "content"
    """Before the block: text is content, up to the block's opening marker."""
    BETWEEN = "between"
    """In the block, between calls: a call's opening marker or the block's closing one next."""
    HEADER = "header"
    """After a call's opening marker: `function<｜tool▁sep｜>NAME` and the fence next."""
    ARGUMENTS = "arguments"
    """A call's arguments, up to the closing fence and marker."""
    DONE = "done"
    """After the block (or after max_calls): the rest is dropped."""
    TEXT = "text"
    """The block turned out malformed: the rest is content."""


def _header(text: str) -> tuple[str | None, int]:
    """(name, length) when text starts with a whole call header `function<｜tool▁sep｜>NAME` and
    the fence; (None, 0) while it may still become one; (None, -1) when it cannot."""
    if len(text) <= len(_HEAD):
        return None, 0 if _HEAD.startswith(text) else -1
    if not text.startswith(_HEAD):
        return None, -1
    name = _NAME.match(text, len(_HEAD)).group()
    after = text[len(_HEAD) + len(name) :]
    if len(name) > MAX_NAME_CHARS or (after and not name):
        return None, -1
    if after.startswith(ARGS_OPEN):
        return name, len(_HEAD) + len(name) + len(ARGS_OPEN)
    return None, 0 if ARGS_OPEN.startswith(after) else -1


def _held(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallParser:
    """One choice's text → content and tool calls. One owner, not thread-safe.

    max_calls: calls kept (parallel_tool_calls false: 1); later ones are dropped."""

    def __init__(self, max_calls: int | None = None):
        self.max_calls = max_calls
        self.calls: list[ToolCall] = []
        """The calls taken so far, their arguments as far as released."""
        self.content = ""
        """The content released so far."""
        self._state = _State.CONTENT
        self._buf = ""  # text fed but not released yet
        self._block = ""  # the block's raw text consumed so far, released as content if it is malformed

    def feed(self, text: str) -> Released:
        out = Released()
        self._buf += text
        while self._step(out):
            pass
        self.content += out.content
        return out

    def feed_delta(self, text: str, finish_reason: str | None) -> tuple[Released, str | None]:
        """One delta of the output, as both fronts stream it: what it releases (everything held
        back too when it is the last, finish_reason set) and its finish reason, "tool_calls" for a
        choice that stopped having made calls ("length" stays: the last call may be cut short)."""
        out = self.feed(text)
        if finish_reason is None:
            return out, None
        last = self.finish()
        for part in last.calls:
            out.add_arguments(part.index, part.arguments)
        out.content += last.content
        return out, "tool_calls" if finish_reason == "stop" and self.calls else finish_reason

    def finish(self) -> Released:
        """The end of the output: release what was held back."""
        out = Released()
        if self._state is _State.CONTENT or self._state is _State.TEXT:
            out.content, self._buf = self._buf, ""
        elif self._state is _State.ARGUMENTS:  # cut short: the arguments as written
            self._arguments(out, self._buf)
        elif self._state in (_State.BETWEEN, _State.HEADER) and not self.calls:
            out.content = self._block + self._buf
        self._buf, self._state = "", _State.DONE
        self.content += out.content
        return out

    # ---- the state machine: each _step consumes what it can and says whether to go on ----------

    def _step(self, out: Released) -> bool:
        if self._state is _State.CONTENT:
            at = self._buf.find(TOOL_CALLS_BEGIN)
            if at < 0:
                keep = _held(self._buf, TOOL_CALLS_BEGIN)
                out.content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            out.content += self._buf[:at]
            self._consume(at, len(TOOL_CALLS_BEGIN))
            self._state = _State.BETWEEN
            return True
        if self._state is _State.BETWEEN:
            stripped = self._buf.lstrip()
            self._consume(0, len(self._buf) - len(stripped))
            for marker, state in ((TOOL_CALL_BEGIN, _State.HEADER), (TOOL_CALLS_END, _State.DONE)):
                if stripped.startswith(marker):
                    self._consume(0, len(marker))
                    full = self.max_calls is not None and len(self.calls) >= self.max_calls
                    self._state = _State.DONE if full else state
                    return True
            if not stripped or TOOL_CALL_BEGIN.startswith(stripped) or TOOL_CALLS_END.startswith(stripped):
                return False  # wait for more
            return self._malformed(out)
        if self._state is _State.HEADER:
            name, end = _header(self._buf)
            if name is None:
                return False if end == 0 else self._malformed(out)
            call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name)
            self.calls.append(call)
            self._buf, self._block = self._buf[end:], ""
            out.add_arguments(len(self.calls) - 1, "", header=call)
            self._state = _State.ARGUMENTS
            return True
        if self._state is _State.ARGUMENTS:
            at = self._buf.find(ARGS_CLOSE)
            if at < 0:
                keep = _held(self._buf, ARGS_CLOSE)
                self._arguments(out, self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            self._arguments(out, self._buf[:at])
            self._buf = self._buf[at + len(ARGS_CLOSE) :]
            self._state = _State.BETWEEN
            return True
        if self._state is _State.TEXT:
            out.content, self._buf = out.content + self._buf, ""
            return False
        self._buf = ""  # DONE
        return False

    def _consume(self, start: int, length: int) -> None:
        """Drop buf[:start + length], keeping the dropped block text for a malformed block."""
        self._block += self._buf[start : start + length]
        self._buf = self._buf[start + length :]

    def _arguments(self, out: Released, text: str) -> None:
        if text:
            self.calls[-1].arguments += text
            out.add_arguments(len(self.calls) - 1, text)

    def _malformed(self, out: Released) -> bool:
        """Not a call after all: the block so far is content when no call was taken from it."""
        if not self.calls:
            out.content += self._block
        self._block = ""
        self._state = _State.TEXT
        return True


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """A whole output's content and calls (what feeding it in any chunks gives)."""
    parser = ToolCallParser(max_calls)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls
