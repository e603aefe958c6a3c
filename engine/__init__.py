"""pdserve's inference engine, usable alone: `from engine import LLM, SamplingParams`.

Names are resolved lazily so that importing a submodule (e.g. engine.kv_cache) does not load
the whole model stack.

Importing it asks torch (unless the environment already says otherwise) to put its CPU tensors
of 2 MiB and more on transparent huge pages, page-aligned (THP_MEM_ALLOC_ENABLE, which torch
reads at its first allocation, so this comes before anything here imports it). A step's large
temporaries (prefill activations, a wide decode batch's) then no longer fragment glibc's heap:
on the bench model (bf16, 2 cores) the process peaked at 2.3-2.4 GiB over a 256-request prefill
and decode, against 3.2 GiB, at the same speed. engine/hugepages.py places the weights and the
KV cache on huge pages itself, wherever torch was imported first.
"""

from __future__ import annotations

import importlib
import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

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
