"""The thread pools of the processes the server starts: each sized to its share of the cores.

numpy's BLAS (OpenBLAS, MKL), OpenMP and torch each start one thread per
core in every process that loads them. A server with W ingest workers on a
16-core machine then runs (W + 1) x 16 pool threads that spin against each
other: measured there, a worker spent 2.8-3.3 CPU-seconds on one 46.8 MB
update with 16 threads and 0.51 with 2. So every process the server starts
sizes its pools once, at its start (:func:`limit_threads`, with
``threadpoolctl`` for the BLAS and OpenMP pools and ``torch.set_num_threads``
where torch is loaded), to the share :func:`plan` gives it:

- **the coordinator** (``fedsketch-server``): the cores the workers do not take;
- **an ingest worker or a site aggregator**: ``cores // (W + 1)``, at most
  :data:`STREAM_THREADS`. Its work is decoding, a norm and weighted sums over
  the update's bytes, bound by memory bandwidth: past two threads the pools
  only spin;
- **an emulator or simulator child process**: one thread (it runs hundreds of
  small devices whose steps are interleaved on its own threads).

``--worker-threads N`` overrides the workers' share; the coordinator then takes what they leave.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from enum import Enum

__all__ = ["STREAM_THREADS", "Role", "ThreadShare", "available_cores", "limit_threads", "plan"]

log = logging.getLogger(__name__)

#: The most pool threads an ingest worker or a site aggregator takes (memory-bound work: see the module docstring).
STREAM_THREADS = 2


class Role(Enum):
    """What a process does, which decides its share of the cores."""

    COORDINATOR = "coordinator"
    INGEST_WORKER = "ingest worker"
    SITE_AGGREGATOR = "site aggregator"
    EMULATOR = "emulator"


@dataclass(frozen=True)
class ThreadShare:
    """The pool threads one process takes, and why."""

    role: Role
    threads: int
    #: The cores this process may run on (its affinity).
    cores: int
    #: Where the count came from: "share" (the rule above) or the option that set it.
    source: str = "share"

    def describe(self) -> str:
        """One line for the log: ``ingest worker: 2 threads (its share of 16 cores)``."""
        why = f"its share of {self.cores} cores" if self.source == "share" else f"{self.source}; {self.cores} cores"
        return f"{self.role.value}: {self.threads} thread{'s' if self.threads != 1 else ''} ({why})"


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, so a container's or a taskset's limit counts)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS, Windows
        return max(1, os.cpu_count() or 1)


def plan(role: Role, *, workers: int = 0, override: int | None = None, cores: int | None = None) -> ThreadShare:
    """The share of ``role`` beside ``workers`` ingest workers (see the module docstring).

    ``override``: ``--worker-threads N`` (the workers' and site aggregators' threads; the coordinator's are the
    cores they leave). ValueError for an override that is not a positive integer or ``workers`` below 0.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"workers must be an integer >= 0, got {workers!r}")
    if override is not None and (isinstance(override, bool) or not isinstance(override, int) or override < 1):
        raise ValueError(f"--worker-threads must be a positive integer, got {override!r}")
    n = available_cores() if cores is None else int(cores)
    stream = override if override is not None else max(1, min(STREAM_THREADS, n // (workers + 1)))
    source = "share" if override is None else f"--worker-threads {override}"
    if role is Role.EMULATOR:
        return ThreadShare(role, 1, n)
    if role is Role.COORDINATOR:
        return ThreadShare(role, max(1, n - workers * stream), n, source)
    return ThreadShare(role, stream, n, source)


def limit_threads(share: ThreadShare, level: int = logging.INFO) -> ThreadShare:
    """Size this process's BLAS, OpenMP and torch pools to ``share.threads`` (for the rest of its life);
    logs what it chose (at ``level``) and returns ``share``."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=share.threads)  # the pools loaded now; not a context: it holds
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(share.threads)
    log.log(level, "thread pools: %s", share.describe())
    return share
