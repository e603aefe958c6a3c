"""Structured output: constraints on a request's output (JSON schema, any JSON object, regex,
choice, grammar), compiled by llguidance off the engine thread (compiler.py says why that library)
and applied as one token bitmask per step (bitmask.py); manager.py is the engine's side."""

from engine.structured.params import ConstraintKind, StructuredOutputsParams

__all__ = ["ConstraintKind", "StructuredOutputsParams"]
