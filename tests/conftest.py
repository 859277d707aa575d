"""Test-wide settings.

Many tests train small models in several threads or processes at once (client
threads of an in-memory federation, client processes of a real one). On a
2-core machine torch's default of one worker thread per core then
oversubscribes the CPU badly (seen: 1 s of work taking 30 s), so the suite
runs torch and OpenMP single-threaded, in this process and in the processes
it starts.

Constants and small classes that several test files share are in
tests/helpers.py, importable as ``helpers`` because this file puts tests/ on
``sys.path``; the shared fixtures are below.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

# --import-mode=importlib adds no test folder to sys.path: add this one for ``from helpers import ...``
sys.path.append(str(Path(__file__).resolve().parent))

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the edge profile has no torch; nothing to tune
    pass


import pytest  # noqa: E402


@pytest.fixture
def start_edge_clients():
    """Start one :class:`edge_sdk.client.EdgeClient` thread per client on an in-memory broker.

    ``start(broker, clients, fed, *, architecture, seed=0, max_idle_s=60)``
    returns ``(threads, edges)``; client ``i`` gets seed ``seed + i`` for its
    worker and its sketches, and waits up to 20 s for a model.
    """
    import threading

    from edge_sdk.client import EdgeClient
    from edge_sdk.transport import MemoryTransport
    from edge_sdk.worker import LocalWorker

    def start(broker, clients, fed, *, architecture, seed=0, max_idle_s=60):
        threads, edges = [], []
        for i, c in enumerate(clients):
            worker = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=architecture,
                                 seed=seed + i)
            ec = EdgeClient(MemoryTransport(broker, c.cid, federation=fed), worker, federation=fed, seed=seed + i,
                            model_timeout_s=20)
            th = threading.Thread(target=ec.run, kwargs={"max_idle_s": max_idle_s}, daemon=True)
            th.start()
            threads.append(th)
            edges.append(ec)
        return threads, edges

    return start


@pytest.fixture(scope="session")
def server_transport():
    """``make(broker, **kw)``: the server's :class:`edge_sdk.transport.MemoryTransport` on ``broker``.

    ``make`` returns ``MemoryTransport(broker, SERVER_ID, **kw)``, not yet
    connected; ``federation=`` and any other option go in ``kw``.
    """
    from edge_sdk.protocol import SERVER_ID
    from edge_sdk.transport import MemoryTransport

    def make(broker, **kw):
        return MemoryTransport(broker, SERVER_ID, **kw)

    return make


@pytest.fixture(scope="session")
def digits24():
    """scikit-learn's digits split among 24 clients in 4 rotation groups (seed 0), 6 per group; read only.

    The drift tests' fleet (:mod:`server_kit.data.drift`). Skips where torch is missing.
    """
    pytest.importorskip("torch")
    from server_kit.data.partition import load_digits_images, rotation_partition

    images, labels = load_digits_images()
    return rotation_partition(images, labels, 24, groups=4, seed=0)


@pytest.fixture(scope="session")
def digits12():
    """scikit-learn's digits split among 12 clients in 4 rotation groups (seed 0), built once per session.

    Client ``i`` holds a disjoint shard rotated by ``90 * (i mod 4)`` degrees
    (:func:`server_kit.data.partition.rotation_partition`); tests only read it.
    Skips where torch is missing: the tests using it train models.
    """
    pytest.importorskip("torch")
    from server_kit.data.partition import load_digits_images, rotation_partition

    images, labels = load_digits_images()
    return rotation_partition(images, labels, 12, groups=4, seed=0)


@pytest.fixture(scope="session")
def digits_by_class_sets():
    """Split scikit-learn's digits among devices by class sets, for the FedCRef tests.

    ``split(class_sets)`` returns one index array per set: each class's samples
    (shuffled with seed 0) are divided equally among the sets that hold it.
    Also returns the images and labels: ``(x, y, [idx, ...])``.
    """
    import numpy as np

    from server_kit.data.partition import load_digits_images

    def split(class_sets):
        x, y = load_digits_images()
        rng = np.random.default_rng(0)
        pools = {c: list(rng.permutation(np.flatnonzero(y == c))) for c in range(10)}
        holders = {c: sum(c in s for s in class_sets) for c in range(10)}
        parts = []
        for classes in class_sets:
            idx = []
            for c in classes:
                k = np.count_nonzero(y == c) // holders[c]
                idx += pools[c][:k]
                del pools[c][:k]
            parts.append(np.asarray(idx))
        return x, y, parts

    return split


@pytest.fixture(scope="session")
def shipped_acl():
    """``acl(federation)``: deploy/acl (written for the federation "default") for another federation."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "deploy" / "acl").read_text()
    assert "fedsketch/default/" in text

    def acl(federation: str) -> str:
        return text.replace("fedsketch/default/", f"fedsketch/{federation}/")

    return acl
