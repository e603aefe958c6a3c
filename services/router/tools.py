"""OpenAI's tool-calling request fields: `tools`, `tool_choice`, `parallel_tool_calls`, and the
messages that carry calls (`assistant` with `tool_calls`) and results (`tool`). Both fronts use it:
the HTTP API reads these fields from the body, gRPC builds the same dict from its `Chat` (so an
error reads the same on both, gRPC's prefixed with `chat.`).

`tool_request` checks the fields (an error names the field, e.g. `tools[2].function.name`, and the
limit) and returns a `ToolRequest`: the tools as the chat template renders them, and what the answer
needs. tool_choice:

- "auto" (the default with tools): the model may write text or calls; the output is parsed
  (tool_parser.py). Nothing constrains it: a small model may write a malformed call, which is text.
- "required" / a named function: a constraint (an llguidance Lark grammar) makes the output exactly
  DeepSeek-V3's call block: the markers, a tool's name, and arguments that are JSON valid for that
  tool's parameters schema (`%json`), one call, or several with parallel_tool_calls. The markers are
  in the grammar itself (they are text to the tokenizer, so no server-side wrapping is needed), and
  the grammar travels in SamplingParams.structured_outputs to every worker, as any constraint.
- "none": the tools are still rendered (as vLLM does; the model knows them) but the output is not
  parsed: it is all content, as OpenAI's "none" promises no calls.

The legacy `functions` / `function_call` fields are refused with a 400 saying to send tools: mapping
them would answer in the tools shape, which their clients do not read.
"""

from __future__ import annotations

import copy
import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from engine.structured import StructuredOutputsParams
from engine.structured.params import MAX_STRUCTURED_OUTPUT_CHARS
from services.router.api import ConstraintCheck
from services.router.tool_parser import (
    ARGS_CLOSE,
    ARGS_OPEN,
    TOOL_CALL_BEGIN,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
)

MAX_TOOLS = 128
"""Most tools per request (OpenAI's limit)."""
MAX_TOOLS_CHARS = 256 * 1024
"""Longest `tools` as compact JSON, all tools together; each one's parameters are also held to the
structured-output limit (MAX_STRUCTURED_OUTPUT_CHARS), and a required / named constraint's grammar too."""
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function name (OpenAI's rule: letters, digits, underscores and dashes, at most 64)."""
_WHITESPACE = {"whitespace_flexible": False}  # compact arguments, as structured output's JSON


class ToolChoice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"
    """One call of the function `ToolRequest.name`."""


class ToolError(ValueError):
    """A tool field is wrong; `param` is the field the message names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]
    """OpenAI's tool objects as the template renders them: {"type": "function", "function":
    {"name", "description"?, "parameters"}}; parameters default to any object."""
    choice: ToolChoice
    name: str | None = None
    """The function tool_choice names (NAMED only)."""
    parallel: bool = True
    """parallel_tool_calls: false allows one call."""

    @property
    def parse(self) -> bool:
        """Whether the output is parsed for calls ("none": it is all content)."""
        return self.choice is not ToolChoice.NONE

    @property
    def max_calls(self) -> int | None:
        return 1 if self.choice is ToolChoice.NAMED or not self.parallel else None

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that enforces "required" / a named function (None for auto and none)."""
        if self.choice in (ToolChoice.NONE, ToolChoice.AUTO):
            return None
        return StructuredOutputsParams(grammar=call_grammar(self._chosen(), self.max_calls == 1))

    def _chosen(self) -> list[dict]:
        return [t for t in self.tools if self.name in (None, t["function"]["name"])]

    def checks(self, prefix: str = "") -> list[ConstraintCheck]:
        """What the grammar library must accept before the request is (Frontend.check_constraints):
        for "required" / a named function, each callable tool's parameters and the call grammar
        built from them; `prefix` goes before the field names (gRPC's "chat.")."""
        constraint = self.constraint()
        if constraint is None:
            return []
        checks = []
        for i, tool in enumerate(self.tools):
            if tool in self._chosen():
                where = f"{prefix}tools[{i}].function.parameters"
                params = StructuredOutputsParams(json=tool["function"]["parameters"])
                checks.append(ConstraintCheck(params, f"{prefix}tools", where, where))
        note = " (the grammar of the tools it may call)"
        checks.append(
            ConstraintCheck(constraint, f"{prefix}tool_choice", f"{prefix}tool_choice", "tool_choice", note)
        )
        return checks


def call_grammar(tools: list[dict], one: bool) -> str:
    """A Lark grammar (llguidance's dialect) for a DeepSeek-V3 call block calling these tools: one
    call, or one or more (one per line)."""
    lit = json.dumps  # a Lark string literal reads JSON's escapes
    calls = "call" if one else f"call ({lit(chr(10))} call)*"
    lines = [f"start: {lit(TOOL_CALLS_BEGIN)} {calls} {lit(TOOL_CALLS_END)}"]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(tools))))
    for i, tool in enumerate(tools):
        head = f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{tool['function']['name']}{ARGS_OPEN}"
        lines.append(f"call_{i}: {lit(head)} args_{i} {lit(ARGS_CLOSE)}")
        lines.append(f"args_{i}: %json {json.dumps(_with_whitespace(tool['function']['parameters']))}")
    return "\n".join(lines)


def _with_whitespace(schema: Any) -> Any:
    """The schema with compact JSON asked for, unless it asks for something itself."""
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return schema
    return {**schema, "x-guidance": _WHITESPACE}


