"""Federated partitions with ground-truth groups, for the demo, tests and benchmarks.

Every partitioner returns :class:`ClientData` records that carry the group a
client really belongs to, so a clustering can be scored (adjusted Rand index).

Partitioners (all seeded, all with a per-client train/test split that gets the
same transformation as the train split):

- :func:`rotation_groups`: client ``i`` rotated by ``90 * group`` degrees, with
  equal random shards or Dirichlet label skew (the paper's MNIST scenario is
  ``rotation_groups(x, y, 100, alpha=10)``: 4 groups, >= 10 samples each);
- :func:`label_flip_groups`: group ``k`` maps ``y -> (y - k) mod C``;
- :func:`pathological_partition`: each client holds only a few classes;
- :func:`class_set_groups`: the OCFL paper's splits (Zuziak et al., 2024):
  groups of clients that hold different (or partly shared) sets of classes,
  balanced or imbalanced (:data:`OCFL_SPLITS` names the four);
- :func:`dirichlet_indices`: the label-skewed index shards on their own.

Clients go to groups by ``i mod groups``, or in contiguous blocks of the given
``group_sizes`` (:func:`group_assignment`). :func:`summarize` tallies a
partition (per-group client counts, per-client label histograms).

This module checks every partitioner's arguments; the seeded draws they
make live in :mod:`server_kit.data.shards` and :mod:`server_kit.data.class_sets`
(with the OCFL sets), the client records and their files in
:mod:`server_kit.data.clients`. All of those names are importable from here.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from server_kit.data.class_sets import (
    OCFL_CLASS_SETS,
    OCFL_IMBALANCED_SHARES,
    OCFL_OVERLAPPING_CLASS_SETS,
    OCFL_SPLITS,
    class_set_shards,
    shares_to_sizes,
)
from server_kit.data.clients import (
    ClientData,
    build_clients,
    load_client,
    load_digits_images,
    rotation_partition,
    save_client,
    tally_clients,
)
from server_kit.data.shards import class_shards, dirichlet_shards

__all__ = [
    "ClientData",
    "OCFL_CLASS_SETS",
    "OCFL_IMBALANCED_SHARES",
    "OCFL_OVERLAPPING_CLASS_SETS",
    "OCFL_SPLITS",
    "class_set_groups",
    "dirichlet_indices",
    "group_assignment",
    "group_sizes_from_shares",
    "label_flip_groups",
    "load_client",
    "load_digits_images",
    "pathological_partition",
    "rotation_groups",
    "rotation_partition",
    "save_client",
    "summarize",
]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise ValueError(f"alpha must be a positive number, got {alpha!r}")
    if not np.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"alpha must be a positive finite number, got {alpha}")
    return float(alpha)


def _check_test_fraction(test_fraction: Any) -> float:
    if isinstance(test_fraction, bool) or not isinstance(test_fraction, numbers.Real) or not (
        0.0 <= test_fraction < 1.0
    ):
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    return float(test_fraction)


def _check_labels(labels: Any) -> np.ndarray:
    y = np.asarray(labels)
    if y.ndim != 1 or y.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"labels must be integers, got dtype {y.dtype}")
    if y.min() < 0:
        raise ValueError(f"labels must be >= 0, found {int(y.min())}")
    return y


def _check_data(images: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(images)
    y = _check_labels(labels)
    if x.ndim < 1 or len(x) != len(y):
        raise ValueError(
            f"images and labels must have the same length, got {x.shape[:1]} and {len(y)}"
        )
    return x, y


def group_assignment(
    n_clients: int, groups: int | None = None, group_sizes: Sequence[int] | None = None
) -> np.ndarray:
    """Ground-truth group of each client, as an int64 array of length ``n_clients``.

    Without ``group_sizes`` client ``i`` is in group ``i mod groups`` (``groups``
    defaults to 4). With ``group_sizes=[s0, s1, ...]`` (each >= 1, summing to
    ``n_clients``) the first ``s0`` clients are group 0, the next ``s1`` group
    1, and so on; ``groups``, if given, must equal ``len(group_sizes)``.
    """
    n_clients = _check_int("n_clients", n_clients, 1)
    if group_sizes is None:
        g = 4 if groups is None else _check_int("groups", groups, 1)
        return np.arange(n_clients, dtype=np.int64) % g
    sizes = [_check_int("group_sizes entries", s, 1) for s in group_sizes]
    if not sizes:
        raise ValueError("group_sizes must not be empty")
    if groups is not None and _check_int("groups", groups, 1) != len(sizes):
        raise ValueError(f"groups={groups} disagrees with len(group_sizes)={len(sizes)}")
    if sum(sizes) != n_clients:
        raise ValueError(f"group_sizes must sum to n_clients={n_clients}, got {sum(sizes)}")
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


def _n_groups(groups: int | None, group_sizes: Sequence[int] | None) -> int:
    """Number of groups (after :func:`group_assignment` has validated the arguments)."""
    if group_sizes is not None:
        return len(group_sizes)
    return 4 if groups is None else int(groups)


def dirichlet_indices(labels: np.ndarray, n_clients: int, alpha: float, *, min_size: int = 10, seed: int = 0,
                      max_tries: int = 1000) -> list[np.ndarray]:
    """Label-skewed shards: for each class, Dirichlet(alpha) proportions over the clients.

    Small ``alpha`` concentrates each class on a few clients (skewed label
    histograms); large ``alpha`` gives every client about ``1 / n_clients`` of
    each class. Draws are repeated until every client has at least
    ``min_size`` samples, at most ``max_tries`` times.

    Returns one int64 index array per client, disjoint, covering all of
    ``labels``, each in random order.

    Raises
    ------
    ValueError
        On bad arguments, or when ``max_tries`` draws all leave some client
        below ``min_size``.
    """
    y = _check_labels(labels)
    n_clients = _check_int("n_clients", n_clients, 1)
    alpha = _check_alpha(alpha)
    min_size = _check_int("min_size", min_size, 0)
    max_tries = _check_int("max_tries", max_tries, 1)
    return dirichlet_shards(y, n_clients, alpha, min_size, max_tries, seed)


def _shards(
    labels: np.ndarray, n_clients: int, alpha: float | None, min_size: int, seed: int
) -> list[np.ndarray]:
    """Equal random shards (``alpha`` None) or Dirichlet label skew."""
    if alpha is not None:
        return dirichlet_indices(labels, n_clients, alpha, min_size=min_size, seed=seed)
    if len(labels) // n_clients < min_size:
        raise ValueError(
            f"min_size={min_size}: {len(labels)} samples split {n_clients} ways give "
            f"{len(labels) // n_clients} per client"
        )
    order = np.random.default_rng(seed).permutation(len(labels))
    return [a.astype(np.int64) for a in np.array_split(order, n_clients)]


def rotation_groups(
    images: np.ndarray, labels: np.ndarray, n_clients: int, *,
    groups: int | None = None, group_sizes: Sequence[int] | None = None, alpha: float | None = None,
    min_size: int = 10, test_fraction: float = 0.2, seed: int = 0, prefix: str = "c",
) -> list[ClientData]:
    """Rotated groups: a client of group ``g`` sees its images rotated by ``90 * g`` degrees.

    Parameters
    ----------
    images : array (N, H, W) or (N, H, W, C)
        Square images (rotation acts on axes 1 and 2).
    labels : int array (N,)
    n_clients : int
    groups : int, optional
        1 to 4 rotations; client ``i`` is in group ``i mod groups``. Default 4,
        or ``len(group_sizes)``.
    group_sizes : list of int, optional
        Uneven groups: contiguous blocks of these many clients (see
        :func:`group_assignment`).
    alpha : float, optional
        None: equal random shards. A number: Dirichlet(alpha) label skew
        (:func:`dirichlet_indices`). The paper's MNIST scenario is
        ``n_clients=100, alpha=10`` with 4 groups.
    min_size : int
        Every client gets at least this many samples (train + test).
    test_fraction : float
        Share of each client's samples held out as its test split, in [0, 1).
    seed : int
    prefix : str
        Client ids are ``f"{prefix}{i:02d}"`` (``:03d`` from 100 clients).
    """
    x, y = _check_data(images, labels)
    n_clients = _check_int("n_clients", n_clients, 1)
    assign = group_assignment(n_clients, groups, group_sizes)
    n_groups = _n_groups(groups, group_sizes)
    if n_groups > 4:
        raise ValueError(f"groups must be between 1 and 4 rotations, got {n_groups}")
    if x.ndim not in (3, 4):
        raise ValueError(f"images must be (N, H, W) or (N, H, W, C), got shape {x.shape}")
    if n_groups > 1 and x.shape[1] != x.shape[2]:
        raise ValueError(f"images must be square to rotate, got {x.shape[1]}x{x.shape[2]}")
    min_size = _check_int("min_size", min_size, 1)
    test_fraction = _check_test_fraction(test_fraction)
    shards = _shards(y, n_clients, alpha, min_size, seed)

    def rotate(xs: np.ndarray, ys: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
        return np.ascontiguousarray(np.rot90(xs, k=g, axes=(1, 2))), ys

    return build_clients(x, y, shards, assign, rotate, test_fraction, prefix)


def label_flip_groups(
    images: np.ndarray, labels: np.ndarray, n_clients: int, *,
    groups: int | None = None, group_sizes: Sequence[int] | None = None, num_classes: int = 10,
    alpha: float | None = None, min_size: int = 10, test_fraction: float = 0.2, seed: int = 0, prefix: str = "c",
) -> list[ClientData]:
    """Label-permuted groups: a client of group ``k`` relabels ``y -> (y - k) mod num_classes``.

    Images are unchanged. ``groups`` (default 4, at most ``num_classes``),
    ``group_sizes``, ``alpha`` (skew computed on the original labels),
    ``min_size``, ``test_fraction``, ``seed`` and ``prefix`` are as in
    :func:`rotation_groups`. Labels keep their dtype.
    """
    x, y = _check_data(images, labels)
    n_clients = _check_int("n_clients", n_clients, 1)
    num_classes = _check_int("num_classes", num_classes, 2)
    if int(y.max()) >= num_classes:
        raise ValueError(f"labels must be below num_classes={num_classes}, found {int(y.max())}")
    assign = group_assignment(n_clients, groups, group_sizes)
    n_groups = _n_groups(groups, group_sizes)
    if n_groups > num_classes:
        raise ValueError(
            f"groups must be at most num_classes={num_classes} distinct flips, got {n_groups}"
        )
    min_size = _check_int("min_size", min_size, 1)
    test_fraction = _check_test_fraction(test_fraction)
    shards = _shards(y, n_clients, alpha, min_size, seed)

    def flip(xs: np.ndarray, ys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        return xs, ((ys.astype(np.int64) - k) % num_classes).astype(ys.dtype)

    return build_clients(x, y, shards, assign, flip, test_fraction, prefix)


def _check_class_sets(class_sets: Sequence[Sequence[int]], n_cls: int) -> list[tuple[int, ...]]:
    """Distinct, non-empty, sorted class sets below ``n_cls``, or a ValueError saying which rule failed."""
    given = []
    for s in class_sets:
        if isinstance(s, (str, bytes)) or not isinstance(s, Sequence):
            raise ValueError(f"class_sets must be a list of lists of classes, got entry {s!r}")
        cs = tuple(sorted({_check_int("class_sets entries", c, 0) for c in s}))
        if not cs:
            raise ValueError("class_sets must not contain an empty set")
        if cs[-1] >= n_cls:
            raise ValueError(f"class_sets entry {cs[-1]} is not below num_classes={n_cls}")
        given.append(cs)
    if not given or len(set(given)) != len(given):
        raise ValueError(f"class_sets must be a non-empty list of distinct sets, got {given}")
    return given


def pathological_partition(
    images: np.ndarray, labels: np.ndarray, n_clients: int, *,
    classes_per_client: int = 2, class_sets: Sequence[Sequence[int]] | None = None,
    group_sizes: Sequence[int] | None = None, num_classes: int | None = None,
    min_size: int = 10, test_fraction: float = 0.2, seed: int = 0, prefix: str = "c",
) -> list[ClientData]:
    """Pathological non-IID: each client holds only a few classes.

    Without ``class_sets`` every client draws ``classes_per_client`` distinct
    classes at random. With ``class_sets`` (distinct, non-empty sets, e.g.
    ``[[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]``) client ``i`` gets set
    ``i mod len(class_sets)``, or sets by contiguous ``group_sizes`` blocks;
    ``classes_per_client`` is then not used. The samples of each class are
    split evenly (at random) among the clients holding it; classes nobody
    holds are left out.

    A client's ``group`` is the id of its class set: the index into
    ``class_sets`` when given, else the rank of the set among the distinct
    sets drawn (sorted as tuples), so clients with the same classes share a
    group. ``num_classes`` defaults to ``max(labels) + 1``. ``min_size``,
    ``test_fraction``, ``seed`` and ``prefix`` are as in :func:`rotation_groups`.
    """
    x, y = _check_data(images, labels)
    n_clients = _check_int("n_clients", n_clients, 1)
    n_cls = int(y.max()) + 1 if num_classes is None else _check_int("num_classes", num_classes, 1)
    if int(y.max()) >= n_cls:
        raise ValueError(f"labels must be below num_classes={n_cls}, found {int(y.max())}")
    min_size = _check_int("min_size", min_size, 1)
    test_fraction = _check_test_fraction(test_fraction)
    rng = np.random.default_rng(seed)
    if class_sets is None:
        if group_sizes is not None:
            raise ValueError("group_sizes needs class_sets (random class sets have no fixed groups)")
        cpc = _check_int("classes_per_client", classes_per_client, 1)
        if cpc > n_cls:
            raise ValueError(f"classes_per_client={cpc} exceeds num_classes={n_cls}")
        sets = [tuple(sorted(int(c) for c in rng.choice(n_cls, cpc, replace=False)))
                for _ in range(n_clients)]
        ids = {s: k for k, s in enumerate(sorted(set(sets)))}
        assign = np.array([ids[s] for s in sets], dtype=np.int64)
    else:
        given = _check_class_sets(class_sets, n_cls)
        assign = group_assignment(n_clients, len(given), group_sizes)
        sets = [given[g] for g in assign]

    shards = class_shards(y, n_cls, sets, min_size, rng)
    return build_clients(x, y, shards, assign, lambda xs, ys, g: (xs, ys), test_fraction, prefix)


def group_sizes_from_shares(n_clients: int, shares: Sequence[float]) -> list[int]:
    """Clients per group for the given shares, by largest remainder (sums to ``n_clients``).

    Each group gets ``floor(share * n_clients)`` clients, and the clients left
    over go one each to the groups with the largest fractional parts (the first
    group on ties). ``shares`` must be positive and sum to 1; every group must
    end up with at least one client. For 15 clients and the paper's
    ``(0.20, 0.47, 0.33)`` this gives ``[3, 7, 5]``, for 30 ``[6, 14, 10]``.
    """
    n_clients = _check_int("n_clients", n_clients, 1)
    return shares_to_sizes(n_clients, shares)


def _ocfl_class_sets(class_sets: Any, overlapping: bool, n_cls: int) -> list[tuple[int, ...]]:
    """The OCFL class sets (defaults when None), checked, and overlapping exactly when asked."""
    if class_sets is None:
        return [tuple(s) for s in (OCFL_OVERLAPPING_CLASS_SETS if overlapping else OCFL_CLASS_SETS)]
    given = _check_class_sets(class_sets, n_cls)
    shared = sorted({c for i, a in enumerate(given) for b in given[i + 1:] for c in set(a) & set(b)})
    if shared and not overlapping:
        raise ValueError(f"class_sets share classes {shared} but overlapping=False; "
                         "pass overlapping=True or disjoint sets")
    if not shared and overlapping:
        raise ValueError(f"overlapping=True but class_sets {given} are disjoint")
    return given


def class_set_groups(
    images: np.ndarray, labels: np.ndarray, n_clients: int, *,
    class_sets: Sequence[Sequence[int]] | None = None, overlapping: bool = False,
    group_shares: Sequence[float] | None = None, alpha: float | None = None,
    samples_per_client: int | None = None, num_classes: int | None = None,
    min_size: int = 10, test_fraction: float = 0.2, seed: int = 0, prefix: str = "c",
) -> list[ClientData]:
    """The OCFL paper's splits: groups of clients that hold different sets of classes.

    Zuziak et al. (2024) build 15 or 30 clients in three groups, group ``g``
    holding only the classes of ``class_sets[g]``; the four named variants are
    in :data:`OCFL_SPLITS` (``class_set_groups(x, y, 15, **OCFL_SPLITS["overlap_imbalanced"])``).
    A client's ``group`` is the index of its class set. Images are unchanged.

    Parameters
    ----------
    images : array (N, ...)
    labels : int array (N,)
    n_clients : int
    class_sets : list of lists of int, optional
        The classes of each group. Default: :data:`OCFL_CLASS_SETS`
        (``{0-3}, {4-6}, {7-9}``), or :data:`OCFL_OVERLAPPING_CLASS_SETS` with
        ``overlapping=True``.
    overlapping : bool
        Whether groups share classes. With the default sets it picks the
        overlapping ones; with given sets it must say whether they intersect
        (a mismatch is refused, so a typo cannot silently change the split).
    group_shares : list of float, optional
        None (balanced): client ``i`` is in group ``i mod len(class_sets)``.
        Shares (positive, summing to 1, one per set; the imbalanced splits use
        :data:`OCFL_IMBALANCED_SHARES`): contiguous blocks of
        :func:`group_sizes_from_shares` clients.
    alpha : float, optional
        None: labels uniform inside a client's class set. A number:
        Dirichlet(alpha) label skew inside the set (the imbalanced splits use 1).
    samples_per_client : int, optional
        None: every sample of a class goes to the clients holding it, split
        evenly (``alpha`` None; a class's remainder goes to different clients
        for different classes) or by Dirichlet(alpha) proportions drawn per
        class over its holders (redrawn, at most 1000 times, until every
        client has ``min_size`` samples). A number: each client draws exactly
        that many samples (train + test), in proportions uniform over its set
        or drawn from Dirichlet(alpha) over its set, without replacement from
        the shared pool of each class (no sample goes to two clients); refused
        when a class runs out. Classes nobody holds are left out either way.
    num_classes : int, optional
        Default ``max(labels) + 1``; every class of ``class_sets`` must be
        below it and have samples.
    min_size : int
        Every client gets at least this many samples (train + test).
    test_fraction, seed, prefix
        As in :func:`rotation_groups`.

    Returns
    -------
    list of ClientData
        Client ids ``f"{prefix}{i:02d}"`` (``:03d`` from 100 clients).
    """
    x, y = _check_data(images, labels)
    n_clients = _check_int("n_clients", n_clients, 1)
    n_cls, sets, assign = _class_set_plan(y, n_clients, class_sets, overlapping, group_shares, num_classes)
    alpha = None if alpha is None else _check_alpha(alpha)
    min_size = _check_int("min_size", min_size, 1)
    test_fraction = _check_test_fraction(test_fraction)
    if samples_per_client is not None:
        samples_per_client = _check_int("samples_per_client", samples_per_client, min_size)
    shards = class_set_shards(y, n_cls, sets, assign, alpha=alpha, samples_per_client=samples_per_client,
                              min_size=min_size, seed=seed)
    return build_clients(x, y, shards, assign, lambda xs, ys, g: (xs, ys), test_fraction, prefix)


def _class_set_plan(y: np.ndarray, n_clients: int, class_sets: Any, overlapping: Any, group_shares: Any,
                    num_classes: Any) -> tuple[int, list[tuple[int, ...]], np.ndarray]:
    """The number of classes, the checked class sets and each client's group (:func:`class_set_groups`)."""
    if not isinstance(overlapping, (bool, np.bool_)):
        raise ValueError(f"overlapping must be True or False, got {overlapping!r}")
    n_cls = int(y.max()) + 1 if num_classes is None else _check_int("num_classes", num_classes, 1)
    if int(y.max()) >= n_cls:
        raise ValueError(f"labels must be below num_classes={n_cls}, found {int(y.max())}")
    sets = _ocfl_class_sets(class_sets, bool(overlapping), n_cls)
    n_groups = len(sets)
    if group_shares is None:
        return n_cls, sets, group_assignment(n_clients, n_groups)
    sizes = group_sizes_from_shares(n_clients, group_shares)
    if len(sizes) != n_groups:
        raise ValueError(f"group_shares has {len(sizes)} entries for {n_groups} class sets")
    return n_cls, sets, group_assignment(n_clients, n_groups, sizes)


def summarize(clients: Sequence[ClientData], num_classes: int | None = None) -> dict[str, Any]:
    """Tally a partition, in plain (JSON-ready) Python types.

    Returns
    -------
    dict
        ``n_clients``, ``n_groups``, ``num_classes`` (default: largest label
        + 1), ``n_samples``, ``group_counts`` (group -> number of clients,
        sorted), and ``clients``: one dict per client with ``cid``, ``group``,
        ``n_train``, ``n_test``, ``label_hist`` (train + test counts per
        class), ``train_hist`` and ``classes`` (labels present).
    """
    if not clients:
        raise ValueError("clients must not be empty")
    if num_classes is None:
        top = [int(a.max()) for c in clients for a in (c.y_train, c.y_test) if len(a)]
        num_classes = max(top) + 1 if top else 0
    else:
        num_classes = _check_int("num_classes", num_classes, 1)
    return tally_clients(clients, num_classes)
