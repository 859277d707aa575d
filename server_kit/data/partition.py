"""Federated partitions with ground-truth groups, for the demo, tests and benchmarks.

Every partitioner returns :class:`ClientData` records that carry the group a
client really belongs to, so a clustering can be scored (adjusted Rand index).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["ClientData", "load_digits_images", "rotation_partition", "save_client", "load_client"]


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
