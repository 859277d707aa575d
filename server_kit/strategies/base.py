"""The one strategy interface of every federated-learning method, and the pieces all of them share.

A :class:`Strategy` decides who trains which model each round and how
updates are combined; a driver owns the loop and the messages. Two drivers
run the same strategy objects: the MQTT orchestrator
(:mod:`server_kit.drivers.orchestrator`) for real fleets and the in-process simulator
(:mod:`server_kit.drivers.simulate`) for research runs and tests.

The hooks cover the three families of the literature:

* clustering **before** training from client sketches (ours, LADD):
  ``Capabilities(needs_sketches=True)`` and :meth:`Strategy.on_sketches`;
* clustering **during** training from model updates (CFL, OCFL, Briggs):
  its private hook ``_combine`` sees every update and may split clusters;
* clustering **every round** from client-side choices (IFCA):
  :meth:`Strategy.configure_round` offers several models per task and the
  client reports which one it trained (``Update.model_key``).

Strategies keep their state in plain data (JSON-able dicts and numpy
tensors) so a driver can checkpoint it after every round
(:meth:`Strategy.state` / :meth:`Strategy.load_state`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.compress import Compression
from edge_sdk.compress.update_codec import check_compression_pair, compression_for
from edge_sdk.sketch import Sketch
from edge_sdk.tasks import Task, TrainSettings, Update

from ..aggregate import StreamingFedAvg
from ..downstream import ModelVersions
from ..robust import (
    DEFAULT_NORM_BOUND,
    DEFAULT_REFUSE_ABOVE,
    DEFAULT_TRIM_FRACTION,
    CoordinateAggregator,
    RobustConfig,
    make_aggregator,
)
from ..rounds.arrivals import PartialSum
from ..rounds.judging import Aggregation, Screening, screen_round
from .capabilities import Capabilities
from .drift import DriftReport

if TYPE_CHECKING:
    from ..privacy.dp import DPFedAvg

__all__ = ["RESKETCH_SALT", "ClientInfo", "Strategy", "Weights", "add_updates", "copy_weights"]

log = logging.getLogger(__name__)

#: The salt of the seeded sample of devices asked for fresh sketches (:meth:`Strategy.resketch_asked`).
RESKETCH_SALT = 104729

#: A model's tensors by parameter name.
Weights = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class ClientInfo:
    """What the server knows of a registered client."""

    cid: str
    n_samples: int = 0
    classes_present: int = 0
    capabilities: tuple[str, ...] = ()
    extra: Mapping[str, Any] = field(default_factory=dict)


def copy_weights(w: Weights) -> dict[str, np.ndarray]:
    """A deep copy of a model's tensors (the strategies' models never share arrays with updates)."""
    return {k: np.array(v, copy=True) for k, v in w.items()}


def add_updates(agg: StreamingFedAvg | CoordinateAggregator, updates: Sequence[Update | PartialSum], key: str,
                only: Sequence[str] | None = None) -> int:
    """Add the updates for model ``key`` (restricted to parameter names ``only``); returns how many were accepted.

    A malformed update is refused by ``add``; one with NaN or Inf may be found only when the aggregator
    settles (``StreamingFedAvg(kernels="staged")``): both are logged alike and not counted. An update kept
    coded goes to ``StreamingFedAvg.add_coded`` (its codes decoded where the sums are; its aggregator's
    ``include`` selects the tensors as ``only`` does); a coordinate-wise rule gets it decoded on the host.
    """
    n = 0
    rounds: dict[str, int] = {}
    for u in updates:
        if u.model_key != key:
            continue
        coded = u.coded if isinstance(u, Update) else None
        try:
            if coded is not None and isinstance(agg, StreamingFedAvg):  # decoded where the sums are
                agg.add_coded(coded.frames, coded.method, coded.base, u.n_samples, tag=u.cid, factor=coded.factor)
            else:
                whole = coded.weights() if coded is not None else u.weights
                w = whole if only is None else {k: whole[k] for k in only if k in whole}
                agg.add(w, u.n_samples, tag=u.cid)
            n += 1
            rounds[u.cid] = u.round
        except ValueError as e:
            log.warning("round %d: update of %s for %s rejected: %s", u.round, u.cid, key, e)
    for refused in agg.settle():
        log.warning("round %d: update of %s for %s rejected: %s", rounds[refused.tag], refused.tag, key,
                    refused.message)
        n -= 1
    return n


def _compression(value: Compression | str | None, default: Compression | None = None) -> Compression:
    """A setting as a :class:`Compression`: given, its text parsed, or ``default`` (``none``) when None."""
    if isinstance(value, Compression):
        return value
    if value is None:
        return default if default is not None else Compression()
    return Compression.parse(value)


class Strategy(ABC):
    """Base of every method. Subclasses fill the hooks; drivers call them in order:

    ``setup`` once; ``on_sketches`` once if its :class:`~.capabilities.Capabilities`
    say ``needs_sketches``; then per round (a
    :class:`~server_kit.rounds.training.TrainingRound`) ``configure_round`` ->
    (clients train) -> ``aggregate``, the one entry point of aggregation: it
    screens the updates (:func:`~server_kit.rounds.judging.screen_round`),
    calls the subclass's private hook ``_combine`` on the rest, then
    compresses the models' changes for the way down
    (:class:`server_kit.downstream.ModelVersions`); ``model_key_for`` (the
    model a client is evaluated with); ``assign_late`` for a client that joins
    after clustering; ``resketch_asked`` and ``on_resketch`` for a method that
    follows drift. A strategy does no I/O: the drivers and the round do.

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
    compression : Compression or str, optional
        How updates come up and models go down (:class:`edge_sdk.compress.Compression`,
        or its text: ``"topk:0.01"``); default ``none``: whole float32 models both ways.
    compress_up, compress_down : Compression or str, optional
        One direction's method, instead of ``compression`` (``compress_up="stc:0.01"``,
        ``compress_down="sign"``).
    """

    name: str = "base"
    #: What the method can do and cannot take (:class:`~.capabilities.Capabilities`), declared once; a
    #: setting of the instance that changes it replaces it in ``__init__``.
    capabilities: Capabilities = Capabilities()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for name in ("aggregate", "aggregate_round"):
            if name in cls.__dict__:
                raise TypeError(f"{cls.__name__} defines {name}: a strategy implements the private hook _combine; "
                                "Strategy.aggregate (decompression, screening, the models' versions) is the one "
                                "entry point and is not overridden")

    def __init__(self, *, settings: TrainSettings | None = None, fraction: float = 1.0, seed: int = 0,
                 aggregator: str = "fedavg", norm_bound: float | None = DEFAULT_NORM_BOUND,
                 trim_fraction: float = DEFAULT_TRIM_FRACTION,
                 refuse_above: float | None = DEFAULT_REFUSE_ABOVE,
                 compression: Compression | str | None = None, compress_up: Compression | str | None = None,
                 compress_down: Compression | str | None = None) -> None:
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        both = _compression(compression)
        who, refusal = f"strategy {self.name!r}", self.capabilities.refuses_compression
        #: How the devices' updates come up (the devices are told it in each train command).
        self.compress_up = compression_for(_compression(compress_up, both), refusal, who)
        #: The models' versions and their compressed changes (nothing tracked with downstream compression off).
        self.versions = ModelVersions(compression_for(_compression(compress_down, both), refusal, who))
        check_compression_pair(self.compress_up, self.versions.compression, who)
        self.robust = RobustConfig(aggregator=aggregator, norm_bound=norm_bound, trim_fraction=trim_fraction,
                                   refuse_above=refuse_above)
        self.settings = settings or TrainSettings()
        self.fraction = float(fraction)
        self.seed = int(seed)
        self.clients: dict[str, ClientInfo] = {}
        self.models: dict[str, dict[str, np.ndarray]] = {}
        #: DP-FedAvg per model (``--dp-epsilon``: :class:`server_kit.privacy.dp.DPFedAvg`), set by the driver.
        self.dp: DPFedAvg | None = None

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

    def resketch_asked(self, rnd: int, candidates: Sequence[str]) -> list[str]:
        """Whom the drivers ask for a fresh sketch before round ``rnd`` trains, among ``candidates``. Default: nobody.

        A method that follows drift asks, in the rounds it wants fresh
        sketches, a seeded share ``fraction`` of the candidates
        (:meth:`_sample` with :data:`RESKETCH_SALT`).
        """
        return []

    def on_resketch(self, rnd: int, sketches: Mapping[str, Any]) -> DriftReport | None:
        """Fresh sketches during training (asked, or sent unasked by a drifting device); what they changed.

        Default: ignored, None (methods that do not follow drift).
        """
        return None

    @abstractmethod
    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        """The tasks of round ``rnd`` for some of the ``available`` clients."""

    @abstractmethod
    def _combine(self, rnd: int, updates: Sequence[Update | PartialSum]) -> dict[str, Any]:
        """The private hook: combine the round's decompressed, screened updates; a summary for the logs.

        Subclasses combine each model's updates with :meth:`_new_aggregator`
        (the run's FedAvg, trimmed mean or median). Only :meth:`aggregate`
        calls it.
        """

    def aggregate(self, rnd: int, updates: Sequence[Update], *, screening: Screening | None = None,
                  partials: Sequence[PartialSum] = (), partials_capped: int = 0) -> Aggregation:
        """The one entry point of aggregation, what a round calls: screen, combine, version.

        ``screening``: the round's :func:`~server_kit.rounds.judging.screen_round`
        of ``updates``, when it was decided before (the updates held elsewhere
        took part); None: screened here. ``partials``: the partial sums of the
        updates held elsewhere, summed by those verdicts (``partials_capped`` of
        their members' counts capped). The models equal those of one server
        that held every update, within float summation order. Returns what it
        did (:class:`~server_kit.rounds.judging.Aggregation`).
        """
        judged = screen_round(self, rnd, updates) if screening is None else screening
        dp, base = self.dp, {}
        if dp is not None:
            judged, partials, base = self._dp_clip(dp, rnd, judged, partials)
        combined = dict(self._combine(rnd, [*judged.updates, *partials]))
        if dp is not None:  # a secure sum counts its members (each clipped on its device)
            counts = Counter(u.model_key for u in judged.updates)
            counts.update({p.model_key: len(p.members) for p in partials})
            for key, n in counts.items():
                self.models[key] = dp.release(key, base[key], self.models[key], n)
        held = judged.held_elsewhere
        return Aggregation(combined=combined, screen=judged.report, capped_samples=judged.capped + partials_capped,
                           aggregator=self.robust.aggregator, versions=self.versions.commit(self.models),
                           partial_sums=len(partials) if held else None,
                           summed_remote=sum(len(p.members) for p in partials) if held else None)

    def _dp_clip(self, dp: DPFedAvg, rnd: int, judged: Screening, partials: Sequence[PartialSum]
                 ) -> tuple[Screening, list[PartialSum], dict[str, Weights]]:
        """The updates clipped and weighed alike for DP (:meth:`DPFedAvg.clip`), the secure sums of the models
        still within their budget (their devices clipped), and the models they all start from."""
        sizes = Counter(self.model_key_for(c) for c in self.clients)
        expected = {k: max(1, math.ceil(self.fraction * n)) for k, n in sizes.items()}
        for key in {u.model_key for u in judged.updates} | {p.model_key for p in partials}:
            dp.account(key, sizes.get(key, 0), expected.get(key, 1))
        kept = dp.clip(judged.updates, self.models, rnd, expected)
        sums = [p for p in partials if dp.admits(p.model_key, rnd)]
        base = {k: copy_weights(self.models[k]) for k in {u.model_key for u in kept} | {p.model_key for p in sums}}
        return dataclasses.replace(judged, updates=kept), sums, base

    def _new_aggregator(self, template: Weights, *, include: Sequence[str] | None = None
                       ) -> StreamingFedAvg | CoordinateAggregator:
        """An empty aggregator of the run's rule for ``template`` (see :func:`server_kit.robust.make_aggregator`)."""
        return make_aggregator(template, self.robust, include=include)

    def model_key_for(self, cid: str) -> str:
        """The model a client is evaluated with."""
        return self.default_key

    def assign_late(self, cid: str, sketch: Sketch | None = None, info: ClientInfo | None = None) -> str:
        """Admit a client that joined after the start; returns its model key."""
        if info is not None:
            self.clients[cid] = info
        return self.model_key_for(cid)

    def clusters(self) -> dict[str, int]:
        """Cluster index of every client (0 for all in a one-model method)."""
        return {cid: 0 for cid in self.clients}

    def is_clustered(self, cid: str) -> bool:
        """``cid in self.clusters()``, in O(1) (the drivers ask it per message)."""
        return cid in self.clients

    # -- helpers ------------------------------------------------------------
    def _sample(self, members: Sequence[str], rnd: int, salt: int = 0, fraction: float | None = None) -> list[str]:
        """``ceil(fraction * len(members))`` of ``members``, at least one, seeded by round.

        ``fraction`` defaults to the strategy's.
        """
        pool = sorted(members)
        if not pool:
            return []
        m = max(1, math.ceil((self.fraction if fraction is None else fraction) * len(pool)))
        if m >= len(pool):
            return pool
        rng = np.random.default_rng([self.seed, rnd, salt])
        return sorted(rng.choice(pool, size=m, replace=False).tolist())

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """JSON-able state and named tensors, for checkpoints."""
        tensors = {f"{key}/{name}": v for key, w in self.models.items() for name, v in w.items()}
        meta: dict[str, Any] = {"name": self.name, "models": sorted(self.models)}
        versions = self.versions.state()  # empty with compression off: nothing is versioned
        if versions:
            meta["versions"] = versions
        if self.dp is not None:  # a resumed run goes on spending the same budget, never a fresh one
            meta["dp"] = self.dp.state()
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        if meta.get("name") != self.name:
            raise ValueError(f"checkpoint is for strategy {meta.get('name')!r}, not {self.name!r}")
        models: dict[str, dict[str, np.ndarray]] = {k: {} for k in meta["models"]}
        for full, v in tensors.items():
            key, _, name = full.partition("/")
            models[key][name] = np.array(v)
        self.models = models
        self.versions.load_state(meta.get("versions", {}), models)
        if self.dp is not None:
            self.dp.load_state(meta.get("dp", {}))

