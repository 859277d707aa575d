"""Drift: from a device's fresh sketch, keep it in its cluster, move it to another, or pool it.

The clusters are made once, from one sketch per device. When the server asks
again during training, :class:`Migration` compares each fresh sketch with the
clusters' centroids and radii and returns a :class:`Decision`;
:func:`group_pool` groups the pooled devices that the same clustering method
(:class:`~server_kit.clustering.sketch.SketchClustering`) puts together, so
that a group of at least ``min_cluster_size`` can become a new cluster.

**Distance.** The distance of a sketch ``x`` (0/1 bits) to a cluster is the
squared Euclidean distance to its centroid ``c`` (the mean of the members'
bits), ``sum_b (x_b - c_b) ** 2``: the notion of
:meth:`SketchClustering.predict <server_kit.clustering.centroids.NearestCentroids.predict>`
and of its consolidation passes, so a device moved here goes where the
late-joiner rule would put it. It is measured in bits: the expected Hamming
distance from ``x`` to the members, ``sum_b |x_b - c_b|``, minus the
centroid's own spread ``sum_b c_b (1 - c_b)``; for one cluster that is a
constant, so both notions order the devices alike, and for a cluster of one
member (a 0/1 centroid) both are the Hamming distance.

**Radius.** Cluster ``k``'s radius is its reach plus a margin for noise.
The reach is the largest leave-one-out distance of its members (each member to
the centroid of the *others*: what a new device of the group sees); a cluster
of fewer than :data:`MIN_REACH_MEMBERS` members has no reliable reach of its
own and takes the largest reach of the clusters that have one (of all clusters,
when none has that many members). The margin is ``z`` standard
deviations of the distance of one sketch to the centroid under flip noise,
``sigma_k = sqrt(p (1 - p) sum_b (1 - 2 c_b) ** 2)`` (a bit that flips changes
``(x_b - c_b) ** 2`` by ``|1 - 2 c_b|``), ``z = 2`` by default: about 7 bits
for 200-bit sketches at P = 0.1. In a cluster of at least
:data:`MIN_REACH_MEMBERS` members, a member as clustered is always inside (its
distance to the centroid of all members is ``((m - 1) / m) ** 2`` times its
leave-one-out distance); a smaller cluster's borrowed reach may leave one of
its own members outside, which the tracker never asks about (it decides only
sketches that changed).

**Decision** (the device's fresh sketch; the caller decides only sketches that
changed, see :class:`~server_kit.strategies.drift.DriftTracker`: a device keeps
its flip key, so unchanged data gives the very same sketch and is never
decided, hence never moved). A cluster *holds* the sketch when it is within
the cluster's radius. With ``current`` the device's cluster:

- ``"stay"`` when its own cluster holds it and no other holding cluster is
  nearer by more than the noise of the difference of two distances,
  ``z * sqrt(sigma_current ** 2 + sigma_other ** 2)``;
- ``"move"`` to the nearest holding cluster otherwise (when its own does not
  hold it, or another is clearly nearer);
- ``"pool"`` when no live cluster holds it, its own included.

A pooled device is passed with ``current = POOLED`` (-1): it moves into the
nearest cluster that holds it, else stays ``"pool"``; its
``distance_current`` is inf and ``radius_current`` 0.0. Cluster ids are
integers >= 0; a new cluster takes the largest id ever used plus one, so ids
are never reused after :meth:`Migration.retire`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from edge_sdk import bits as _bits
from edge_sdk.sketch import Sketch
from edge_sdk.validation import check_int, check_number, check_positive

from .params import check_packed
from .sketch import SketchClustering

__all__ = ["POOLED", "Decision", "Migration", "group_pool", "loo_distances"]

#: ``current`` of a device that waits in the pool (in no cluster).
POOLED = -1

#: Version of :meth:`Migration.state`'s layout.
STATE_VERSION = 2

#: A cluster with fewer members takes the fleet's largest reach as its own.
MIN_REACH_MEMBERS = 5


@dataclass(frozen=True)
class Decision:
    """What :meth:`Migration.decide` says about one fresh sketch (distances in bits)."""

    cid: str
    action: str                 # "stay", "move" or "pool"
    current: int                # the cluster the device is in now (POOLED: none)
    target: int | None          # "move": the cluster to go to; otherwise None
    distance_current: float     # to the current cluster's centroid (inf when pooled)
    distance_nearest: float     # to the nearest other live cluster's centroid (inf if none)
    nearest: int | None         # that cluster
    radius_current: float       # the current cluster's radius (0.0 when pooled)
    radius_nearest: float | None

    def as_dict(self) -> dict[str, Any]:
        """The fields for a JSON log: an infinite distance becomes None."""
        return {k: None if isinstance(v, float) and math.isinf(v) else v for k, v in asdict(self).items()}


def loo_distances(bits: np.ndarray) -> np.ndarray:
    """Squared distance of each row of 0/1 ``bits`` (m >= 2 rows) to the mean of the other rows.

    Row ``i`` minus the mean of the others is ``m / (m - 1)`` times row ``i``
    minus the mean of all rows, so one pass gives every leave-one-out distance.
    """
    b = np.asarray(bits, dtype=np.float64)
    m = b.shape[0]
    if b.ndim != 2 or m < 2:
        raise ValueError(f"leave-one-out distances need a 2-D array of at least 2 rows, got shape {b.shape}")
    dev = b - b.mean(axis=0)
    return (m / (m - 1)) ** 2 * np.einsum("ij,ij->i", dev, dev)


class Migration:
    """The clusters' centroids and radii, and the rule that moves, keeps or pools a device from its new sketch.

    Parameters
    ----------
    members : mapping of int to ndarray of uint8
        Cluster id (>= 0) -> packed sketches ``(m_k, ceil(n_bits / 8))`` of the
        devices clustered there; at least one cluster, each with a member.
    n_bits : int
        Meaningful bits per sketch.
    flip_prob : float, default 0.1
        P of the fleet's sketches, in [0, 0.5]: the radius margin depends on it.
    z : float, default 2.0
        The margins in standard deviations of flip noise (> 0).
    """

    def __init__(self, members: Mapping[int, np.ndarray], n_bits: int, *, flip_prob: float = 0.1,
                 z: float = 2.0) -> None:
        self._setup(n_bits, flip_prob, z)
        if not isinstance(members, Mapping) or not members:
            raise ValueError("members must map at least one cluster id to its packed sketches")
        ids = [check_int(k, "cluster id", 0) for k in members]
        if len(set(ids)) != len(ids):
            raise ValueError(f"cluster ids must be distinct, got {sorted(ids)}")
        for k, rows in sorted(zip(ids, members.values()), key=lambda kv: kv[0]):
            self._fit(k, rows)
        self._next_id = max(ids) + 1

    def _setup(self, n_bits: Any, flip_prob: Any, z: Any) -> None:
        self.n_bits = check_int(n_bits, "n_bits", 1)
        self.flip_prob = check_number(flip_prob, "flip_prob", low=0.0, high=0.5)
        self.z = check_positive(z, "z")
        self._centroids: dict[int, np.ndarray] = {}
        self._reach: dict[int, float] = {}
        self._sizes: dict[int, int] = {}
        self._retired: set[int] = set()
        self._next_id = 0

    @classmethod
    def from_labels(cls, packed: np.ndarray, labels: Sequence[int], n_bits: int, **kw: Any) -> Migration:
        """From every device's packed sketch and its cluster label (``labels_`` of a fit); ``kw`` as the constructor."""
        p = check_packed(packed, check_int(n_bits, "n_bits", 1))
        lab = np.asarray(labels)
        if lab.shape != (p.shape[0],) or (lab.size and not np.issubdtype(lab.dtype, np.integer)):
            raise ValueError(f"labels must be {p.shape[0]} integers (one per sketch), got {lab.dtype} {lab.shape}")
        if lab.size and lab.min() < 0:
            raise ValueError(f"labels must be cluster ids >= 0, got {int(lab.min())}")
        return cls({int(k): p[lab == k] for k in np.unique(lab)}, n_bits, **kw)

    # -- the clusters -------------------------------------------------------------------------------

    @property
    def clusters(self) -> list[int]:
        """The live cluster ids, ascending."""
        return sorted(self._centroids)

    @property
    def retired(self) -> list[int]:
        """The retired cluster ids, ascending."""
        return sorted(self._retired)

    @property
    def max_radius(self) -> float:
        """The largest live radius (inf when none is live): a bound for :func:`group_pool`'s ``max_radius``."""
        return max((self.radius(k) for k in self.clusters), default=math.inf)

    def unseen_drifts(self) -> list[tuple[int, int]]:
        """Pairs ``(a, b)`` of live clusters too close for the rule to see a drift from ``a`` to ``b``.

        A device whose bits follow cluster ``b``'s centroid ``c_b`` (each bit
        independently) is on average at ``||c_a - c_b||**2 + sum c_b (1 - c_b)``
        from ``c_a``; when that is within ``a``'s radius, a device of ``a``
        whose data turned into ``b``'s kind usually stays in ``a``. Worth a
        warning in the log after clustering; [] when every drift shows.
        """
        out = []
        for a in self.clusters:
            for b in self.clusters:
                cb = self._centroids[b]
                seen = float(np.sum((self._centroids[a] - cb) ** 2) + np.sum(cb * (1.0 - cb)))
                if a != b and seen <= self.radius(a):
                    out.append((a, b))
        return out

    def centroid(self, k: int) -> np.ndarray:
        """Mean bit vector ``(n_bits,)`` of live cluster ``k`` (a copy)."""
        return self._centroids[self._live(k)].copy()

    def radius(self, k: int) -> float:
        """Cluster ``k``'s radius in bits: its reach (the fleet's largest for a small cluster) plus ``z`` sigma."""
        k = self._live(k)
        if self._sizes[k] >= MIN_REACH_MEMBERS:
            reach = self._reach[k]
        else:  # the largest reach of the clusters big enough to have one, if any
            big = [self._reach[j] for j in self._reach if self._sizes[j] >= MIN_REACH_MEMBERS]
            reach = max(big or self._reach.values())
        return reach + self.z * self.sigma(k)

    def size(self, k: int) -> int:
        """Members live cluster ``k``'s centroid and radius were computed from."""
        return self._sizes[self._live(k)]

    def add_cluster(self, members: np.ndarray) -> int:
        """A new cluster from packed sketches; its id (the largest ever used plus one)."""
        k = self._next_id
        self._fit(k, members)
        self._next_id = k + 1
        return k

    def set_members(self, k: int, members: np.ndarray) -> None:
        """Recompute the centroid and radius of live cluster ``k`` from its members now (after moves)."""
        self._fit(self._live(k), members)

    def retire(self, k: int) -> None:
        """An emptied cluster: no longer a target; its id is not reused."""
        k = self._live(k)
        del self._centroids[k], self._reach[k], self._sizes[k]
        self._retired.add(k)

    def _live(self, k: Any) -> int:
        k = check_int(k, "cluster", 0)
        if k in self._retired:
            raise ValueError(f"cluster {k} is retired")
        if k not in self._centroids:
            raise ValueError(f"unknown cluster {k}: live clusters are {self.clusters}")
        return k

    def _fit(self, k: int, members: np.ndarray) -> None:
        p = check_packed(members, self.n_bits)
        if p.shape[0] == 0:
            raise ValueError(f"cluster {k} has no members: retire it instead")
        bits = _bits.unpack_bits(p, self.n_bits).astype(np.float64)
        self._reach[k] = float(loo_distances(bits).max()) if bits.shape[0] > 1 else 0.0
        self._centroids[k] = bits.mean(axis=0)
        self._sizes[k] = int(p.shape[0])

    def sigma(self, k: int) -> float:
        """Standard deviation (bits) of one sketch's distance to cluster ``k``'s centroid under flip noise."""
        c = self._centroids[self._live(k)]
        return math.sqrt(self.flip_prob * (1.0 - self.flip_prob) * float(np.sum((1.0 - 2.0 * c) ** 2)))

    # -- the rule -----------------------------------------------------------------------------------

    def distances(self, packed: np.ndarray | bytes | Sketch) -> dict[int, float]:
        """Distance in bits of one sketch to every live cluster's centroid."""
        x = self._row(packed)
        return {k: float(np.sum((c - x) ** 2)) for k, c in sorted(self._centroids.items())}

    def decide(self, cid: str, packed: np.ndarray | bytes | Sketch, current: int) -> Decision:
        """Stay, move or pool device ``cid`` from its fresh sketch (see the module's docstring).

        ``packed`` is one packed sketch (``ceil(n_bits / 8)`` uint8 bytes, or a
        :class:`~edge_sdk.sketch.Sketch`); ``current`` the device's live
        cluster, or ``POOLED`` (-1) for a pooled device.
        """
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"cid must be a non-empty string, got {cid!r}")
        if check_int(current, "current", POOLED) != POOLED:
            current = self._live(current)
        d = self.distances(packed)
        radius = {k: self.radius(k) for k in d}
        d_cur = d.pop(current, math.inf)
        r_cur = radius.pop(current, 0.0)
        nearest = min(d, key=lambda k: (d[k], k), default=None)
        near = {"distance_nearest": math.inf if nearest is None else d[nearest], "nearest": nearest,
                "radius_nearest": None if nearest is None else radius[nearest]}
        holding = [k for k in d if d[k] <= radius[k]]
        best = min(holding, key=lambda k: (d[k], k), default=None)
        if d_cur <= r_cur and (best is None or d_cur - d[best] <= self._noise_of_difference(current, best)):
            action, target = "stay", None
        else:
            action, target = ("pool", None) if best is None else ("move", best)
        return Decision(cid=cid, action=action, current=int(current), target=target, distance_current=d_cur,
                        radius_current=r_cur, **near)

    def _noise_of_difference(self, a: int, b: int) -> float:
        """``z`` standard deviations of the difference of one sketch's distances to clusters ``a`` and ``b``."""
        return self.z * math.hypot(self.sigma(a), self.sigma(b))

    def _row(self, packed: Any) -> np.ndarray:
        if isinstance(packed, Sketch):
            if packed.n_bits != self.n_bits:
                raise ValueError(f"the sketch has {packed.n_bits} bits; the clusters have {self.n_bits}")
            packed = packed.packed()
        elif isinstance(packed, (bytes, bytearray)):
            packed = np.frombuffer(bytes(packed), dtype=np.uint8)
        x = np.asarray(packed)
        need = (self.n_bits + 7) // 8
        if x.dtype != np.uint8 or x.shape not in ((need,), (1, need)):
            raise ValueError(f"packed must be one sketch of {need} uint8 bytes ({self.n_bits} bits), "
                             f"got {x.dtype} {x.shape}")
        return _bits.unpack_bits(x.reshape(1, need), self.n_bits)[0].astype(np.float64)

    # -- checkpoints --------------------------------------------------------------------------------

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """JSON-able meta and numpy arrays (``centroids`` and ``reach`` of the live clusters, in id order)."""
        ids = self.clusters
        meta = {"version": STATE_VERSION, "n_bits": self.n_bits, "flip_prob": self.flip_prob, "z": self.z,
                "clusters": ids, "sizes": [self._sizes[k] for k in ids], "retired": self.retired,
                "next_id": self._next_id}
        centroids = np.stack([self._centroids[k] for k in ids]) if ids else np.zeros((0, self.n_bits))
        return meta, {"centroids": centroids, "reach": np.array([self._reach[k] for k in ids], dtype=np.float64)}

    @classmethod
    def from_state(cls, meta: Mapping[str, Any], tensors: Mapping[str, Any]) -> Migration:
        """The :class:`Migration` that :meth:`state` wrote (same decisions)."""
        if not isinstance(meta, Mapping) or meta.get("version") != STATE_VERSION:
            got = meta.get("version") if isinstance(meta, Mapping) else meta
            raise ValueError(f"migration state must be version {STATE_VERSION}, got {got!r}")
        missing = sorted({"n_bits", "flip_prob", "z", "clusters", "sizes", "retired", "next_id"} - set(meta)
                         | {"centroids", "reach"} - set(tensors))
        if missing:
            raise ValueError(f"migration state lacks {missing}")
        self = cls.__new__(cls)
        self._setup(meta["n_bits"], meta["flip_prob"], meta["z"])
        ids = [check_int(k, "cluster id", 0) for k in meta["clusters"]]
        c = np.asarray(tensors["centroids"], dtype=np.float64)
        r = np.asarray(tensors["reach"], dtype=np.float64)
        if c.shape != (len(ids), self.n_bits) or r.shape != (len(ids),) or len(meta["sizes"]) != len(ids):
            raise ValueError(f"migration state holds {len(ids)} clusters but centroids {c.shape}, "
                             f"reach {r.shape} and {len(meta['sizes'])} sizes")
        if not (np.isfinite(c).all() and np.isfinite(r).all()) or c.min(initial=0) < 0 or c.max(initial=0) > 1 \
                or r.min(initial=0) < 0:
            raise ValueError("migration state: centroids must be mean bits in [0, 1] and reaches finite and >= 0")
        for i, k in enumerate(ids):
            self._centroids[k], self._reach[k] = c[i].copy(), float(r[i])
            self._sizes[k] = check_int(meta["sizes"][i], "cluster size", 1)
        self._retired = {check_int(k, "cluster id", 0) for k in meta["retired"]}
        self._next_id = check_int(meta["next_id"], "next_id", max([*ids, *self._retired], default=-1) + 1)
        return self

    def __repr__(self) -> str:
        return (f"Migration(n_bits={self.n_bits}, flip_prob={self.flip_prob}, z={self.z}, "
                f"clusters={self.clusters}, retired={self.retired})")


