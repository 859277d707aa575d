"""Each process the server starts sizes its thread pools to its share of the cores (server_kit.cores)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from server_kit.cores import STREAM_THREADS, Role, plan


@pytest.mark.parametrize("workers, cores, worker, coordinator", [
    (0, 16, 2, 16), (1, 16, 2, 14), (2, 16, 2, 12), (4, 16, 2, 8), (8, 16, 1, 8), (15, 16, 1, 1),
    (1, 2, 1, 1), (3, 2, 1, 1), (4, 4, 1, 1), (2, 8, 2, 4),
])
def test_workers_take_their_share_at_most_two_and_the_coordinator_what_they_leave(workers, cores, worker,
                                                                                  coordinator):
    assert plan(Role.INGEST_WORKER, workers=workers, cores=cores).threads == worker <= STREAM_THREADS
    assert plan(Role.COORDINATOR, workers=workers, cores=cores).threads == coordinator
    assert plan(Role.EMULATOR, cores=cores).threads == 1


def test_an_override_sets_the_workers_threads_and_says_so():
    share = plan(Role.INGEST_WORKER, workers=4, override=3, cores=16)
    assert share.threads == 3 and share.describe() == "ingest worker: 3 threads (--worker-threads 3; 16 cores)"
    assert plan(Role.COORDINATOR, workers=4, override=3, cores=16).threads == 4
    assert plan(Role.SITE_AGGREGATOR, cores=16).describe() == "site aggregator: 2 threads (its share of 16 cores)"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="--worker-threads must be a positive integer"):
            plan(Role.INGEST_WORKER, workers=1, override=bad)


def test_limit_threads_sizes_the_blas_pool_of_the_process():
    code = ("import logging, numpy; logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "from threadpoolctl import threadpool_info\n"
            "from server_kit.cores import Role, ThreadShare, limit_threads\n"
            "limit_threads(ThreadShare(Role.INGEST_WORKER, 1, 8))\n"
            "print(sorted({i['num_threads'] for i in threadpool_info()}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"OMP_NUM_THREADS": "4", "OPENBLAS_NUM_THREADS": "4", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1]"
    assert "thread pools: ingest worker: 1 thread (its share of 8 cores)" in out.stderr
