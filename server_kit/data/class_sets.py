"""Class-set groups (the OCFL splits): the named sets and shares, and which samples of each class go where.

Zuziak et al. (2024) give each group of clients its own set of classes.
:func:`server_kit.data.partition.class_set_groups` checks its arguments and
calls :func:`class_set_shards` here, which counts the samples of each class
per client (:func:`split_class_counts` or :func:`fixed_class_counts`) and
deals them out (:func:`deal_class_counts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "OCFL_CLASS_SETS",
    "OCFL_IMBALANCED_SHARES",
    "OCFL_OVERLAPPING_CLASS_SETS",
    "OCFL_SPLITS",
    "class_set_shards",
    "deal_class_counts",
    "fixed_class_counts",
    "largest_remainder",
    "shares_to_sizes",
    "split_class_counts",
]

#: Class sets of the OCFL paper's three groups (Zuziak et al., 2024, Section IV-A).
OCFL_CLASS_SETS: tuple[tuple[int, ...], ...] = ((0, 1, 2, 3), (4, 5, 6), (7, 8, 9))

#: The overlapping variant. The paper only says that "the clients partially
#: share some of the classes"; these are the sets of the authors' published data
#: configurations (``ocfl-demo/datasets/data_configs.py`` of
#: ``MKZuziak/OCFL_IEEE_BigData2024``): each pair of groups shares classes
#: (groups 0 and 1 share 8 and 9, groups 0 and 2 share 0 to 3, groups 1 and 2
#: share 4 and 5), and no group holds all ten.
OCFL_OVERLAPPING_CLASS_SETS: tuple[tuple[int, ...], ...] = (
    (0, 1, 2, 3, 8, 9), (4, 5, 6, 7, 8, 9), (0, 1, 2, 3, 4, 5))

#: Shares of the clients per group in the imbalanced splits (the paper: 20 %, about 47 % and 33 %).
OCFL_IMBALANCED_SHARES: tuple[float, ...] = (0.20, 0.47, 0.33)

#: The paper's four splits by name: keyword arguments of
#: :func:`~server_kit.data.partition.class_set_groups`.
#: Imbalanced means both uneven groups and Dirichlet(1) label skew inside each client.
OCFL_SPLITS: dict[str, dict[str, Any]] = {
    "nonoverlap_balanced": {"overlapping": False, "group_shares": None, "alpha": None},
    "nonoverlap_imbalanced": {"overlapping": False, "group_shares": OCFL_IMBALANCED_SHARES, "alpha": 1.0},
    "overlap_balanced": {"overlapping": True, "group_shares": None, "alpha": None},
    "overlap_imbalanced": {"overlapping": True, "group_shares": OCFL_IMBALANCED_SHARES, "alpha": 1.0},
}


def shares_to_sizes(n_clients: int, shares: Sequence[float]) -> list[int]:
    """The sizes of :func:`server_kit.data.partition.group_sizes_from_shares`, for a checked ``n_clients``."""
    try:
        w = np.asarray(shares, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"group_shares must be a sequence of numbers, got {shares!r}") from None
    if w.ndim != 1 or w.size == 0:
        raise ValueError(f"group_shares must be a non-empty 1-D sequence, got {shares!r}")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"group_shares must be positive finite numbers, got {shares!r}")
    if abs(w.sum() - 1.0) > 1e-6:
        raise ValueError(f"group_shares must sum to 1, got {shares!r} (sum {w.sum():.6g})")
    raw = w * n_clients
    sizes = np.floor(raw + 1e-9).astype(np.int64)
    left = n_clients - int(sizes.sum())
    if left > 0:
        order = np.argsort(-(raw - sizes), kind="stable")
        sizes[order[:left]] += 1
    if sizes.min() < 1:
        raise ValueError(
            f"n_clients={n_clients} is too few for group_shares={tuple(float(v) for v in w)}: "
            f"group sizes {sizes.tolist()} leave a group empty"
        )
    return [int(v) for v in sizes]


def largest_remainder(total: int, props: np.ndarray) -> np.ndarray:
    """Integer counts summing to ``total``, proportional to ``props`` (which sum to 1)."""
    raw = props * total
    counts = np.floor(raw).astype(np.int64)
    left = total - int(counts.sum())
    if left > 0:
        counts[np.argsort(-(raw - counts), kind="stable")[:left]] += 1
    return counts


def class_set_shards(y: np.ndarray, n_cls: int, sets: Sequence[tuple[int, ...]], assign: np.ndarray, *,
                     alpha: float | None, samples_per_client: int | None, min_size: int,
                     seed: int) -> list[np.ndarray]:
    """The shards of :func:`server_kit.data.partition.class_set_groups`, on checked arguments.

    Client ``i`` holds the classes of ``sets[assign[i]]``. Refused when a class
    of ``sets`` has no samples.
    """
    per_class = [np.flatnonzero(y == c) for c in range(n_cls)]
    for c in sorted({c for s in sets for c in s}):
        if len(per_class[c]) == 0:
            raise ValueError(f"class {c} of class_sets has no samples")
    rng = np.random.default_rng(seed)
    client_sets = [sets[g] for g in assign]
    if samples_per_client is None:
        counts = split_class_counts(per_class, client_sets, alpha, min_size, rng)
    else:
        counts = fixed_class_counts(per_class, client_sets, alpha, samples_per_client, rng)
    return deal_class_counts(per_class, counts, rng)


def split_class_counts(per_class: Sequence[np.ndarray], client_sets: Sequence[tuple[int, ...]],
                       alpha: float | None, min_size: int, rng: np.random.Generator) -> np.ndarray:
    """``(classes, clients)`` counts that deal every sample of a class out to the clients holding it.

    Evenly (``alpha`` None; a class's remainder goes to different clients for
    different classes) or by Dirichlet(alpha) proportions drawn per class over
    its holders, redrawn at most 1000 times until every client has
    ``min_size`` samples.
    """
    n_cls, n_clients = len(per_class), len(client_sets)
    counts = np.zeros((n_cls, n_clients), dtype=np.int64)  # samples of class c for client i
    holders = [[i for i in range(n_clients) if c in client_sets[i]] for c in range(n_cls)]
    for _ in range(1000):
        for c, hs in enumerate(holders):
            if not hs:
                continue
            n_c = len(per_class[c])
            if alpha is None:
                # the remainder goes to different holders for different classes
                counts[c, hs] = n_c // len(hs) + ((np.arange(len(hs)) - c) % len(hs) < n_c % len(hs))
            else:
                cuts = np.floor(np.cumsum(rng.dirichlet(np.full(len(hs), alpha))) * n_c).astype(np.int64)
                cuts[-1] = n_c
                counts[c, hs] = np.diff(cuts, prepend=0)
        if counts.sum(axis=0).min() >= min_size or alpha is None:
            break
    smallest = int(counts.sum(axis=0).min())
    if smallest < min_size:
        more = "" if alpha is None else " in 1000 Dirichlet draws"
        raise ValueError(f"min_size={min_size}: some client gets only {smallest} samples{more}; "
                         "use fewer clients, a larger alpha or a lower min_size")
    return counts


def fixed_class_counts(per_class: Sequence[np.ndarray], client_sets: Sequence[tuple[int, ...]],
                       alpha: float | None, samples_per_client: int, rng: np.random.Generator) -> np.ndarray:
    """``(classes, clients)`` counts of exactly ``samples_per_client`` per client, over its set.

    Proportions uniform over the set (``alpha`` None) or drawn from
    Dirichlet(alpha); refused when the clients need more of a class than
    there is.
    """
    n_cls, n_clients = len(per_class), len(client_sets)
    counts = np.zeros((n_cls, n_clients), dtype=np.int64)  # samples of class c for client i
    for i in range(n_clients):
        cs = np.array(client_sets[i])
        props = np.full(len(cs), 1.0 / len(cs)) if alpha is None else rng.dirichlet(np.full(len(cs), alpha))
        counts[cs, i] = largest_remainder(samples_per_client, props)
    need = counts.sum(axis=1)
    short = [c for c in range(n_cls) if need[c] > len(per_class[c])]
    if short:
        c = short[0]
        raise ValueError(
            f"samples_per_client={samples_per_client}: the clients holding class {c} need "
            f"{int(need[c])} of its samples, there are {len(per_class[c])}; "
            "lower samples_per_client or n_clients"
        )
    return counts


def deal_class_counts(per_class: Sequence[np.ndarray], counts: np.ndarray,
                      rng: np.random.Generator) -> list[np.ndarray]:
    """Each client's shard: ``counts[c, i]`` samples of class ``c`` for client ``i``, without replacement."""
    parts: list[list[np.ndarray]] = [[] for _ in range(counts.shape[1])]
    for c in range(len(per_class)):
        if not counts[c].any():
            continue
        pool = rng.permutation(per_class[c])
        cuts = np.cumsum(counts[c])
        for i, piece in enumerate(np.split(pool[: cuts[-1]], cuts[:-1])):
            if len(piece):
                parts[i].append(piece)
    return [rng.permutation(np.concatenate(p)).astype(np.int64) for p in parts]
