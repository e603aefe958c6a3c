"""What a request asks its output to follow: `StructuredOutputsParams`, the field of SamplingParams.

The field names are vLLM's (`SamplingParams(structured_outputs=StructuredOutputsParams(json=...))`);
exactly one kind is set. `validate` checks the shape and the size only, in pure Python, so any
thread may call it (the router does, on its event loop); whether a schema, regex or grammar is
valid is the grammar library's call (engine/structured/compiler.py: `check`, `GrammarCompiler`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

MAX_STRUCTURED_OUTPUT_CHARS = 64 * 1024
"""Longest constraint text: a schema's compact JSON, a regex, a grammar, or the choices as a JSON
list. Compile time and the matcher's memory grow with it."""
MAX_CHOICES = 1024
"""Most strings in a `choice` constraint."""


class ConstraintKind(enum.Enum):
    JSON = "json"
    """A JSON schema the output validates against."""
    JSON_OBJECT = "json_object"
    """Any JSON object (OpenAI's response_format json_object)."""
    REGEX = "regex"
    """A regular expression (Rust `regex` syntax) the whole output matches."""
    CHOICE = "choice"
    """Exactly one of a list of strings."""
    GRAMMAR = "grammar"
    """A context-free grammar in llguidance's Lark dialect (GBNF is converted)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None
    """A JSON schema, as an object or its JSON text (True: any JSON value)."""
    regex: str | None = None
    """A regular expression the whole output must match."""
    choice: list[str] | None = None
    """The output is exactly one of these strings."""
    grammar: str | None = None
    """A Lark grammar (llguidance's dialect, `start:` is the start rule) or a GBNF one (`root ::=`)."""
    json_object: bool = False
    """The output is a JSON object (any)."""

    def _set(self) -> list[str]:
        names = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        return names + ["json_object"] if self.json_object else names

    @property
    def kind(self) -> ConstraintKind:
        (name,) = self._set()
        return ConstraintKind(name)

    def key(self) -> tuple[ConstraintKind, str]:
        """(kind, text): what the compiled grammar depends on, and its cache key. A schema's text is
        its compact JSON with the keys in their order (property order is the generation order)."""
        kind = self.kind
        if kind is ConstraintKind.JSON:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if kind is ConstraintKind.JSON_OBJECT:
            return kind, ""
        if kind is ConstraintKind.CHOICE:
            return kind, json.dumps(list(self.choice), ensure_ascii=False)
        return kind, self.regex if kind is ConstraintKind.REGEX else self.grammar

    def validate(self, field: str = "structured_outputs", where: str | None = None) -> None:
        """Raise ValueError when the shape or size is wrong, naming `field` or, for the kind's
        value, `where` (default field.kind; an API names its own, e.g. response_format.json_schema.schema)."""
        chosen = self._set()
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                f"{field} must set exactly one of json, regex, choice, grammar, json_object; got {got}"
            )
        (name,) = chosen
        value = getattr(self, name)
        where = where or f"{field}.{name}"
        if name == "json":
            _check_schema(value, where)
        elif name == "json_object":
            if value is not True:
                raise ValueError(f"{where} must be true or false, got {value!r}")
        elif name == "choice":
            if not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{where} must be a non-empty list of strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"{where} has {len(value)} strings, more than the limit of {MAX_CHOICES}")
            if not all(isinstance(c, str) for c in value):
                raise ValueError(f"{where} must be a non-empty list of strings")
        elif not isinstance(value, str) or not value:
            raise ValueError(f"{where} must be a non-empty string")
        size = len(self.key()[1])
        if size > MAX_STRUCTURED_OUTPUT_CHARS:
            raise ValueError(
                f"{where} has {size} characters, more than the limit of {MAX_STRUCTURED_OUTPUT_CHARS}"
            )


def _check_schema(schema: Any, where: str) -> None:
    if isinstance(schema, str):
        if len(schema) > 4 * MAX_STRUCTURED_OUTPUT_CHARS:  # before parsing: whitespace shrinks it
            raise ValueError(
                f"{where} has {len(schema)} characters, more than the limit of {MAX_STRUCTURED_OUTPUT_CHARS}"
            )
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(
            f"{where} must be a JSON schema (an object or a boolean), got {type(schema).__name__}"
        )
