"""Logging that a client can set off: a line per event would let one client fill the log."""

from __future__ import annotations

import logging
import threading
import time

INTERVAL_S = 10.0
"""Each logger writes a rate-limited warning at most this often; the ones in between are counted."""

_lock = threading.Lock()
_last: dict[str, float] = {}
_skipped: dict[str, int] = {}


def warn_limited(logger: logging.Logger, message: str, *args, interval_s: float = INTERVAL_S) -> bool:
    """logger.warning(message, *args) unless this logger wrote one less than interval_s ago; the
    next line written says how many were left out. -> whether it was written."""
    now = time.monotonic()
    with _lock:
        if now - _last.get(logger.name, -float("inf")) < interval_s:
            _skipped[logger.name] = _skipped.get(logger.name, 0) + 1
            return False
        _last[logger.name] = now
        skipped = _skipped.pop(logger.name, 0)
    if skipped:
        message += f" ({skipped} more like it in the last {interval_s:.0f} s not logged)"
    logger.warning(message, *args)
    return True
