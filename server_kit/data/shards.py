"""Seeded index shards: which samples each client holds, drawn on arguments already checked.

The partitioners of :mod:`server_kit.data.partition` check their arguments
and call these; each returns one int64 index array per client.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["class_shards", "dirichlet_shards"]


def dirichlet_shards(y: np.ndarray, n_clients: int, alpha: float, min_size: int, max_tries: int,
                     seed: int) -> list[np.ndarray]:
    """The shards of :func:`server_kit.data.partition.dirichlet_indices`, on checked arguments."""
    if n_clients * min_size > len(y):
        raise ValueError(
            f"min_size={min_size} is infeasible: {n_clients} clients need "
            f"{n_clients * min_size} samples, there are {len(y)}"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(y)
    per_class = [np.flatnonzero(y == c) for c in classes]
    n_c = np.array([len(ix) for ix in per_class], dtype=np.int64)
    conc = np.full(n_clients, alpha)
    for _ in range(max_tries):
        props = rng.dirichlet(conc, size=len(classes))  # (classes, clients)
        if not np.all(np.isfinite(props)):
            continue
        cuts = np.floor(np.cumsum(props, axis=1) * n_c[:, None]).astype(np.int64)
        cuts = np.minimum(cuts, n_c[:, None])
        cuts[:, -1] = n_c
        counts = np.diff(cuts, axis=1, prepend=0)
        if counts.sum(axis=0).min() >= min_size:
            break
    else:
        raise ValueError(
            f"no Dirichlet(alpha={alpha}) draw in max_tries={max_tries} gave all {n_clients} "
            f"clients at least min_size={min_size} of {len(y)} samples; raise alpha, "
            "lower min_size or use fewer clients"
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for ix, cut in zip(per_class, cuts):
        for client, piece in enumerate(np.split(rng.permutation(ix), cut[:-1])):
            parts[client].append(piece)
    return [rng.permutation(np.concatenate(p)).astype(np.int64) for p in parts]


def class_shards(y: np.ndarray, n_cls: int, sets: Sequence[tuple[int, ...]], min_size: int,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """Client ``i`` holds the classes ``sets[i]``; each class's samples split evenly, at random, among its holders.

    Classes nobody holds are left out. Refused when a class has fewer
    samples than holders, or a client ends up below ``min_size``.
    """
    n_clients = len(sets)
    parts: list[list[np.ndarray]] = [[] for _ in range(n_clients)]
    for c in range(n_cls):
        holders = [i for i, s in enumerate(sets) if c in s]
        if not holders:
            continue
        ix = rng.permutation(np.flatnonzero(y == c))
        if len(ix) < len(holders):
            raise ValueError(
                f"class {c} has {len(ix)} samples for {len(holders)} clients holding it; "
                "lower n_clients or classes_per_client"
            )
        for i, piece in zip(holders, np.array_split(ix, len(holders))):
            parts[i].append(piece)
    shards = [rng.permutation(np.concatenate(p)).astype(np.int64) for p in parts]
    smallest = min(len(s) for s in shards)
    if smallest < min_size:
        raise ValueError(
            f"min_size={min_size}: some client gets only {smallest} samples; "
            "lower n_clients or raise classes_per_client"
        )
    return shards
