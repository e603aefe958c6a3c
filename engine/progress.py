"""Progress lines for start-up work that can take a while (reading a checkpoint): a cold start says
what it is doing instead of going quiet for minutes."""

from __future__ import annotations

import logging
import time


class Progress:
    """Logs `what` with how much of `total` bytes is done, at most every `every_s` seconds and
    only once the work has taken that long (a small model's load stays one line: `done`'s)."""

    def __init__(self, logger: logging.Logger, what: str, total: int, every_s: float = 5.0):
        self.logger, self.what, self.total, self.every_s = logger, what, max(total, 1), every_s
        self.start = self.last = time.monotonic()
        self.count = 0

    def advance(self, nbytes: int) -> None:
        self.count += nbytes
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.logger.info(
                "%s: %s of %s (%d%%), %.0f s",
                self.what,
                size(self.count),
                size(self.total),
                100 * self.count // self.total,
                now - self.start,
            )

    def done(self) -> None:
        self.logger.info("%s: %s in %.1f s", self.what, size(self.count), time.monotonic() - self.start)


def size(nbytes: int) -> str:
    """Bytes for a reader: GB from 0.1 GB, MB below."""
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 10**8 else f"{nbytes / 1e6:.1f} MB"
