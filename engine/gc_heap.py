"""Keeping Python's garbage collector from stalling a serving process.

A full (oldest-generation) collection walks every container object the process holds. A worker
holds a few hundred thousand once its model, tokenizer, gRPC stack and NIXL agent are up, nearly
all of them for its whole life, and CPython starts a full pass whenever the objects that survived
into the oldest generation since the last one reach a quarter of those it kept then. On the bench
model on 2 cores such a pass took 95-210 ms, holding the GIL throughout: the event loop stops
handing tokens on and taking KV in, and the engine thread stops between two kernels. It came
about once per served round, and when 32 requests handed over at once it landed in the middle of
their imports (every one of them waited for it).

`gc.freeze()` moves every object tracked so far into a permanent generation that no collection
scans (as vLLM's engine core and API server do once started); a full pass then walks only what
was made since. Frozen objects are still freed by reference counting; only a reference cycle
among them is never collected, which is why this is for processes that keep what they started
with until they exit (the workers, the router, a data-parallel engine's rank processes), not for
a library call.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what is garbage now, then freeze every object left -> how many are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(
        "froze %d startup objects out of the collector's scans (%.0f ms)",
        frozen,
        1e3 * (time.perf_counter() - start),
    )
    return frozen
