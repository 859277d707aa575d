"""OrderedPool: a few worker threads running jobs in order per lane (one lane per transport), lanes in parallel."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

__all__ = ["Lane", "OrderedPool"]

log = logging.getLogger(__name__)

#: Jobs a worker runs from one lane before it lets other lanes have a turn.
_LANE_BATCH = 16


class Lane:
    """One transport's queue of jobs in the pool: run one at a time, in order."""

    __slots__ = ("jobs", "scheduled", "name")

    def __init__(self, name: str) -> None:
        self.jobs: deque[Callable[[], None]] = deque()
        self.scheduled = False
        self.name = name

    def __repr__(self) -> str:
        return f"Lane({self.name!r}, {len(self.jobs)} waiting)"


class OrderedPool:
    """A few worker threads running jobs in order per lane, lanes in parallel.

    ``submit(lane, job)`` never blocks. The jobs of one lane run one after the
    other, in submission order, on whichever worker is free; a busy lane
    yields to the others every few jobs. A job's exception is logged and
    counted, never raised.

    Parameters
    ----------
    workers : int
        Threads (they run Python: with the GIL, two to four are plenty).
    name : str
        Prefix of the threads' names.
    """

    def __init__(self, workers: int = 2, *, name: str = "fedsketch-pool") -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.workers = workers
        self.name = name
        self._lock = threading.Lock()
        self._ready: deque[Lane | None] = deque()
        self._cv = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._closed = False
        #: Jobs that raised, since creation.
        self.errors = 0
        #: Jobs run, since creation.
        self.done = 0

    def __repr__(self) -> str:
        return f"OrderedPool(workers={self.workers}, name={self.name!r}, running={bool(self._threads)})"

    def lane(self, name: str = "") -> Lane:
        """A new lane (one per transport, or per device)."""
        return Lane(name)

    def start(self) -> OrderedPool:
        with self._lock:
            if self._threads or self._closed:
                return self
            for i in range(self.workers):
                th = threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                self._threads.append(th)
        for th in self._threads:
            th.start()
        return self

    def submit(self, lane: Lane, job: Callable[[], None]) -> None:
        """Queue ``job()`` on ``lane`` (thread-safe, never blocks)."""
        with self._lock:
            if self._closed:
                return
            lane.jobs.append(job)
            if lane.scheduled:
                return
            lane.scheduled = True
            self._ready.append(lane)
            self._cv.notify()
        if not self._threads:
            self.start()

    def backlog(self) -> int:
        """Lanes waiting for a worker."""
        return len(self._ready)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._ready:
                    self._cv.wait()
                lane = self._ready.popleft()
            if lane is None:
                return
            for _ in range(_LANE_BATCH):
                with self._lock:
                    if not lane.jobs:
                        lane.scheduled = False
                        break
                    job = lane.jobs.popleft()
                try:
                    job()
                except Exception:
                    self.errors += 1
                    log.exception("job on lane %s failed", lane.name)
                self.done += 1
            else:  # more may wait: back of the line, so that other lanes get their turn
                with self._lock:
                    self._ready.append(lane)
                    self._cv.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers once the jobs already queued ran (up to ``timeout`` s)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for _ in self._threads:
                self._ready.append(None)
            self._cv.notify_all()
        deadline = time.monotonic() + timeout
        for th in self._threads:
            if th is not threading.current_thread():
                th.join(max(0.0, deadline - time.monotonic()))

