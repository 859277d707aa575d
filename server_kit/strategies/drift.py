"""Following drift for ours: fresh sketches move devices between clusters, pool misfits, make new clusters.

:class:`DriftTracker` is what :class:`~server_kit.strategies.fedsketch.SketchClustered`
does with sketches that arrive during training (``on_resketch``):

- each device's new sketch is compared with every live cluster's centroid
  (:class:`~server_kit.clustering.migration.Migration`): it stays while it is
  within its own cluster's radius (never moved for noise), moves when it left
  its radius and fits another cluster's, and waits in a pool when it fits none;
- a pooled device keeps training with its old cluster (its data is closer to
  that model than to nothing, and it keeps contributing; the alternative, the
  global average, does not exist in a clustered run);
- when the pool holds at least ``min_cluster_size`` devices that the same
  clustering method groups together (:func:`~server_kit.clustering.migration.group_pool`),
  each such group becomes a new cluster, started from the model of the
  existing cluster whose centroid is nearest to the group's;
- a new cluster trains every one of its devices, :data:`WARMUP_EPOCHS` times
  the local epochs, for its first :data:`WARMUP_ROUNDS` rounds (it starts from
  another cluster's model, far behind the others; more local work, no more bytes);
- a cluster left without devices is retired (its model is dropped).

Every move is logged with its distances and counted; :meth:`DriftTracker.state`
carries the centroids, the pool and the counters through checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.bits import hamming_cdist, unpack_bits
from edge_sdk.validation import check_int

__all__ = ["WARMUP_EPOCHS", "WARMUP_ROUNDS", "DriftReport", "DriftTracker"]

#: Rounds a new cluster trains every one of its devices (it starts from another cluster's model).
WARMUP_ROUNDS = 3

#: During those rounds its devices train this many times the strategy's local epochs (no extra bytes).
WARMUP_EPOCHS = 3



log = logging.getLogger(__name__)


@dataclass
class DriftReport:
    """What one batch of fresh sketches changed."""

    round: int
    sketches: int = 0
    moves: list[dict[str, Any]] = field(default_factory=list)
    pooled: list[str] = field(default_factory=list)
    new_clusters: list[dict[str, Any]] = field(default_factory=list)
    retired: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """JSON-able counts and details, for round records and reports."""
        return {"round": self.round, "sketches": self.sketches, "moves": self.moves, "pooled": self.pooled,
                "new_clusters": self.new_clusters, "retired": self.retired}


class DriftTracker:
    """The clusters' centroids, the pool of misfits and the counters of a run that follows drift.

    Parameters
    ----------
    resketch_every : int or None
        Ask the fleet for fresh sketches every this many rounds (None: only
        the sketches devices send unasked).
    flip_prob : float
        P of the fleet's sketches (the radius margin depends on it).
    z : float
        A fresh sketch more than ``z`` standard deviations of flip noise from the device's
        reference sketch (:func:`edge_sdk.drift.noise_margin_bits`) is a change.
    radius_z : float
        The margins of the clusters' radii and of a move, in standard deviations
        (:class:`~server_kit.clustering.migration.Migration`).
    min_cluster_size : int
        Pooled devices needed to make a new cluster.
    random_state : int
        Seed of the clustering of the pool.
    clustering : mapping
        Further settings of the clustering of the pool (as the strategy's).
    """

    def __init__(self, *, resketch_every: int | None = None, flip_prob: float = 0.1, z: float = 4.0,
                 radius_z: float = 2.0, min_cluster_size: int = 2, random_state: int = 0,
                 clustering: Mapping[str, Any] | None = None) -> None:
        self.resketch_every = None if resketch_every is None else check_int(resketch_every, "resketch_every", 1)
        self.flip_prob = float(flip_prob)
        self.z = float(z)
        self.radius_z = float(radius_z)
        self.min_cluster_size = check_int(min_cluster_size, "min_cluster_size", 1)
        self.random_state = int(random_state)
        self.clustering = dict(clustering or {})
        self.migration: Any = None
        self.n_bits = 0
        #: The last sketch (packed bits) of every device, as clustered or re-sent.
        self.sketches: dict[str, np.ndarray] = {}
        #: Devices that fit no cluster, waiting for enough of their kind.
        self.pool: set[str] = set()
        self.counts = {"moves": 0, "pooled": 0, "new_clusters": 0, "retired": 0, "sketches": 0}
        #: New cluster -> the round it was made; it trains every member for WARMUP_ROUNDS rounds.
        self.born: dict[int, int] = {}
        #: A fresh sketch this close to the device's reference sketch is no change (bits).
        self.change_bits = 0.0

    def young(self, cluster: int, rnd: int) -> bool:
        """Whether ``cluster`` was made from the pool less than :data:`WARMUP_ROUNDS` rounds before ``rnd``."""
        born = self.born.get(int(cluster))
        return born is not None and rnd - born < WARMUP_ROUNDS

    def due(self, rnd: int) -> bool:
        """Whether round ``rnd`` asks for fresh sketches (every ``resketch_every`` rounds)."""
        return self.resketch_every is not None and rnd > 1 and (rnd - 1) % self.resketch_every == 0

    def start(self, packed: Mapping[str, np.ndarray], assignment: Mapping[str, int], n_bits: int) -> None:
        """The clustering before training: its sketches and labels give the first centroids and radii."""
        from ..clustering.migration import Migration

        cids = sorted(packed)
        from edge_sdk.drift import noise_margin_bits

        self.n_bits = int(n_bits)
        self.change_bits = noise_margin_bits(self.n_bits, self.flip_prob, self.z)
        self.sketches = {c: np.asarray(packed[c], dtype=np.uint8) for c in cids}
        self.migration = Migration.from_labels(np.stack([self.sketches[c] for c in cids]),
                                               [assignment[c] for c in cids], self.n_bits,
                                               flip_prob=self.flip_prob, z=self.radius_z)

    def observe(self, rnd: int, sketches: Mapping[str, np.ndarray], assignment: dict[str, int]) -> DriftReport:
        """Decide for each fresh sketch; ``assignment`` is updated in place (moves and new clusters).

        A sketch within ``change_bits`` of the device's reference sketch (the one it was last
        placed with) is no change: with the device's flip key fixed, that distance holds no
        flip noise, so a device whose data did not change is never moved. The changed ones are
        decided against centroids of the clusters' unchanged members.
        """
        if self.migration is None:
            raise ValueError("fresh sketches before the first clustering: call start() first")
        report = DriftReport(rnd, sketches=len(sketches))
        changed = {}
        for cid in sorted(sketches):
            new = np.asarray(sketches[cid], dtype=np.uint8)
            old = self.sketches.get(cid)
            if old is None or cid in self.pool or hamming_cdist(old[None], new[None], self.n_bits)[0, 0] > self.change_bits:
                changed[cid] = new
        touched = self._exclude(changed, assignment)
        for cid, new in changed.items():
            self.sketches[cid] = new
            self._decide(rnd, cid, assignment, report, touched)
        self._form_new_clusters(rnd, assignment, report, touched)
        self._refresh(assignment, touched, report)
        self.counts["sketches"] += report.sketches
        return report

    def _exclude(self, changed: Mapping[str, np.ndarray], assignment: Mapping[str, int]) -> set[int]:
        """Centroids from the unchanged members only, for the clusters that have changed ones."""
        touched = {assignment[c] for c in changed if c in assignment}
        for k in sorted(touched):
            if k not in self.migration.clusters:
                continue
            stable = sorted(c for c, v in assignment.items() if v == k and c not in changed and c not in self.pool)
            if stable:
                self.migration.set_members(k, np.stack([self.sketches[c] for c in stable]))
        return touched

    def _decide(self, rnd: int, cid: str, assignment: dict[str, int], report: DriftReport,
                touched: set[int]) -> None:
        current = -1 if cid in self.pool or cid not in assignment else assignment[cid]
        d = self.migration.decide(cid, self.sketches[cid], current)
        if d.action == "move":
            old = assignment.get(cid)
            assignment[cid] = int(d.target)
            self.pool.discard(cid)
            touched.update(k for k in (old, d.target) if k is not None)
            move = {"cid": cid, "from": old, "to": int(d.target), "distance_from": round(d.distance_current, 2),
                    "radius_from": round(d.radius_current, 2), "distance_to": round(d.distance_nearest, 2),
                    "radius_to": round(float(d.radius_nearest), 2)}
            report.moves.append(move)
            self.counts["moves"] += 1
            log.info("round %d: device %s moves from cluster %s to %d (distance %.1f bits, radius %.1f; "
                     "to the new centroid %.1f, radius %.1f)", rnd, cid, old, d.target, d.distance_current,
                     d.radius_current, d.distance_nearest, d.radius_nearest)
        elif d.action == "pool" and cid not in self.pool:
            self.pool.add(cid)
            if current >= 0:
                touched.add(current)  # its cluster's centroid no longer counts the misfit
            report.pooled.append(cid)
            self.counts["pooled"] += 1
            log.info("round %d: device %s fits no cluster (distance %.1f bits to its own, radius %.1f; nearest "
                     "other %.1f): pooled, training on with cluster %s", rnd, cid, d.distance_current,
                     d.radius_current, d.distance_nearest, assignment.get(cid))

    def _form_new_clusters(self, rnd: int, assignment: dict[str, int], report: DriftReport,
                           touched: set[int]) -> None:
        from ..clustering.migration import group_pool

        if len(self.pool) < self.min_cluster_size:
            return
        groups = group_pool({c: self.sketches[c] for c in sorted(self.pool)}, self.n_bits,
                            min_cluster_size=self.min_cluster_size, random_state=self.random_state,
                            max_radius=self.migration.max_radius, **self.clustering)
        for members in groups:
            packed = np.stack([self.sketches[c] for c in members])
            start_from = self._nearest_cluster(packed)
            k = self.migration.add_cluster(packed)
            self.born[k] = int(rnd)
            old = {c: assignment.get(c) for c in members}
            for c in members:
                assignment[c] = k
                self.pool.discard(c)
            touched.update(v for v in old.values() if v is not None)
            report.new_clusters.append({"cluster": k, "devices": list(members), "started_from": start_from})
            self.counts["new_clusters"] += 1
            log.info("round %d: new cluster %d from %d pooled devices %s, started from cluster %s's model",
                     rnd, k, len(members), members, start_from)

    def _nearest_cluster(self, packed: np.ndarray) -> int | None:
        """The live cluster whose centroid is nearest to the mean of ``packed``'s bits (squared distance)."""
        keys = self.migration.clusters
        if not keys:
            return None
        bits = unpack_bits(packed, self.n_bits).mean(axis=0)
        d = [float(np.sum((bits - self.migration.centroid(k)) ** 2)) for k in keys]
        return keys[int(np.argmin(d))]  # ties to the first, as before

    def _refresh(self, assignment: Mapping[str, int], touched: set[int], report: DriftReport) -> None:
        """Recompute the centroids of clusters that gained or lost devices; retire the emptied ones."""
        for k in sorted(touched):
            if k not in self.migration.clusters:
                continue
            members = sorted(c for c, v in assignment.items() if v == k and c not in self.pool)
            if any(v == k for v in assignment.values()) and members:
                self.migration.set_members(k, np.stack([self.sketches[c] for c in members]))
            elif not any(v == k for v in assignment.values()):
                self.migration.retire(k)
                report.retired.append(k)
                self.counts["retired"] += 1
                log.info("cluster %d has no devices left: retired", k)

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """JSON-able meta and arrays for a checkpoint (no pickle)."""
        meta, arrays = self.migration.state() if self.migration is not None else ({}, {})
        tensors = {f"_drift/migration/{k}": v for k, v in arrays.items()}
        cids = sorted(self.sketches)
        if cids:
            tensors["_drift/sketches"] = np.stack([self.sketches[c] for c in cids])
        return {"migration": meta, "sketch_ids": cids, "pool": sorted(self.pool), "counts": dict(self.counts),
                "n_bits": self.n_bits, "change_bits": self.change_bits, "born": {str(k): v for k, v in self.born.items()}}, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        """Restore what :meth:`state` wrote."""
        from ..clustering.migration import Migration

        self.n_bits = int(meta["n_bits"])
        self.change_bits = float(meta.get("change_bits", 0.0))
        arrays = {k[len("_drift/migration/"):]: v for k, v in tensors.items() if k.startswith("_drift/migration/")}
        self.migration = Migration.from_state(meta["migration"], arrays)
        cids = list(meta["sketch_ids"])
        packed = tensors.get("_drift/sketches")
        self.sketches = {c: np.asarray(packed[i], dtype=np.uint8) for i, c in enumerate(cids)} if cids else {}
        self.pool = set(meta["pool"])
        self.counts = {k: int(v) for k, v in meta["counts"].items()}
        self.born = {int(k): int(v) for k, v in meta.get("born", {}).items()}
