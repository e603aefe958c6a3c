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

It also shortens the spin of torch's OpenMP threads after each parallel region, unless the
environment sets OMP_WAIT_POLICY or GOMP_SPINCOUNT (libgomp reads them once it is loaded, with
torch): 30,000 rounds, ~0.5 ms, where libgomp spins 300,000 (~4.5 ms on the 2-core Zen 4). The
engine's decode steps run on the native kernels' own pool (kernels/native/pool.h), so after a
step with a prefill in it, OpenMP's spinning thread took one of the two cores from them for those
milliseconds; a prefill's own regions, microseconds apart, still find the threads spinning.
benchmarks/openmp_spin.py, bench model, bf16, 2-core Zen 4, four processes per setting
alternating: 64 x 128-token prompts at once 1.05x (1.03x by pair) the default's output tok/s,
the same prompts arriving two every three steps 1.04x (1.03x); with no spin at all
(OMP_WAIT_POLICY=PASSIVE) 0.88x and 0.85x, the prefill's regions then waking threads from sleep.
A worker sharing its cores with other processes gets PASSIVE from services/launcher.py.
"""

from __future__ import annotations

import importlib
import os

DEFAULTED_ENV: dict[str, str] = {}
"""The variables importing engine set because the environment named none. A process that starts
another with settings of its own (services/launcher.py: a worker's OMP_WAIT_POLICY, which an
inherited GOMP_SPINCOUNT would override) leaves them out; the child's own import sets them again
where they still apply."""


def _default(name: str, value: str) -> None:
    if name not in os.environ:
        os.environ[name] = DEFAULTED_ENV[name] = value


_default("THP_MEM_ALLOC_ENABLE", "1")
if "OMP_WAIT_POLICY" not in os.environ:
    _default("GOMP_SPINCOUNT", "30000")

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
