"""A client's data: its record (:class:`ClientData`), its ``.npz`` file, and building records from index shards.

The partitioners of :mod:`server_kit.data.partition` decide which samples
each client holds; :func:`build_clients` turns those index shards into
records (transformed by group, test part split off) and :func:`tally_clients`
counts them. :func:`rotation_partition` is the original demo split, with its
own simple checks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

__all__ = [
    "ClientData",
    "build_clients",
    "client_ids",
    "load_client",
    "load_digits_images",
    "rotation_partition",
    "save_client",
    "tally_clients",
]


@dataclass(frozen=True)
class ClientData:
    """One client's local train/test split and its true group."""

    cid: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    group: int


def load_digits_images() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1,797 digits as float32 (N, 8, 8) in [0, 1] and int64 labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)


def rotation_partition(
    images: np.ndarray,
    labels: np.ndarray,
    n_clients: int,
    *,
    groups: int = 4,
    test_fraction: float = 0.2,
    seed: int = 0,
    prefix: str = "c",
) -> list[ClientData]:
    """Split into ``n_clients`` disjoint shards; client ``i`` is rotated by ``90 * (i mod groups)`` degrees.

    Train and test samples of a client are rotated alike. Client ids are
    ``f"{prefix}{i:02d}"``.
    """
    if n_clients < 1:
        raise ValueError(f"n_clients must be positive, got {n_clients}")
    if not 1 <= groups <= 4:
        raise ValueError(f"groups must be between 1 and 4 rotations, got {groups}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if len(images) < 2 * n_clients:
        raise ValueError(f"{len(images)} samples are too few for {n_clients} clients")
    order = np.random.default_rng(seed).permutation(len(images))
    out = []
    for i, shard in enumerate(np.array_split(order, n_clients)):
        g = i % groups
        x = np.rot90(images[shard], k=g, axes=(1, 2)).copy()
        y = labels[shard]
        n_test = int(round(test_fraction * len(shard)))
        out.append(ClientData(f"{prefix}{i:02d}", x[n_test:], y[n_test:], x[:n_test], y[:n_test], g))
    return out


def save_client(path, data: ClientData) -> None:
    """Write a client's data as an ``.npz`` (plain arrays, readable without pickle)."""
    np.savez(path, x=data.x_train, y=data.y_train, x_test=data.x_test, y_test=data.y_test,
             group=np.int64(data.group), cid=np.array(data.cid))


def load_client(path) -> ClientData:
    """Read what :func:`save_client` wrote (``allow_pickle=False``)."""
    with np.load(path, allow_pickle=False) as f:
        return ClientData(str(f["cid"]), f["x"], f["y"], f["x_test"], f["y_test"], int(f["group"]))


def client_ids(prefix: str, n_clients: int) -> list[str]:
    """``f"{prefix}{i:02d}"`` for each client (``:03d`` from 100 clients)."""
    width = 3 if n_clients >= 100 else 2
    return [f"{prefix}{i:0{width}d}" for i in range(n_clients)]


def build_clients(
    images: np.ndarray,
    labels: np.ndarray,
    shards: list[np.ndarray],
    groups: np.ndarray,
    transform: Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]],
    test_fraction: float,
    prefix: str,
) -> list[ClientData]:
    """Clients from index shards: transform by group, then split off the test part."""
    out = []
    for cid, shard, g in zip(client_ids(prefix, len(shards)), shards, groups):
        x, y = transform(images[shard], labels[shard], int(g))
        n_test = min(int(round(test_fraction * len(shard))), len(shard) - 1)
        out.append(ClientData(cid, x[n_test:], y[n_test:], x[:n_test], y[:n_test], int(g)))
    return out


def tally_clients(clients: Sequence[ClientData], num_classes: int) -> dict[str, Any]:
    """The tally of :func:`server_kit.data.partition.summarize`, for labels below ``num_classes``."""
    group_counts: dict[int, int] = {}
    rows = []
    for c in clients:
        group_counts[int(c.group)] = group_counts.get(int(c.group), 0) + 1
        train = np.bincount(np.asarray(c.y_train, dtype=np.int64), minlength=num_classes)
        test = np.bincount(np.asarray(c.y_test, dtype=np.int64), minlength=num_classes)
        if len(train) > num_classes or len(test) > num_classes:
            raise ValueError(f"client {c.cid} has labels >= num_classes={num_classes}")
        hist = train + test
        rows.append({
            "cid": c.cid,
            "group": int(c.group),
            "n_train": len(c.y_train),
            "n_test": len(c.y_test),
            "label_hist": [int(v) for v in hist],
            "train_hist": [int(v) for v in train],
            "classes": [int(v) for v in np.flatnonzero(hist)],
        })
    return {
        "n_clients": len(clients),
        "n_groups": len(group_counts),
        "num_classes": num_classes,
        "n_samples": sum(r["n_train"] + r["n_test"] for r in rows),
        "group_counts": dict(sorted(group_counts.items())),
        "clients": rows,
    }
