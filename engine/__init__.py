"""pdserve's inference engine, usable alone: `from engine import LLM, SamplingParams`.

Names are resolved lazily so that importing a submodule (e.g. engine.kv_cache) does not load
the whole model stack.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "engine.llm",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.structured.params",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
