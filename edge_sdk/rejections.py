"""Counting refused messages without letting a hostile peer flood the logs.

A device that sends 10,000 malformed messages must not write 10,000 log
lines (nor tracebacks) on the server. :class:`RejectionLog` counts every
rejection by reason and logs at most one line per (sender, reason) per
interval; the next line says how many were not logged in between.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from .protocol.chunks import BUSY

__all__ = ["RejectionLog"]


class RejectionLog:
    """Counts rejections per reason; logs once per (sender, reason) per ``interval_s``.

    Parameters
    ----------
    logger : logging.Logger
        Where the lines go: at WARNING, but at INFO for ``busy`` (a transfer
        that waits its turn: back-pressure, not a fault).
    interval_s : float
        Shortest time between two lines for the same sender and reason.
    max_keys : int
        Most (sender, reason) pairs remembered; beyond it the oldest are
        forgotten (a flood of forged sender ids cannot grow memory).
    clock : callable
        Monotonic time source, replaceable in tests.
    """

    def __init__(self, logger: logging.Logger, *, interval_s: float = 10.0, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not interval_s >= 0 or max_keys < 1:
            raise ValueError(f"interval_s must be >= 0 and max_keys >= 1, got {interval_s!r} and {max_keys!r}")
        self.logger = logger
        self.interval_s = float(interval_s)
        self.max_keys = int(max_keys)
        self.clock = clock
        #: Rejections per reason since creation.
        self.counts: dict[str, int] = {}
        self._last: dict[tuple[str, str], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def __call__(self, reason: str, sender: str, detail: str) -> None:
        """Count one rejection; log it unless the same sender and reason were logged lately."""
        now = self.clock()
        key = (str(sender)[:64], str(reason)[:64])
        with self._lock:
            self.counts[key[1]] = self.counts.get(key[1], 0) + 1
            last = self._last.get(key)
            if last is not None and now - last[0] < self.interval_s:
                self._last[key] = (last[0], last[1] + 1)
                return
            suppressed = last[1] if last is not None else 0
            self._last.pop(key, None)
            self._last[key] = (now, 0)
            while len(self._last) > self.max_keys:
                self._last.pop(next(iter(self._last)))
        more = f" ({suppressed} more from {key[0]} not logged)" if suppressed else ""
        level = logging.INFO if key[1] == BUSY else logging.WARNING
        self.logger.log(level, "rejected (%s) from %s: %s%s", key[1], key[0], detail[:300], more)

    def snapshot(self) -> dict[str, int]:
        """A copy of the counts per reason."""
        with self._lock:
            return dict(self.counts)
