"""The one strategy interface of every federated-learning method, and the pieces all of them share.

A :class:`Strategy` decides who trains which model each round and how
updates are combined; a driver owns the loop and the messages. Two drivers
run the same strategy objects: the MQTT orchestrator
(:mod:`server_kit.drivers.orchestrator`) for real fleets and the in-process simulator
(:mod:`server_kit.drivers.simulate`) for research runs and tests.

The hooks cover the three families of the literature:

* clustering **before** training from client sketches (ours, LADD):
  ``needs_sketches = True`` and :meth:`Strategy.on_sketches`;
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_sdk.compress import Compression
from edge_sdk.compress.update_codec import with_delta
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
    ScreenReport,
    Verdict,
    apply_verdicts,
    cap_samples,
    judge_norms,
    make_aggregator,
    update_norms,
)
from ..rounds.arrivals import PartialSum

__all__ = ["RESKETCH_SALT", "SPARE_SALT", "ClientInfo", "Screening", "Strategy", "Weights", "add_updates",
           "copy_weights"]

log = logging.getLogger(__name__)

#: The salt of the seeded sample of devices asked for fresh sketches (:meth:`Strategy.resketch_clients`).
RESKETCH_SALT = 104729
#: The salt of the seeded choice of spare devices (:meth:`Strategy.plan_round`).
SPARE_SALT = 7919

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


@dataclass(frozen=True)
class Screening:
    """A round's screening, decided from the norms of every update: those the server holds and those held elsewhere.

    What :meth:`Strategy.screen` decided, before anything is combined: the
    server's own updates decompressed, capped and clipped (the refused left
    out), each update's verdict (the ones ingest workers hold too: the round
    tells each worker what to sum by them), and the figures of the screening.
    """

    #: The server's own updates, ready to combine.
    updates: list[Update]
    #: Each update's verdict (clip scale, or refused), by device, the updates held elsewhere included.
    verdicts: Mapping[str, Verdict]
    report: ScreenReport
    #: How many of the server's own updates had their sample count capped.
    capped: int
    #: Each device's registered sample count (the cap of the updates held elsewhere too).
    registered: Mapping[str, int]
    #: Whether updates held elsewhere (ingest workers) took part (their partial sums join the combination).
    held_elsewhere: bool = False


class Strategy(ABC):
    """Base of every method. Subclasses fill the hooks; drivers call them in order:

    ``setup`` once; ``on_sketches`` once if ``needs_sketches``; then per round
    ``configure_round`` -> (clients train) -> ``aggregate``, the one entry
    point of aggregation: it decompresses and screens the updates, calls the
    subclass's private hook ``_combine`` on the rest, then compresses the
    models' changes for the way down (:class:`server_kit.downstream.ModelVersions`);
    ``model_key_for`` (the model a client is evaluated with); ``assign_late`` for a client that
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
    compression : Compression or str, optional
        How updates come up and models go down (:class:`edge_sdk.compress.Compression`,
        or its text: ``"topk:0.01"``); default ``none``: whole float32 models both ways.
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
    #: Why the method cannot take compressed updates (None: it can): refused at start with this reason.
    refuses_compression: str | None = None
    #: Why the method cannot take partial sums from aggregators (None: it can; see :meth:`partials_refusal`).
    refuses_partials: str | None = None
    #: Whether a device picks its model among all of them (IFCA: the lowest loss on a local batch), which a
    #: device that arrives after training does too (:func:`server_kit.serving.handover.hand_over`).
    devices_choose_model: bool = False
    #: The federated pre-training of the sketches' autoencoder with the devices (its settings,
    #: :func:`server_kit.pretrain.settings.pretrain_config`), or None: the encoder is ready (shipped ONNX).
    pretrain: dict[str, Any] | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        for name in ("aggregate", "aggregate_round", "screen"):
            if name in cls.__dict__:
                raise TypeError(f"{cls.__name__} defines {name}: a strategy implements the private hook _combine; "
                                "Strategy.aggregate (decompression, screening, the models' versions) is the one "
                                "entry point and is not overridden")

    def __init__(self, *, settings: TrainSettings | None = None, fraction: float = 1.0, seed: int = 0,
                 aggregator: str = "fedavg", norm_bound: float | None = DEFAULT_NORM_BOUND,
                 trim_fraction: float = DEFAULT_TRIM_FRACTION,
                 refuse_above: float | None = DEFAULT_REFUSE_ABOVE,
                 compression: Compression | str | None = None) -> None:
        if not 0.0 < float(fraction) <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction!r}")
        comp = compression if isinstance(compression, Compression) else Compression.parse(compression or "none")
        if comp.enabled and self.refuses_compression:
            raise ValueError(f"strategy {self.name!r} cannot use --compress {comp}: {self.refuses_compression}")
        #: The models' versions and their compressed changes (nothing tracked with compression off).
        self.versions = ModelVersions(comp)
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

    #: Whether sketches sent during training (asked or unasked) are acted on (:meth:`on_resketch`).
    follows_drift: bool = False

    def resketch_due(self, rnd: int) -> bool:
        """Whether the drivers ask for fresh sketches before round ``rnd`` trains. Default: never."""
        return False

    def resketch_clients(self, rnd: int, candidates: Sequence[str]) -> list[str]:
        """Whom the drivers ask for a fresh sketch in round ``rnd``: a seeded share ``fraction`` of ``candidates``."""
        return self._sample(candidates, rnd, RESKETCH_SALT)

    def on_resketch(self, rnd: int, sketches: Mapping[str, Any]) -> dict[str, Any]:
        """Fresh sketches during training (asked, or sent unasked by a drifting device); a summary.

        Default: ignored (methods that do not follow drift).
        """
        return {}

    @abstractmethod
    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        """The tasks of round ``rnd`` for some of the ``available`` clients."""

    def plan_round(self, rnd: int, available: Sequence[str], over_select: float = 0.0) -> list[Task]:
        """:meth:`configure_round`'s tasks, plus spares: ``over_select`` more devices per group, where there are.

        A group is the devices offered the same models (one cluster's, or
        all of IFCA's K). A group whose round needs ``n`` devices gets
        ``ceil(n * (1 + over_select)) - n`` spares (as many as it has),
        seeded by round, from the available devices of the strategy not
        tasked yet whose model (:meth:`model_key_for`) the group offers;
        each spare gets its group's models and settings, marked
        ``Task.spare``. With 0 (the default) the tasks are
        :meth:`configure_round`'s, unchanged.
        """
        tasks = self.configure_round(rnd, available)
        if over_select <= 0 or not tasks:
            return tasks
        groups: dict[tuple[str, ...], list[Task]] = {}
        for t in tasks:
            groups.setdefault(t.group, []).append(t)
        taken = {t.cid for t in tasks}
        free = sorted(c for c in available if c not in taken and c in self.clients)
        spares: list[Task] = []
        for i, (group, members) in enumerate(sorted(groups.items())):
            want = math.ceil(len(members) * (1.0 + over_select) - 1e-9) - len(members)
            pool = [c for c in free if c not in taken and self._offers(c, group)]
            if want <= 0 or not pool:
                continue
            rng = np.random.default_rng([self.seed, rnd, SPARE_SALT, i])
            chosen = sorted(rng.choice(pool, size=min(want, len(pool)), replace=False).tolist())
            model = members[0]
            spares += [Task(c, rnd, model.models, model.settings, model.evaluate_first, spare=True) for c in chosen]
            taken.update(chosen)
        return tasks + spares

    def _offers(self, cid: str, group: tuple[str, ...]) -> bool:
        """Whether device ``cid`` belongs with a group offered the models ``group``."""
        try:
            return self.model_key_for(cid) in group
        except KeyError:  # a device without a cluster yet
            return False

    @abstractmethod
    def _combine(self, rnd: int, updates: Sequence[Update | PartialSum]) -> dict[str, Any]:
        """The private hook: combine the round's decompressed, screened updates; a summary for the logs.

        Subclasses combine each model's updates with :meth:`_new_aggregator`
        (the run's FedAvg, trimmed mean or median). Only :meth:`aggregate`
        calls it.
        """

    def _decompressed(self, updates: Sequence[Update]) -> list[Update]:
        """Compressed updates (a decoded ``delta``) as whole weights: the model they started from plus the delta."""
        out = []
        for u in updates:
            if u.delta is not None:
                base = self.models[u.model_key]
                u = dataclasses.replace(u, delta=None, weights=with_delta(base, u.delta))
            out.append(u)
        return out

    def partials_refusal(self) -> str | None:
        """Why this run cannot combine aggregators' partial sums (None: it can).

        A partial sum is a weighted mean: it serves FedAvg per model, not a
        method that reads each update, nor a median or trimmed mean.
        """
        if self.refuses_partials:
            return self.refuses_partials
        if self.robust.aggregator != "fedavg":
            return (f"the {self.robust.aggregator} of the updates needs every update, and an aggregator sends a "
                    "weighted sum (use --aggregator fedavg)")
        return None

    def screen(self, rnd: int, updates: Sequence[Update], *, held_norms: Mapping[str, float | None] | None = None,
               held_keys: Mapping[str, str] | None = None) -> Screening:
        """Decompress, cap and screen the round's updates (no I/O; :meth:`aggregate` then combines them).

        Compressed updates are decompressed against the models they started
        from (the drivers checked that each names the version of the round).
        Screening, against the models the updates started from
        (``self.models[u.model_key]``, before aggregation): sample counts
        above the client's registered count are capped at it; with norm
        bounding on, updates whose delta norm is not finite or above
        ``refuse_above`` times the median of all the round's update norms are
        refused, and those above ``norm_bound`` times it are clipped onto that
        bound (:func:`server_kit.robust.screen_updates`).

        ``held_norms`` and ``held_keys``: the norms and model keys of the
        updates ingest workers hold (their receipts). They join the round's,
        so the median and every decision are those of a server that held them
        all; the round then asks each worker for the sum of its kept updates
        (clipped as decided) and passes the partial sums to :meth:`aggregate`.
        """
        registered = {cid: c.n_samples for cid, c in self.clients.items()}
        capped_updates, capped = cap_samples(self._decompressed(updates), registered)
        norms = update_norms(capped_updates, self.models)
        keys = {u.cid: u.model_key for u in capped_updates}
        norms.update(held_norms or {})
        keys.update(held_keys or {})
        verdicts, report = judge_norms(norms, self.robust.norm_bound, refuse_above=self.robust.refuse_above,
                                       rnd=rnd, keys=keys)
        screened = apply_verdicts(capped_updates, self.models, verdicts, norms)
        return Screening(screened, verdicts, report, capped, registered, held_elsewhere=held_norms is not None)

    def aggregate(self, rnd: int, updates: Sequence[Update], *, screening: Screening | None = None,
                  partials: Sequence[PartialSum] = (), partials_capped: int = 0) -> dict[str, Any]:
        """The one entry point of aggregation, what drivers call: screen, combine, version.

        ``screening``: the round's :meth:`screen` of ``updates``, when it
        was decided before (the updates held elsewhere took part); None:
        screened here. ``partials``: the partial sums of the updates held
        elsewhere, summed by those verdicts (``partials_capped`` of their
        members' counts capped). The models equal those of one server that
        held every update, within float summation order.

        Returns
        -------
        dict
            The summary of :meth:`_combine` plus ``clipped``,
            ``refused_norm``, ``capped_samples``, ``norm_median``,
            ``norm_max_ratio`` (largest finite norm over the median),
            ``norm_bound`` and ``refuse_bound`` (absolute, None when off) and
            ``aggregator``; with updates held elsewhere ``partial_sums`` and
            ``summed_remote`` (the updates they carry).
        """
        judged = self.screen(rnd, updates) if screening is None else screening
        summary = dict(self._combine(rnd, [*judged.updates, *partials]))
        if judged.held_elsewhere:  # a partial sum counts once in _combine's summary: here, the updates it carries
            summary["partial_sums"] = len(partials)
            summary["summed_remote"] = sum(len(p.members) for p in partials)
        summary.update(judged.report.as_dict())
        summary["capped_samples"] = judged.capped + partials_capped
        summary["aggregator"] = self.robust.aggregator
        moved = self.versions.commit(self.models)
        if moved:
            summary["versions"] = moved
        return summary

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
        if self.versions.enabled:
            meta["versions"] = self.versions.state()
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

