"""The paper's federation for experiments: each client holds a few classes, no sample shared."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["class_subset_partition"]


def class_subset_partition(
    labels: Any,
    n_clients: int,
    *,
    classes_per_client: tuple[int, int] = (2, 5),
    samples_per_class: int = 500,
    seed: int = 0,
    max_tries: int = 1000,
) -> list[tuple[np.ndarray, tuple[int, ...]]]:
    """The paper's federation: each client holds a few random classes, ``S`` samples of each, no overlap.

    Client ``i`` draws ``K_i`` uniformly in ``classes_per_client`` and then
    ``K_i`` distinct classes uniformly; it receives ``samples_per_class``
    samples of each, drawn without replacement from a shared pool, so no
    sample goes to two clients. Draws of class sets that need more samples of
    a class than exist are rejected and redrawn (at most ``max_tries``).

    Returns
    -------
    list of (index array, class tuple)
        Per client the indices into ``labels`` (class by class) and its classes.
    """
    y = np.asarray(labels).ravel()
    n = int(n_clients)
    lo, hi = (int(k) for k in classes_per_client)
    classes, counts = np.unique(y, return_counts=True)
    if n < 1 or lo < 1 or hi < lo or hi > len(classes):
        raise ValueError(
            f"need n_clients >= 1 and 1 <= classes_per_client[0] <= [1] <= {len(classes)} classes, "
            f"got {n_clients} and {classes_per_client}"
        )
    spc = int(samples_per_class)
    if spc < 1:
        raise ValueError(f"samples_per_class must be positive, got {samples_per_class}")
    rng = np.random.default_rng(seed)
    avail = dict(zip(classes.tolist(), counts.tolist()))
    for _ in range(int(max_tries)):
        sets = [tuple(sorted(rng.choice(classes, size=int(rng.integers(lo, hi + 1)), replace=False).tolist()))
                for _ in range(n)]
        holders: dict[int, int] = {}
        for s in sets:
            for c in s:
                holders[c] = holders.get(c, 0) + 1
        if all(holders[c] * spc <= avail[c] for c in holders):
            break
    else:
        raise ValueError(f"no draw of class sets fits {spc} samples per class in {max_tries} tries")
    pools = {c: rng.permutation(np.flatnonzero(y == c)).tolist() for c in holders}
    out = []
    for s in sets:
        idx = []
        for c in s:
            idx.extend(pools[c][:spc])
            del pools[c][:spc]
        out.append((np.asarray(idx, dtype=np.int64), s))
    return out