def tool_request(body: dict) -> ToolRequest | None:
    """The request's tool fields (None without tools). A required / named choice's constraint is
    for the grammar library to check (`ToolRequest.checks`); the caller refuses it next to another
    structured output field (`conflict`)."""
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise ToolError(
                f"{legacy} is deprecated and not supported by this server; send tools and tool_choice instead",
                legacy,
            )
    raw_tools, raw_choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolError("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if raw_tools is None or raw_tools == []:
        if raw_choice not in (None, "none"):
            raise ToolError("tool_choice is only allowed when tools are given", "tool_choice")
        return None
    tools = check_tools(raw_tools)
    choice, name = _choice(raw_choice, {t["function"]["name"] for t in tools})
    request = ToolRequest(tools, choice, name, parallel is not False)
    if choice in (ToolChoice.REQUIRED, ToolChoice.NAMED):
        for i, tool in enumerate(tools):
            if name in (None, tool["function"]["name"]):
                _check_schema(tool["function"]["parameters"], i)
    return request


_HTTP_CONSTRAINTS = "a structured output field (response_format, structured_outputs or guided_*)"


def conflict(request: ToolRequest, other: str = _HTTP_CONSTRAINTS) -> ToolError:
    """The error for a required / named choice next to another constraint (`other` names its field)."""
    what = "'required'" if request.choice is ToolChoice.REQUIRED else f"naming {request.name!r}"
    return ToolError(
        f"tool_choice {what} cannot be combined with {other}: both constrain the output", "tool_choice"
    )


def check_tools(raw: Any) -> list[dict]:
    """OpenAI's `tools` checked, as the template renders them (ToolRequest.tools)."""
    if not isinstance(raw, list):
        raise ToolError("tools must be a list of {type: function, function: {...}} objects", "tools")
    if len(raw) > MAX_TOOLS:
        raise ToolError(f"tools has {len(raw)} entries, more than the limit of {MAX_TOOLS}", "tools")
    size = len(json.dumps(raw, separators=(",", ":"), ensure_ascii=False))
    if size > MAX_TOOLS_CHARS:
        raise ToolError(
            f"tools is {size} characters of JSON, more than the limit of {MAX_TOOLS_CHARS}", "tools"
        )
    tools, seen = [], set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ToolError(f"{where} must be an object", where)
        if tool.get("type") != "function":
            raise ToolError(
                f"{where}.type must be 'function', got {str(tool.get('type'))[:40]!r}", f"{where}.type"
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ToolError(f"{where}.function must be an object with a name", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or NAME_PATTERN.fullmatch(name) is None:
            raise ToolError(
                f"{where}.function.name must be 1 to 64 letters, digits, underscores or dashes, "
                f"got {str(name)[:80]!r}",
                f"{where}.function.name",
            )
        if name in seen:
            raise ToolError(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        seen.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string", f"{where}.function.description")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise ToolError(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        parameters = fn.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        elif not isinstance(parameters, dict):
            raise ToolError(
                f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters"
            )
        chars = len(json.dumps(parameters, separators=(",", ":"), ensure_ascii=False))
        if chars > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ToolError(
                f"{where}.function.parameters has {chars} characters, more than the limit of "
                f"{MAX_STRUCTURED_OUTPUT_CHARS}",
                f"{where}.function.parameters",
            )
        function = {"name": name} | ({"description": description} if description is not None else {})
        tools.append({"type": "function", "function": function | {"parameters": copy.deepcopy(parameters)}})
    return tools


def _choice(raw: Any, names: set[str]) -> tuple[ToolChoice, str | None]:
    if raw is None:
        return ToolChoice.AUTO, None
    if raw in ("none", "auto", "required"):
        return ToolChoice(raw), None
    usage = "tool_choice must be 'none', 'auto', 'required' or {type: function, function: {name}}"
    if (
        not isinstance(raw, dict)
        or raw.get("type") != "function"
        or not isinstance(raw.get("function"), dict)
    ):
        raise ToolError(f"{usage}, got {str(raw)[:80]!r}", "tool_choice")
    name = raw["function"].get("name")
    if name not in names:
        raise ToolError(
            f"tool_choice.function.name {str(name)[:80]!r} is not one of the tools given",
            "tool_choice.function.name",
        )
    return ToolChoice.NAMED, name


def _check_schema(schema: dict, i: int) -> None:
    """The schema's form (the grammar library's verdict comes from ToolRequest.checks)."""
    where = f"tools[{i}].function.parameters"
    try:
        StructuredOutputsParams(json=schema).validate("tools", where)
    except ValueError as e:
        raise ToolError(str(e), where) from None


# ---- messages ---------------------------------------------------------------------------------


def tool_calls(message: dict, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as the template renders them ([] when none):
    [{"id", "type": "function", "function": {"name", "arguments": JSON text}}]."""
    raw = message.get("tool_calls")
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ToolError(f"{where}.tool_calls must be a list of calls", f"{where}.tool_calls")
    calls = []
    for j, call in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ToolError(f"{at} must be an object with type 'function'", at)
        fn = call.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ToolError(f"{at}.function.name must be a non-empty string", f"{at}.function.name")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, dict):  # some clients send the object; the template wants its text
            arguments = json.dumps(arguments, ensure_ascii=False)
        if not isinstance(arguments, str):
            raise ToolError(f"{at}.function.arguments must be a JSON string", f"{at}.function.arguments")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise ToolError(f"{at}.id must be a string", f"{at}.id")
        calls.append(
            {
                "id": call_id or "",
                "type": "function",
                "function": {"name": fn["name"], "arguments": arguments},
            }
        )
    return calls


def tool_call_id(message: dict, where: str) -> str:
    """A tool message's `tool_call_id` (required, as OpenAI's API)."""
    value = message.get("tool_call_id")
    if not isinstance(value, str) or not value:
        raise ToolError(
            f"{where}.tool_call_id must be a non-empty string (the call this answers)",
            f"{where}.tool_call_id",
        )
    return value
