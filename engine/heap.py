"""Giving freed host memory back to the system between engine steps.

On CPU every activation is a fresh malloc. glibc serves allocations above its mmap threshold with
mmap and returns them on free, but the threshold is dynamic: once a large block is freed it rises
to that block's size (up to 32 MiB), and from then on those sizes come from the heap and stay
there when freed. A step's temporaries come in many sizes (prefill chunks, decode batches of every
width), so the heap fragments and the process keeps whatever its worst mix ever needed. Measured
on the bench model in bf16 (2 GiB cache requested, 1.15 GiB used, 2 cores): the process held
3.5 GiB after a 256-request prefill and decode, of which 1.5 GiB was free heap that malloc_trim
handed back at once.

Fixing the threshold low (mmap for every large temporary) bounds the heap but makes every step
fault its temporaries' pages in afresh: decode steps ran about 2x slower. So the heap is kept
warm, and only when more than `limit` bytes of it lie free after a step, and the last trim is
some seconds back, does `malloc_trim` hand the free pages back. The check (mallinfo2) walks the
heap's free lists: a few microseconds on a fresh heap, but 1.1 ms on the bench model's after a few
thousand steps (5% of a batch-1 step), so it runs at most once per `check_interval_s`. Elsewhere
than glibc >= 2.33 this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

logger = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc, or older than 2.33
        return None


MIN_INTERVAL_S = 10.0
"""Least time between two trims. Right after a trim the next step faults its temporaries' pages
back in; trimming after every step that left more than the limit free (every 4096-token prefill
chunk does) cost ~15% more CPU time, once per 10 s costs little and keeps the peak close."""


CHECK_INTERVAL_S = 1.0
"""Least time between two looks at how much of the heap lies free."""


PREFILL_END_LIMIT = 32 << 20
"""When the prompts stop (a step without one after steps with some), their temporaries are no
longer needed: free heap above this goes back then, still at most once per min_interval_s. The
decode steps that follow need little of it, and the cache grows under them to the run's peak."""


class HeapTrimmer:
    """After each step, `maybe_trim()` returns the heap's free pages to the system when more
    than `limit_bytes` of it lie free, or PREFILL_END_LIMIT after the last of a run of prefill
    steps, at most once per `min_interval_s`, looking at most once per `check_interval_s` (and
    when the prefills end). limit_bytes 0 turns it off."""

    def __init__(
        self,
        limit_bytes: int,
        min_interval_s: float = MIN_INTERVAL_S,
        check_interval_s: float = CHECK_INTERVAL_S,
    ):
        self.limit = limit_bytes
        self.min_interval_s = min_interval_s
        self.check_interval_s = check_interval_s
        self._last = -float("inf")
        self._last_check = -float("inf")
        self._prefilling = False
        self._libc = _glibc() if limit_bytes > 0 else None
        self.trims = 0
        """How many times free memory was handed back."""
        self.released_bytes = 0
        """Free heap bytes at those times (what the trims could give back)."""

    @property
    def active(self) -> bool:
        return self._libc is not None

    def free_bytes(self) -> int:
        """Bytes the allocator holds free in its heaps (0 where it cannot tell)."""
        return self._libc.mallinfo2().fordblks if self._libc is not None else 0

    def maybe_trim(self, prefilled: bool = False) -> bool:
        """After a step; prefilled: it ran prompt tokens. -> whether free heap went back."""
        prefills_ended, self._prefilling = self._prefilling and not prefilled, prefilled
        now = time.monotonic()
        if (
            self._libc is None
            or now - self._last < self.min_interval_s
            or (now - self._last_check < self.check_interval_s and not prefills_ended)
        ):
            return False
        self._last_check = now
        free = self.free_bytes()
        if free <= (min(self.limit, PREFILL_END_LIMIT) if prefills_ended else self.limit):
            return False
        self._libc.malloc_trim(0)
        self._last = now
        self.trims += 1
        self.released_bytes += free
        logger.debug("returned %d MiB of free heap to the system", free >> 20)
        return True
