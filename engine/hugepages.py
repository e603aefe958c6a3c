"""Host memory on 2 MiB pages for what a decode step reads every time: the weights and the KV cache.

A decode step streams the weights and gathers cache blocks from all over the cache. On 4 KiB
pages every page of that is a TLB miss, and the hardware prefetchers stop at each page's end.
Linux backs anonymous memory with transparent huge pages only where the region asks for them
(madvise(MADV_HUGEPAGE)) when /sys/kernel/mm/transparent_hugepage/enabled is "madvise", the
common default; so the weights, each its own malloc (most under 2 MiB), and the cache sat on 4 KiB
pages. Measured on the bench model in bf16 (2-core Xeon, THP "madvise"), six interleaved rounds
each: batch-1 engine steps a median 5.01 ms with the weights and cache on huge pages, 5.59 without.

`huge_empty` asks for huge pages before a region is first touched (the kernel then faults it in
2 MiB at a time); `WeightArena` packs many tensors into such regions, in the order they are
placed (a layer's weights lie together, in the order a step reads them). Where huge pages are
off, not Linux, or not CPU memory, both still work, on whatever pages the system gives.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
import sys

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault a range in, writable, now (as a write to each page would)."""
ALIGN = 64
"""Each tensor in an arena starts on a cache line."""
REGION_BYTES = 64 << 20
"""An arena's regions hold at least this much (a larger tensor gets a region of its own size)."""


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        return libc.madvise
    except (OSError, AttributeError):
        return None


_MADVISE = _madvise()
refused_errno = 0
"""The errno of the last madvise(MADV_HUGEPAGE) the kernel refused (0: none yet), for diagnosis."""


def _span(nbytes: int) -> int:
    return math.ceil(nbytes / HUGE_PAGE) * HUGE_PAGE


def _advised(raw: torch.Tensor, nbytes: int) -> torch.Tensor:
    """nbytes of raw (uint8, untouched, at least a huge page longer) from its first 2 MiB boundary,
    the kernel asked for huge pages over them (where it refuses, THP compiled out: 4 KiB pages)."""
    span = _span(nbytes)
    offset = -raw.data_ptr() % HUGE_PAGE
    region = raw[offset : offset + span]
    if span and _MADVISE is not None and _MADVISE(region.data_ptr(), span, MADV_HUGEPAGE) != 0:
        global refused_errno
        refused_errno = ctypes.get_errno()
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", refused_errno)
    return region[:nbytes]


def huge_empty(nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An uninitialised uint8 tensor of nbytes, on CPU starting on a 2 MiB boundary with the
    kernel asked to back it with huge pages (MADV_HUGEPAGE) before anything touches it."""
    device = torch.device(device)
    if device.type != "cpu" or _MADVISE is None or nbytes < HUGE_PAGE:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    raw = torch.empty(_span(nbytes) + HUGE_PAGE, dtype=torch.uint8)  # large: malloc maps it fresh, untouched
    return _advised(raw, nbytes)


def huge_zeros(nbytes: int, device: torch.device | str = "cpu", prefault: bool = False) -> torch.Tensor:
    """A zeroed uint8 tensor of nbytes whose memory becomes resident only where it is written: on
    CPU an anonymous mapping of its own (zero-filled by the kernel, never a reused heap chunk),
    from a 2 MiB boundary and advised for huge pages before anything touches it, so each 2 MiB
    comes in whole at its first write. The KV cache: sized for the most sequences the engine may
    run, it costs memory for the blocks that have held KV (reads of the others see zeros).
    prefault: resident whole now instead (`populate`)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    # Private: a shared anonymous mapping (mmap's default) is shmem, which gets no huge pages
    # where /sys/kernel/mm/transparent_hugepage/shmem_enabled is "never", the default.
    mapping = mmap.mmap(-1, _span(nbytes) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping
    zeros = _advised(raw, nbytes)
    if prefault:
        populate(zeros)
    return zeros


def populate(zeros: torch.Tensor) -> None:
    """Fault every page of `zeros` (a CPU uint8 tensor of zeros, as huge_zeros gives) in now, on
    huge pages where advised: madvise(MADV_POPULATE_WRITE), or a zero written to each 4 KiB page
    where the kernel predates it. A server's KV cache, as vLLM's and llama.cpp's are: its first
    write to each page otherwise lands in the middle of serving (a prompt's KV arriving, a decode
    step), and costs most where a VM's host backs guest memory only on first use (6 ms/MB on the
    2-core EPYC VM, against 0.06 once backed); and memory the machine lacks fails at start, not
    mid-request."""
    nbytes = zeros.numel()
    if nbytes == 0:
        return
    if _MADVISE is not None and _MADVISE(zeros.data_ptr(), nbytes, MADV_POPULATE_WRITE) == 0:
        return
    zeros[::4096] = 0  # a write faults each page in (a whole 2 MiB one where advised)


class WeightArena:
    """Places tensors one after another in huge-page regions (`huge_empty`); a placed tensor is
    a contiguous view that keeps its region alive. Regions are never freed or reused: for
    weights, placed once at load."""

    def __init__(self, region_bytes: int = REGION_BYTES):
        self.region_bytes = region_bytes
        self._region: torch.Tensor | None = None
        self._used = 0
        self.placed_bytes = 0
        """Bytes of all tensors placed (their sizes, without alignment)."""
        self.reserved_bytes = 0
        """Bytes of all regions taken."""

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor in the arena."""
        nbytes = math.prod(shape) * dtype.itemsize
        start = -(-self._used // ALIGN) * ALIGN
        if self._region is None or start + nbytes > self._region.numel():
            self._region = huge_empty(max(nbytes, self.region_bytes))
            self.reserved_bytes += self._region.numel()
            start = 0
        self._used = start + nbytes
        self.placed_bytes += nbytes
        return self._region[start : start + nbytes].view(dtype).view(shape)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of t in the arena (t itself where it is not CPU memory)."""
        if t.device.type != "cpu":
            return t
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out


def place_parameters(model: nn.Module, arena: WeightArena, values: bool = True) -> None:
    """Moves every parameter and buffer of model into the arena, parameters in the order the
    modules register them (a layer's together), keeping their Parameter objects (a parameter or
    buffer shared by two modules is moved once). Buffers keep their values; parameters too, or
    with values=False are left uninitialised, for a loader to fill in place (the weights are
    then never in memory twice)."""
    for p in model.parameters():  # each once
        p.data = arena.place(p.data) if values else arena.empty(p.shape, p.dtype)
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (the buffer, its copy)
    for module in model.modules():
        for name, b in module.named_buffers(recurse=False):
            if b is not None:
                if id(b) not in buffers:
                    buffers[id(b)] = (b, arena.place(b))  # b kept: its id stays its own
                module._buffers[name] = buffers[id(b)][1]
