"""Thread pools whose threads carry their name into the OS (`/proc/PID/task/TID/comm`, `top -H`,
`py-spy`), so an operator or a soak test can tell a bounded pool from a leak.

CPython before 3.14 keeps `threading.Thread.name` to itself; every thread shows as `python`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from concurrent.futures import ThreadPoolExecutor

IO_THREADS = 4
"""The event loop's default executor (`asyncio.to_thread`): KV chunk reads and writes and block
digests. asyncio's own default grows to os.cpu_count() + 4, which on a large host is dozens of
threads for work bounded by the transfers in flight."""

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_set_name = getattr(_libc, "pthread_setname_np", None)
_self = getattr(_libc, "pthread_self", None)
if _self is not None:
    _self.restype = ctypes.c_void_p


def name_os_thread(name: str | None = None) -> None:
    """Give the calling thread its Python name (or `name`) in the OS, cut to Linux's 15 bytes."""
    if _set_name is None or _self is None:
        return
    raw = (name or threading.current_thread().name).encode("ascii", "replace")[:15]
    _set_name(ctypes.c_void_p(_self()), raw)


def named_pool(max_workers: int, prefix: str) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor whose threads show as `prefix_N` in the OS."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=prefix, initializer=name_os_thread)