def group_pool(pool: Mapping[str, np.ndarray], n_bits: int, *, min_cluster_size: int, random_state: int = 0,
               max_radius: float | None = None, **clustering: Any) -> list[list[str]]:
    """Groups of pooled devices that the same clustering method (SketchClustering) puts together.

    Each group holds at least ``min_cluster_size`` devices, its ids sorted;
    the groups are ordered by their first id. [] when the pool is smaller
    than ``min_cluster_size`` or nothing qualifies. ``clustering`` takes the
    other :class:`~server_kit.clustering.sketch.SketchClustering` settings.

    SketchClustering makes one cluster of fewer than ``2 * min_cluster_size``
    sketches without testing them, so a small pool always comes back as one
    group, strays included. ``max_radius`` (e.g. :attr:`Migration.max_radius`)
    guards against that: the member farthest from the centroid of the others
    is dropped while that leave-one-out distance exceeds it, so a new cluster
    is no wider than the clusters the fleet already has; None keeps the groups
    as clustered.
    """
    mcs = check_int(min_cluster_size, "min_cluster_size", 1)
    n_bits = check_int(n_bits, "n_bits", 1)
    if max_radius is not None and not (isinstance(max_radius, float) and max_radius == math.inf):
        max_radius = check_number(max_radius, "max_radius", low=0.0)
    elif max_radius is not None:
        max_radius = None  # no live cluster to compare with: no guard
    if not isinstance(pool, Mapping):
        raise ValueError(f"pool must map device ids to packed sketches, got {type(pool).__name__}")
    if any(not isinstance(c, str) for c in pool):
        raise ValueError("pool's device ids must be strings")
    cids = sorted(pool)
    if len(cids) < mcs:
        return []
    rows = [np.asarray(pool[c]) for c in cids]
    if any(r.ndim != 1 for r in rows):
        raise ValueError("pool's sketches must be 1-D packed rows (one sketch per device)")
    packed = check_packed(np.stack(rows), n_bits)
    labels = SketchClustering(min_cluster_size=mcs, random_state=random_state,
                              **clustering).fit(packed, n_bits).labels_
    bits = _bits.unpack_bits(packed, n_bits)
    groups = []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        while max_radius is not None and idx.size > 1:
            d = loo_distances(bits[idx])
            if d.max() <= max_radius:
                break
            idx = np.delete(idx, int(np.argmax(d)))
        if idx.size >= mcs:
            groups.append([cids[i] for i in idx])
    return sorted(groups)
