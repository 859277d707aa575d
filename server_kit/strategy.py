"""One strategy interface for every clustered-FL method, and the first strategies.

A :class:`Strategy` decides who trains which model each round and how
updates are combined; a driver owns the loop and the messages. Two drivers
run the same strategy objects: the MQTT orchestrator
(:mod:`server_kit.orchestrator`) for real fleets and the in-process simulator
(:mod:`server_kit.simulate`) for research runs and tests.

The hooks cover the three families of the literature:

* clustering **before** training from client sketches (ours, LADD):
  ``needs_sketches = True`` and :meth:`Strategy.on_sketches`;
* clustering **during** training from model updates (CFL, OCFL, Briggs):
  :meth:`Strategy.aggregate_round` sees every update and may split clusters;
* clustering **every round** from client-side choices (IFCA):
  :meth:`Strategy.configure_round` offers several models per task and the
  client reports which one it trained (``Update.model_key``).

Strategies keep their state in plain data (JSON-able dicts and numpy
tensors) so a driver can checkpoint it after every round
(:meth:`Strategy.state` / :meth:`Strategy.load_state`).
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.sketch import Sketch, stack_sketches
from edge_sdk.worker import Task, TrainSettings, Update

from .aggregate import StreamingFedAvg
from .robust import (
    DEFAULT_NORM_BOUND,
    DEFAULT_REFUSE_ABOVE,
    DEFAULT_TRIM_FRACTION,
    CoordinateAggregator,
    RobustConfig,
    cap_samples,
    make_aggregator,
    screen_updates,
)

__all__ = [
    "ClientInfo",
    "ClusteredFedAvg",
    "FedAESketchClustered",
    "FedAvg",
    "PRETRAIN_DEFAULTS",
    "SketchClustered",
    "Strategy",
    "STRATEGIES",
    "make_strategy",
    "pretrain_config",
]

log = logging.getLogger(__name__)

Weights = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ClientInfo:
    """What the server knows of a registered client."""

    cid: str
    n_samples: int = 0
    classes_present: int = 0
    capabilities: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


#: Settings of the federated autoencoder pre-training (paper, Section V) when not given.
PRETRAIN_DEFAULTS: dict[str, Any] = {"architecture": None, "rounds": 3, "epochs": 2, "lr": 1e-3,
                                     "batch_size": 32, "fraction": 1.0}


def pretrain_config(pretrain: Mapping[str, Any], encoder: Any = None) -> dict[str, Any]:
    """Validated federated AE pre-training settings, defaults filled in.

    ``architecture`` (an autoencoder key of :mod:`edge_sdk.nets`) may be left
    out: it is then that of ``encoder`` (an artifact name of the installed
    manifest, or an :class:`edge_sdk.encoder.OnnxEncoder`), the encoder the
    server would otherwise sketch with. Without either it stays None.
    """
    unknown = sorted(set(pretrain) - set(PRETRAIN_DEFAULTS))
    if unknown:
        raise ValueError(f"pretrain: unknown keys {unknown}; known: {sorted(PRETRAIN_DEFAULTS)}")
    cfg = {**PRETRAIN_DEFAULTS, **dict(pretrain)}
    for key in ("rounds", "epochs", "batch_size"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"pretrain {key} must be a positive integer, got {v!r}")
        cfg[key] = int(v)
    lr = cfg["lr"]
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"pretrain lr must be a positive finite number, got {lr!r}")
    cfg["lr"] = float(lr)
    if not isinstance(cfg["fraction"], (int, float)) or not 0.0 < float(cfg["fraction"]) <= 1.0:
        raise ValueError(f"pretrain fraction must be in (0, 1], got {cfg['fraction']!r}")
    cfg["fraction"] = float(cfg["fraction"])
    if cfg["architecture"] is None and encoder is not None:
        spec = getattr(encoder, "spec", None)
        if spec is None:
            from edge_sdk.artifacts import load_manifest

            spec = load_manifest().get(str(encoder))
        arch = (spec.extra or {}).get("architecture") if spec is not None else None
        if not arch:
            raise ValueError(f"pretrain: no architecture given and encoder {encoder!r} names none")
        cfg["architecture"] = str(arch)
    if cfg["architecture"] is not None and not isinstance(cfg["architecture"], str):
        raise ValueError(f"pretrain architecture must be a string, got {cfg['architecture']!r}")
    return cfg


def copy_weights(w: Weights) -> dict[str, np.ndarray]:
    """A deep copy of a model's tensors (the strategies' models never share arrays with updates)."""
    return {k: np.array(v, copy=True) for k, v in w.items()}


class Strategy(ABC):
    """Base of every method. Subclasses fill the hooks; drivers call them in order:

    ``setup`` once; ``on_sketches`` once if ``needs_sketches``; then per round
    ``configure_round`` -> (clients train) -> ``aggregate`` (which screens the
    updates, then calls the subclass's ``aggregate_round``);
    ``model_for`` to evaluate a client; ``assign_late`` for a client that
    joins after clustering.

    Parameters
    ----------
    settings : TrainSettings, optional
        Local training settings sent with every task.
    fraction : float
        Fraction of the clients (of each cluster) sampled per round, in (0, 1].
    seed : int
        Seed of sampling and of any random initialisation.
    aggregator : {"fedavg", "trimmed-mean", "median"}
        How each model's updates are combined (:mod:`server_kit.robust`).
    norm_bound : float or None
        Clip updates above this multiple of the round's median update norm;
        0 or None: off. Default :data:`server_kit.robust.DEFAULT_NORM_BOUND`.
    trim_fraction : float
        ``beta`` of the trimmed mean, in (0, 0.5).
    refuse_above : float or None
        With ``norm_bound`` on, refuse updates above this multiple of the
        round's median update norm (0 or None: only non-finite ones).
        Default :data:`server_kit.robust.DEFAULT_REFUSE_ABOVE`.
    """

    name: str = "base"
    #: Whether the drivers collect one summary per client before training
    #: and hand them to :meth:`on_sketches`.
    needs_sketches: bool = False
    #: Which summary: "sketch" (bits, :class:`edge_sdk.sketch.Sketch`) or a key
    #: of :data:`edge_sdk.features.SUMMARIES` (a float32 array per client).
    summary_kind: str = "sketch"
    #: Keyword arguments of the client-side summary function.
    summary_params: Mapping[str, Any] = {}

    def __init__(self, *, settings: TrainSettings | None = None, fraction: float = 1.0, seed: int = 0,
                 aggregator: str = "fedavg", norm_bound: float | None = DEFAULT_NORM_BOUND,
                 trim_fraction: float = DEFAULT_TRIM_FRACTION,
                 refuse_above: float | None = DEFAULT_REFUSE_ABOVE) -> None:
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        self.robust = RobustConfig(aggregator=aggregator, norm_bound=norm_bound, trim_fraction=trim_fraction,
                                   refuse_above=refuse_above)
        self.settings = settings or TrainSettings()
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.clients: dict[str, ClientInfo] = {}
        self.models: dict[str, dict[str, np.ndarray]] = {}

    # -- lifecycle -------------------------------------------------------
    def setup(self, clients: Sequence[ClientInfo], template: Weights) -> None:
        """Register the clients known at the start and the initial weights."""
        self.clients = {c.cid: c for c in clients}
        self._template = copy_weights(template)
        self.models = {self.default_key: copy_weights(template)}

    default_key: str = "global"

    def on_sketches(self, sketches: Mapping[str, Any]) -> dict[str, int]:
        """Cluster before training from the clients' summaries. Default: nothing to do."""
        return {}

    @abstractmethod
    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        """The tasks of round ``rnd`` for some of the ``available`` clients."""

    @abstractmethod
    def aggregate_round(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        """Combine the round's updates; returns a summary for the logs.

        Subclasses combine each model's updates with :meth:`new_aggregator`
        (the run's FedAvg, trimmed mean or median). Drivers call
        :meth:`aggregate`, which screens the updates first.
        """

    def aggregate(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        """Screen the round's updates, then :meth:`aggregate_round` the rest; what drivers call.

        Screening, against the models the updates started from
        (``self.models[u.model_key]``, before aggregation): sample counts
        above the client's registered count are capped at it; with norm
        bounding on, updates whose delta norm is not finite or above
        ``refuse_above`` times the median of all the round's update norms are
        refused, and those above ``norm_bound`` times it are clipped onto that
        bound (:func:`server_kit.robust.screen_updates`).

        Returns
        -------
        dict
            The summary of :meth:`aggregate_round` plus ``clipped``,
            ``refused_norm``, ``capped_samples``, ``norm_median``,
            ``norm_max_ratio`` (largest finite norm over the median),
            ``norm_bound`` and ``refuse_bound`` (absolute, None when off) and
            ``aggregator``.
        """
        registered = {cid: c.n_samples for cid, c in self.clients.items()}
        capped_updates, capped = cap_samples(updates, registered)
        screened, report = screen_updates(capped_updates, self.models, self.robust.norm_bound,
                                          refuse_above=self.robust.refuse_above, rnd=rnd)
        summary = dict(self.aggregate_round(rnd, screened))
        summary.update(report.as_dict())
        summary["capped_samples"] = capped
        summary["aggregator"] = self.robust.aggregator
        return summary

    def new_aggregator(self, template: Weights, *, include: Sequence[str] | None = None
                       ) -> StreamingFedAvg | CoordinateAggregator:
        """An empty aggregator of the run's rule for ``template`` (see :func:`server_kit.robust.make_aggregator`)."""
        return make_aggregator(template, self.robust, include=include)

    def model_key_for(self, cid: str) -> str:
        """The model a client is evaluated with."""
        return self.default_key

    def model_for(self, cid: str) -> tuple[str, dict[str, np.ndarray]]:
        key = self.model_key_for(cid)
        return key, self.models[key]

    def assign_late(self, cid: str, sketch: Sketch | None = None, info: ClientInfo | None = None) -> str:
        """Admit a client that joined after the start; returns its model key."""
        if info is not None:
            self.clients[cid] = info
        return self.model_key_for(cid)

    def clusters(self) -> dict[str, int]:
        """Cluster index of every client (0 for all in a one-model method)."""
        return {cid: 0 for cid in self.clients}

    # -- helpers ------------------------------------------------------------
    def round_rng(self, rnd: int) -> np.random.Generator:
        """A generator derived from the seed and the round only (so a resumed run samples alike)."""
        return np.random.default_rng([self.seed, rnd])

    def sample(self, members: Sequence[str], rnd: int, salt: int = 0) -> list[str]:
        """``ceil(fraction * len(members))`` of ``members``, at least one, seeded by round."""
        pool = sorted(members)
        if not pool:
            return []
        m = max(1, math.ceil(self.fraction * len(pool)))
        if m >= len(pool):
            return pool
        rng = np.random.default_rng([self.seed, rnd, salt])
        return sorted(rng.choice(pool, size=m, replace=False).tolist())

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """JSON-able state and named tensors, for checkpoints."""
        tensors = {f"{key}/{name}": v for key, w in self.models.items() for name, v in w.items()}
        return {"name": self.name, "models": sorted(self.models)}, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        if meta.get("name") != self.name:
            raise ValueError(f"checkpoint is for strategy {meta.get('name')!r}, not {self.name!r}")
        models: dict[str, dict[str, np.ndarray]] = {k: {} for k in meta["models"]}
        for full, v in tensors.items():
            key, _, name = full.partition("/")
            models[key][name] = np.array(v)
        self.models = models


class FedAvg(Strategy):
    """Plain FedAvg (McMahan et al.): one model, a fraction of the clients per round."""

    name = "fedavg"

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        chosen = self.sample([c for c in available if c in self.clients], rnd)
        model = self.models[self.default_key]
        return [Task(cid, rnd, {self.default_key: model}, self.settings) for cid in chosen]

    def aggregate_round(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        agg = self.new_aggregator(self.models[self.default_key])
        accepted = add_updates(agg, updates, self.default_key)
        if accepted:
            self.models[self.default_key] = agg.result()
        return {"updates": accepted, "rejected": len(updates) - accepted}


def add_updates(agg: StreamingFedAvg | CoordinateAggregator, updates: Sequence[Update], key: str,
                only: Sequence[str] | None = None) -> int:
    """Add the updates for model ``key`` (restricted to parameter names ``only``); returns how many."""
    n = 0
    for u in updates:
        if u.model_key != key:
            continue
        w = u.weights if only is None else {k: u.weights[k] for k in only if k in u.weights}
        try:
            agg.add(w, u.n_samples)
            n += 1
        except ValueError as e:
            log.warning("round %d: update of %s for %s rejected: %s", u.round, u.cid, key, e)
    return n


class ClusteredFedAvg(Strategy):
    """FedAvg per cluster for a given assignment of clients to clusters.

    The base of every method that ends with one model per cluster. With
    ``shared_prefixes`` (for example the convolution layers of LeNet-5, as in
    the paper's reference setting), parameters whose name starts with one of
    them are averaged over all clients of the round, the rest per cluster.
    """

    name = "clustered"

    def __init__(self, *, shared_prefixes: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(**kw)
        self.shared_prefixes = tuple(shared_prefixes)
        self.assignment: dict[str, int] = {}

    @staticmethod
    def key(cluster: int) -> str:
        return f"c{int(cluster)}"

    def set_assignment(self, assignment: Mapping[str, int]) -> None:
        """Give every client a cluster; each cluster starts from the current global model."""
        self.assignment = {cid: int(k) for cid, k in assignment.items()}
        base = self.models.get(self.default_key) or next(iter(self.models.values()))
        for k in sorted(set(self.assignment.values())):
            self.models.setdefault(self.key(k), copy_weights(base))
        self.models.pop(self.default_key, None)

    def clusters(self) -> dict[str, int]:
        return dict(self.assignment) if self.assignment else super().clusters()

    def model_key_for(self, cid: str) -> str:
        if not self.assignment:
            return self.default_key
        if cid not in self.assignment:
            raise KeyError(f"client {cid!r} has no cluster")
        return self.key(self.assignment[cid])

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        if not self.assignment:
            chosen = self.sample([c for c in available if c in self.clients], rnd)
            return [Task(c, rnd, {self.default_key: self.models[self.default_key]}, self.settings) for c in chosen]
        tasks = []
        for k in sorted(set(self.assignment.values())):
            members = [c for c in available if self.assignment.get(c) == k]
            key = self.key(k)
            tasks += [Task(c, rnd, {key: self.models[key]}, self.settings) for c in self.sample(members, rnd, k + 1)]
        return tasks

    def _is_shared(self, name: str) -> bool:
        return bool(self.shared_prefixes) and name.startswith(self.shared_prefixes)

    def aggregate_round(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        accepted = 0
        for key in sorted(self.models):
            agg = self.new_aggregator(self.models[key])
            n = add_updates(agg, updates, key)
            accepted += n
            if n:
                self.models[key] = agg.result()
            summary[key] = n
        shared = [n for n in next(iter(self.models.values())) if self._is_shared(n)]
        if shared and len(self.models) > 1:
            template = {n: next(iter(self.models.values()))[n] for n in shared}
            agg = self.new_aggregator(template)
            n_shared = sum(add_updates(agg, updates, key, shared) for key in sorted(self.models))
            if n_shared:
                avg = agg.result()
                for key in self.models:
                    self.models[key].update({n: v.copy() for n, v in avg.items()})
            summary["shared"] = n_shared
        summary["updates"] = accepted
        summary["rejected"] = len(updates) - accepted
        return summary

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["assignment"] = dict(self.assignment)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        super().load_state(meta, tensors)
        self.assignment = {c: int(k) for c, k in meta.get("assignment", {}).items()}


class SketchClustered(ClusteredFedAvg):
    """Ours (Prigent et al.): cluster once, before training, from client sketches.

    Sketches are clustered by :class:`server_kit.clustering.SketchClustering`
    (popcount Hamming, Ward linkage built once, threshold by Bayesian
    optimisation of the Calinski-Harabasz index); then FedAvg per cluster. A
    late client's sketch joins the nearest cluster centroid.
    """

    name = "fedsketch"
    needs_sketches = True

    def __init__(self, *, min_cluster_size: int = 2, clustering: Mapping[str, Any] | None = None,
                 pretrain: Mapping[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.min_cluster_size = int(min_cluster_size)
        self.clustering_params = dict(clustering or {})
        #: Federated AE pre-training settings (see :func:`pretrain_config`), or None: the
        #: drivers then sketch with the server's encoder as shipped.
        self.pretrain: dict[str, Any] | None = None if pretrain is None else pretrain_config(pretrain)
        self.model_: Any = None

    def on_sketches(self, sketches: Mapping[str, Sketch]) -> dict[str, int]:
        from .clustering import SketchClustering

        if not sketches:
            raise ValueError("no sketches to cluster")
        cids = sorted(sketches)
        first = sketches[cids[0]]
        packed = stack_sketches([sketches[c] for c in cids])
        self.model_ = SketchClustering(
            min_cluster_size=self.min_cluster_size, random_state=self.seed, **self.clustering_params
        ).fit(packed, first.n_bits)
        assignment = {c: int(k) for c, k in zip(cids, self.model_.labels_)}
        log.info(
            "clustered %d sketches of %d bits into %d clusters (threshold %.3g)",
            len(cids), first.n_bits, self.model_.n_clusters_, self.model_.threshold_,
        )
        self.set_assignment(assignment)
        return assignment

    def assign_late(self, cid: str, sketch: Sketch | None = None, info: ClientInfo | None = None) -> str:
        if info is not None:
            self.clients[cid] = info
        if cid in self.assignment:
            return self.key(self.assignment[cid])
        if self.model_ is None or sketch is None:
            raise ValueError(f"late client {cid!r} needs a sketch and a fitted clustering")
        k = int(self.model_.predict(sketch.packed()[None])[0])
        self.assignment[cid] = k
        log.info("late client %s joins cluster %d (nearest centroid)", cid, k)
        return self.key(k)

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        if self.model_ is not None:
            tensors["_clustering/centroids"] = np.asarray(self.model_.centroids_, dtype=np.float64)
            meta["n_bits"] = int(self.model_.n_bits_)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        tensors = dict(tensors)
        centroids = tensors.pop("_clustering/centroids", None)
        super().load_state(meta, tensors)
        if centroids is not None:
            from .clustering import SketchClustering

            self.model_ = SketchClustering.from_centroids(np.asarray(centroids), int(meta["n_bits"]))


class FedAESketchClustered(SketchClustered):
    """Ours with federated autoencoder pre-training (paper, Section V).

    :class:`SketchClustered` whose drivers first train the sketch autoencoder
    by FedAvg over the clients' own images, export its encoder and send it to
    every client, which then sketches with it. ``pretrain`` defaults to
    :data:`PRETRAIN_DEFAULTS`, with the architecture of the server's encoder.
    """

    name = "fedsketch-fedae"

    def __init__(self, *, pretrain: Mapping[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(pretrain=dict(pretrain or {}), **kw)


STRATEGIES: dict[str, type[Strategy]] = {
    FedAvg.name: FedAvg,
    SketchClustered.name: SketchClustered,
    FedAESketchClustered.name: FedAESketchClustered,
}


from .strategies import LAZY_STRATEGIES  # noqa: E402  (the other methods, imported when asked for)


def strategy_names() -> list[str]:
    """Every strategy a user can pick."""
    return sorted(set(STRATEGIES) | set(LAZY_STRATEGIES))


def make_strategy(name: str, **kw: Any) -> Strategy:
    """A strategy by name (``fedavg``, ``fedsketch``, ``ifca``, ``ladd``, ...).

    ``architecture`` is context the drivers always know: it is passed only to
    strategies that take it (IFCA builds its K models from it). Any other
    keyword a strategy does not take is refused by the strategy itself.
    """
    import importlib

    if name in STRATEGIES:
        cls = STRATEGIES[name]
    elif name in LAZY_STRATEGIES:
        module, attr = LAZY_STRATEGIES[name]
        cls = getattr(importlib.import_module(module), attr)
    else:
        raise ValueError(f"unknown strategy {name!r}; choose one of {strategy_names()}")
    if "architecture" in kw and not _passes_through(cls, "architecture"):
        kw.pop("architecture")
    return cls(**kw)


def _passes_through(cls: type, name: str) -> bool:
    """Whether ``name`` is a parameter somewhere along the class's ``__init__`` chain."""
    import inspect

    return any(name in inspect.signature(c.__init__).parameters
               for c in cls.__mro__ if "__init__" in vars(c))
