"""The OpenAI request fields that ask for structured output, as the engine's StructuredOutputsParams.

Three spellings, at most one per request:

- OpenAI's `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, or
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`. The
  schema is always enforced: `strict: false` asks for less than that and gets it too.
- vLLM's `structured_outputs` object: exactly one of `json` (a schema), `regex`, `choice`,
  `grammar`, `json_object`.
- vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Each is read here and checked by the grammar library itself (the front awaits `ConstraintCheck`,
Frontend.check_constraints): an invalid schema, regex or grammar, or one too costly to build, is
a 400 whose message names the field it came in (e.g. `response_format.json_schema.schema`).
Options that would change the output but are not supported (`structural_tag`, whitespace
patterns) are refused, never ignored.
"""

from __future__ import annotations

from typing import Any

from engine.structured import StructuredOutputsParams
from services.router.api import ConstraintCheck

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {f"guided_{k}": k for k in ("json", "regex", "choice", "grammar")}
_UNSUPPORTED = ("guided_whitespace_pattern",)


class StructuredOutputError(ValueError):
    """A structured-output field is wrong; `param` is the request's top-level field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def structured_outputs(body: dict[str, Any]) -> ConstraintCheck | None:
    """The request's constraint, and how to name it in an error (None when it asks for none).
    Raises StructuredOutputError for a malformed one; the grammar library's verdict is the
    caller's to await."""
    for name in _UNSUPPORTED:
        if body.get(name) is not None:
            raise StructuredOutputError(f"{name} is not supported by this server", name)
    found: list[tuple[str, StructuredOutputsParams, str]] = []  # (param, constraint, field of its value)
    response_format = body.get("response_format")
    if response_format is not None:
        parsed = _response_format(response_format)
        if parsed is not None:
            found.append(("response_format", *parsed))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", *_vllm_object(body["structured_outputs"])))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, StructuredOutputsParams(**{kind: body[name]}), name))
    if not found:
        return None
    if len(found) > 1:
        names = [param for param, _, _ in found]
        raise StructuredOutputError(
            f"only one structured output field may be set, got {', '.join(names)}", names[-1]
        )
    ((param, params, where),) = found
    try:
        params.validate(param, where)
    except ValueError as e:
        raise StructuredOutputError(str(e), param) from None
    return ConstraintCheck(params, param, where, param)


def _response_format(value: Any) -> tuple[StructuredOutputsParams, str] | None:
    param = "response_format"
    if not isinstance(value, dict):
        raise StructuredOutputError(f"{param} must be an object with a type", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), f"{param}.type"
    if kind != "json_schema":
        raise StructuredOutputError(
            f"{param}.type must be one of ['text', 'json_object', 'json_schema'], got {kind!r}"[:200], param
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise StructuredOutputError(
            f"{param}.json_schema must be an object with name and schema when type is json_schema", param
        )
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise StructuredOutputError(f"{param}.json_schema.name must be a non-empty string", param)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise StructuredOutputError(f"{param}.json_schema.strict must be true or false", param)
    if spec.get("schema") is None:
        raise StructuredOutputError(f"{param}.json_schema.schema is required", param)
    return StructuredOutputsParams(json=spec["schema"]), f"{param}.json_schema.schema"


def _vllm_object(value: Any) -> tuple[StructuredOutputsParams, str]:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredOutputError(f"{param} must be an object with one of {list(_KINDS)}", param)
    unknown = sorted(k for k, v in value.items() if k not in _KINDS and v is not None)
    if unknown:
        raise StructuredOutputError(
            f"{param} has unsupported key(s) {unknown}; supported: {list(_KINDS)}", param
        )
    chosen = [k for k in _KINDS if value.get(k) not in (None, False)]
    if len(chosen) != 1:
        raise StructuredOutputError(f"{param} must set exactly one of {list(_KINDS)}, got {chosen}", param)
    (kind,) = chosen
    return StructuredOutputsParams(**{kind: value[kind]}), f"{param}.{kind}"
