"""The in-process driver: the same strategies and client code, no broker.

For research runs and most tests. Each simulated client is an
:class:`edge_sdk.worker.LocalWorker`, exactly what a device runs behind the
MQTT client; the strategy object is the one the orchestrator drives. What the
simulator leaves out is the transport: messages, chunking, deadlines.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from edge_sdk.compress.frames import coded_change
from edge_sdk.compress.update_codec import InMemoryFeedback, device_feedback, update_codec
from edge_sdk.protocol import Kind, ProtocolError, sketch_body
from edge_sdk.protocol.commands import Op, build
from edge_sdk.sketch import Sketch, Sketcher
from edge_sdk.tasks import Task, Update
from edge_sdk.training.torch_support import resolve_device
from edge_sdk.worker import LocalWorker

from ..data.partition import ClientData
from ..metrics import (
    CommLedger,
    clustering_scores,
    final_accuracy,
    message_bytes,
    weights_message_bytes,
)
from ..privacy.sketch_report import sketch_privacy
from ..rounds.decoding import Decoding
from ..rounds.pace import Pace
from ..rounds.recorded import RecordedIntake
from ..rounds.training import RoundReport, TrainingRound
from ..strategies.base import ClientInfo, Strategy
from ..strategies.drift import DriftReport
from .sim_eval import DeviceEvaluation, mean_accuracy
from .sim_round import SimulatedPort
from .sim_training import RoundTraining

__all__ = ["RoundRecord", "SimulationResult", "Simulator"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundRecord:
    """One round in the simulator: the round's own report, and what only the simulator measures after it.

    ``accuracy`` and ``cluster_accuracy``: the mean local test accuracy of
    the round's devices with their models after the round, overall and per
    model. ``bytes_total`` is the ledger's total after the round: every byte
    in and out of the server since the start, the sketches (or pre-training)
    before round 1 included. ``seconds``: the round with its drift step.
    """

    report: RoundReport
    accuracy: float
    cluster_accuracy: dict[str, float]
    seconds: float
    bytes_total: int = 0

    @property
    def round(self) -> int:
        return self.report.round

    @property
    def sampled(self) -> int:
        """The devices tasked."""
        return self.report.tasked

    @property
    def summary(self) -> Mapping[str, Any]:
        """The round's ``summary`` record (:meth:`~server_kit.rounds.judging.Aggregation.to_dict`, drift included)."""
        return self.report.summary


@dataclass
class SimulationResult:
    """What a run did: per-round records, the final clusters and their scores, the bytes.

    ``bytes_before_training`` is the ledger's total before round 1: the
    clients' sketches or summaries and their requests, and any federated
    autoencoder pre-training (0 for a method that asks for neither).
    """

    strategy: str
    rounds: list[RoundRecord] = field(default_factory=list)
    assignment: dict[str, int] = field(default_factory=dict)
    ari: float | None = None
    scores: dict[str, float] = field(default_factory=dict)
    seconds_clustering: float = 0.0
    seconds_training: float = 0.0
    ledger: CommLedger = field(default_factory=CommLedger)
    #: Bytes spent following drift: fresh sketches asked and sent unasked, and their requests.
    drift_bytes: int = 0
    bytes_before_training: int = 0
    #: What the run gave away, as ``results.json``'s ``privacy`` (``sketch``: each client's sketch epsilon).
    privacy: dict[str, Any] = field(default_factory=dict)

    @property
    def accuracies(self) -> list[float]:
        return [r.accuracy for r in self.rounds]

    @property
    def final_accuracy(self) -> float | None:
        """Mean of the last 5 rounds (the paper's final accuracy)."""
        return final_accuracy(self.accuracies)

    def total_bytes(self) -> int:
        return self.ledger.total()

    def bytes_until(self, rnd: int) -> int:
        """Bytes in and out of the server up to the end of round ``rnd``.

        Round 0 is before training (:attr:`bytes_before_training`: sketches for
        a method that clusters from them). So the bytes a method spent until it
        clustered are ``bytes_until(cluster_round)``.

        Raises
        ------
        ValueError
            If ``rnd`` is negative, not an integer, or a round this run did not reach.
        """
        if isinstance(rnd, bool) or not isinstance(rnd, (int, np.integer)) or rnd < 0:
            raise ValueError(f"rnd must be a round number >= 0, got {rnd!r}")
        if rnd == 0:
            return self.bytes_before_training
        for r in self.rounds:
            if r.round == rnd:
                return r.bytes_total
        ran = f"rounds 1 to {self.rounds[-1].round}" if self.rounds else "no rounds"
        raise ValueError(f"round {rnd} was not run: this run has {ran}")


class Simulator:
    """Runs a strategy over in-process clients.

    Parameters
    ----------
    strategy : Strategy
        Any strategy of :mod:`server_kit.strategies`.
    clients : sequence of ClientData
        The federation's local datasets (with true groups for scoring).
    architecture : str
        Classifier architecture key (see :mod:`edge_sdk.training.nets`).
    encoder : optional
        The encoder used for sketches when the strategy needs them.
    flip_prob : float
        P of the clients' sketches.
    seed : int
        Seed of the initial model, client shuffling and sketches.
    progress : bool
        Show a progress bar over rounds.
    drift : DriftSchedule, optional
        Devices whose data changes during the run (:mod:`server_kit.data.drift`).
        A device whose data changed re-sketches (its own key) and sends the sketch
        unasked when it moved beyond flip noise (:class:`edge_sdk.drift.DriftWatch`),
        if the strategy follows drift.
    device : {"cpu", "cuda", "auto"}
        Where the devices train (default ``cpu``: bit for bit the same on
        every machine; ``auto``: CUDA when torch sees it).
    batched : bool, optional
        Train each round's tasks that share an architecture and settings
        together (:class:`~server_kit.drivers.sim_training.RoundTraining`);
        None: its default (batched on a GPU, one by one on the CPU).
    step : {"eager", "compile", "graphs"}
        How batched steps run (:class:`edge_sdk.training.batched_train.Step`;
        default eager: compiling takes seconds per shape).
    decode_updates : {"auto", "intake", "sum"}
        Where int8 and int4 updates are decoded, as the server's
        ``--decode-updates`` (:mod:`server_kit.rounds.decoding`).
    """

    def __init__(
        self,
        strategy: Strategy,
        clients: Sequence[ClientData],
        *,
        architecture: str,
        num_classes: int = 10,
        encoder: Any = None,
        flip_prob: float = 0.1,
        seed: int = 0,
        progress: bool = False,
        drift: Any = None,
        device: str = "cpu",
        batched: bool | None = None,
        step: str = "eager",
        decode_updates: str = "auto",
    ) -> None:
        self.strategy = strategy
        #: Where int8 and int4 updates are decoded, as the server's ``--decode-updates``.
        self.decoding = Decoding(decode_updates)
        #: Where the devices' training runs (``auto``, ``cpu``, ``cuda``), and whether a round's tasks train
        #: together (:class:`~server_kit.drivers.sim_training.RoundTraining`; None: its default).
        self.device, self.batched, self.step = device, batched, step
        #: How the run's updates come up, chosen once (the strategy's compression is set at its creation).
        self.codec = update_codec(strategy.compress_up)
        self.drift = drift
        self._watches: dict[str, Any] = {}
        self._sketchers: dict[str, Sketcher] = {}
        self._index = {c.cid: i for i, c in enumerate(clients)}
        self.data = {c.cid: c for c in clients}
        self.architecture = architecture
        self.num_classes = num_classes
        self.encoder = encoder
        self.flip_prob = flip_prob
        self.seed = seed
        self.progress = progress
        self.exported_encoder: Any = None
        self._encoder_tmp: tempfile.TemporaryDirectory[str] | None = None
        #: Compression on: each device's error feedback, and the model versions it holds.
        self._feedback: dict[str, InMemoryFeedback] = {}
        self._held: dict[str, dict[str, int]] = {}
        self.workers = {
            c.cid: LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test,
                               architecture=architecture, num_classes=num_classes, seed=seed * 1000 + i)
            for i, c in enumerate(clients)
        }

    def _summaries(self, s: Strategy) -> dict[str, Any]:
        """Every client's summary of the kind the strategy asks for (sketch bits or features)."""
        if s.capabilities.summary_kind == "sketch":
            if self.encoder is None:
                raise ValueError(f"strategy {s.name!r} needs sketches: give the simulator an encoder")
            sketches = {cid: w.sketch(self._sketcher(cid)) for cid, w in self.workers.items()}
            if s.capabilities.follows_drift:
                from edge_sdk.drift import DriftWatch

                for cid, sk in sketches.items():
                    self._watches[cid] = DriftWatch(self._sketcher(cid))
                    self._watches[cid].sent(sk)
            return sketches
        from edge_sdk.features import SUMMARIES

        if s.capabilities.summary_kind not in SUMMARIES:
            raise ValueError(f"unknown summary kind {s.capabilities.summary_kind!r}; known: {sorted(SUMMARIES)}")
        fn = SUMMARIES[s.capabilities.summary_kind]
        return {cid: fn(w.x, w.y, num_classes=w.num_classes, **dict(s.capabilities.summary_params))
                for cid, w in self.workers.items()}

    def _sketcher(self, cid: str) -> Sketcher:
        """Device ``cid``'s sketcher: its own flip key (``seed * 1000 + its index``) for the whole run."""
        if cid not in self._sketchers:
            i = self._index[cid]
            self._sketchers[cid] = Sketcher(self.encoder, self.num_classes, self.flip_prob, seed=self.seed * 1000 + i)
        return self._sketchers[cid]

    def _drift_step(self, rnd: int, s: Strategy, ledger: CommLedger, result: SimulationResult) -> DriftReport | None:
        """Before round ``rnd``: drifting data changes, fresh sketches (unasked and asked) reach the strategy."""
        fresh: dict[str, Sketch] = {}
        before = ledger.total()
        for cid, c in (self.drift.apply(self.data, rnd) if self.drift is not None else {}).items():
            self.data[cid] = c
            self.workers[cid].replace_data(c.x_train, c.y_train, c.x_test, c.y_test)
            watch = self._watches.get(cid)
            new = None if watch is None else watch.check(self.workers[cid].x, self.workers[cid].y)
            if new is not None:
                fresh[cid] = new
                log.info("round %d: device %s's data changed (%d bits from its last sketch): sketch sent unasked",
                         rnd, cid, watch.last.hamming(new))
        asked = s.resketch_asked(rnd, sorted(self.workers))
        if asked:
            ask = message_bytes(Kind.CMD, meta=build(Op.SKETCH, num_classes=self.num_classes,
                                                     flip_prob=self.flip_prob, summary="sketch"))
            ledger.add("CMD", "down", ask * len(asked), len(asked))
            fresh.update({cid: self.workers[cid].sketch(self._sketcher(cid)) for cid in asked})
        for sk in fresh.values():
            ledger.add("SKETCH", "up", message_bytes(Kind.SKETCH, sketch_body(sk)))
        report = s.on_resketch(rnd, fresh) if fresh else None
        for cid, sk in fresh.items():
            if cid in self._watches:
                self._watches[cid].sent(sk)
        result.drift_bytes += ledger.total() - before
        return report

    def _training(self) -> tuple[RoundTraining, Callable[[Strategy, Sequence[str]], tuple[float, dict[str, float]]]]:
        """The run's training and its rounds' evaluation; on a GPU both run there, each model once over its
        devices' test images (resident there), and the devices' choices are made there too."""
        on_card = DeviceEvaluation(self.workers, "cuda") if resolve_device(self.device) == "cuda" else None
        trainer = RoundTraining(self.workers, device=self.device, batched=self.batched, evaluation=on_card,
                                step=self.step)
        return trainer, on_card.mean_accuracy if on_card is not None else partial(mean_accuracy, self.workers)

    def run(self, rounds: int, *, stop: Callable[[Strategy, RoundRecord], bool] | None = None) -> SimulationResult:
        """Sketch (if the strategy asks), then train ``rounds`` rounds; score the final clusters.

        Parameters
        ----------
        rounds : int
            Rounds to run at most (0: only the sketches, if any).
        stop : callable, optional
            Called after each round with the strategy and the round's record;
            a true result ends the run there (for example once an
            update-based method has clustered: ``lambda s, r: s.cluster_round_
            is not None``).
        """
        from edge_sdk.training.trainer import initial_weights

        s = self.strategy
        infos = [ClientInfo(cid, **{k: v for k, v in w.hello().items() if k in ("n_samples", "classes_present")})
                 for cid, w in self.workers.items()]
        template = initial_weights(self.architecture, self.seed)
        s.setup(infos, template)
        s.versions.note_initial(self.architecture, self.seed, template)  # every device builds it: it goes free
        result = SimulationResult(strategy=s.name)
        t0 = time.perf_counter()
        ledger = result.ledger
        if s.capabilities.pretrain is not None:
            self._pretrain_encoder(s, ledger)
        if s.capabilities.needs_sketches:
            summaries = self._summaries(s)
            ask = message_bytes(Kind.CMD, meta=build(Op.SKETCH, num_classes=self.num_classes,
                                                     flip_prob=self.flip_prob, summary=s.capabilities.summary_kind))
            ledger.add("CMD", "down", ask, len(summaries))
            for v in summaries.values():
                if isinstance(v, Sketch):
                    ledger.add("SKETCH", "up", message_bytes(Kind.SKETCH, sketch_body(v)))
                else:
                    ledger.add("FEATURES", "up", weights_message_bytes(Kind.FEATURES, {"features": v},
                                                                       {"summary": s.capabilities.summary_kind}))
            sketched = {c: 1 for c, v in summaries.items() if isinstance(v, Sketch)}
            if sketched:
                first = next(v for v in summaries.values() if isinstance(v, Sketch))
                result.privacy["sketch"] = sketch_privacy(self.flip_prob, first.num_classes, first.latent_dim,
                                                          sketched)
            s.on_sketches(summaries)
        result.seconds_clustering = time.perf_counter() - t0
        result.bytes_before_training = ledger.total()
        cids = sorted(self.workers)
        intake = RecordedIntake()
        trainer, evaluate = self._training()
        port = SimulatedPort(intake, cids, count_tasks=lambda tasks: self._count_tasks(ledger, tasks),
                             train_round=lambda tasks: [self._uplink(t, u, ledger)
                                                        for t, u in zip(tasks, trainer.train(tasks))])
        training = TrainingRound(s, intake, port, Pace())
        bar = _progress(range(1, rounds + 1), f"{s.name} rounds", self.progress)
        t1 = time.perf_counter()
        for rnd in bar:
            tr = time.perf_counter()
            drift = self._drift_step(rnd, s, ledger, result)
            report = training.run(rnd, cids, drift=None if drift is None else drift.summary())
            acc, per = evaluate(s, [t.cid for t in port.tasks])
            record = RoundRecord(report, acc, per, time.perf_counter() - tr, ledger.total())
            result.rounds.append(record)
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(acc=f"{acc:.3f}")
            log.info("%s round %d: %d clients, mean accuracy %.4f, %d bytes so far", s.name, rnd, report.tasked, acc,
                     record.bytes_total)
            if s.dp is not None:
                result.privacy["dp"] = s.dp.to_dict()
            if stop is not None and stop(s, record):
                log.info("%s: stopped after round %d", s.name, rnd)
                break
        if hasattr(bar, "close"):
            bar.close()
        result.seconds_training = time.perf_counter() - t1
        result.assignment = s.clusters()
        truth = [self.data[c].group for c in cids]
        result.scores = clustering_scores(truth, [result.assignment.get(c, 0) for c in cids])
        result.ari = result.scores["ari"]
        return result

    def _pretrain_encoder(self, s: Strategy, ledger: CommLedger) -> None:
        """Federated AE pre-training (``strategy.capabilities.pretrain``); the exported encoder replaces ``self.encoder``."""
        from edge_sdk.encoder import OnnxEncoder

        from ..pretrain import export_encoder, federated_ae_pretrain
        from ..pretrain.settings import pretrain_config

        cfg = pretrain_config(s.capabilities.pretrain or {}, self.encoder)
        if cfg["architecture"] is None:
            raise ValueError(f"strategy {s.name!r} pre-trains an autoencoder: give its architecture "
                             "in pretrain or an encoder to take it from")
        cids = sorted(self.workers)
        per_round = max(1, math.ceil(cfg["fraction"] * len(cids)))
        res = federated_ae_pretrain([self.workers[c].x for c in cids], architecture=cfg["architecture"],
                                    rounds=cfg["rounds"], clients_per_round=per_round, epochs=cfg["epochs"],
                                    lr=cfg["lr"], batch_size=cfg["batch_size"], seed=self.seed,
                                    device=self.device)
        ledger.add("AE_MODEL", "down", res.bytes_down, cfg["rounds"] * per_round)
        ledger.add("AE_UPDATE", "up", res.bytes_up, cfg["rounds"] * per_round)
        ledger.add("CMD", "down", message_bytes(Kind.CMD, meta=build(
            Op.TRAIN_AE, round=1, architecture=cfg["architecture"], epochs=cfg["epochs"],
            lr=cfg["lr"], batch_size=cfg["batch_size"])) * cfg["rounds"] * per_round,
            cfg["rounds"] * per_round)
        self._encoder_tmp = tempfile.TemporaryDirectory(prefix="fedsketch-fedae-sim-")
        exp = export_encoder(res.weights, cfg["architecture"], self._encoder_tmp.name, name="fedae_sim",
                             metadata={"pretrain": cfg})
        enc_msg = message_bytes(Kind.MODEL, exp.path.read_bytes(), {
            "key": "encoder", "name": exp.name, "sha256": exp.sha256, "entry": exp.entry})
        ledger.add("ENCODER", "down", enc_msg * len(cids), len(cids))
        self.exported_encoder = exp
        self.encoder = OnnxEncoder(exp.name, models_dir=exp.models_dir)
        log.info("federated encoder: %d rounds, MSE %.5f, %d bytes", cfg["rounds"],
                 res.history[-1]["loss"], exp.nbytes)

    def _count_tasks(self, ledger: CommLedger, tasks) -> None:
        """A train command and every model offered, per client (IFCA offers K).

        With compression on, each model as the device would get it: the chain of
        changes since the version it holds, or the whole model
        (:meth:`server_kit.downstream.ModelVersions.payload`); it then holds the current version.
        """
        versions = self.strategy.versions
        comp = self.codec.command_meta
        versions.sync(self.strategy.models)
        for t in tasks:
            ledger.add("CMD", "down", message_bytes(Kind.CMD, meta=build(
                Op.TRAIN, round=t.round, models=sorted(t.models), **comp, **t.settings.to_dict())))
            held = self._held.setdefault(t.cid, {})
            for key, w in t.models.items():
                meta, body = versions.payload(key, held.get(key), w)  # whole, the same bytes, with compression off
                ledger.add("MODEL", "down", message_bytes(Kind.MODEL, body, meta))
                held[key] = versions.version.get(key)  # None: models go whole (no versions)

    def _uplink(self, task: Task, u: Update, ledger: CommLedger) -> Update:
        """A trained update as the server gets it: whole, or its delta compressed with the device's feedback.

        The bytes counted are those of the real encoded body (the run's
        :class:`~edge_sdk.compress.update_codec.UpdateCodec`, what a device sends).
        """
        versions = self.strategy.versions
        feedback = self._feedback.setdefault(u.cid, InMemoryFeedback(device_feedback(self.codec.compression)))
        start = task.models.get(u.model_key) or next(iter(task.models.values()))  # a hostile worker's other key
        body, extra, sent = self.codec.encode(u.model_key, u.weights, start, versions.version.get(u.model_key), feedback)
        loss = u.loss if math.isfinite(u.loss) else 0.0  # a hostile worker's inf is not JSON: a number's bytes
        meta = {"round": u.round, "model_key": u.model_key, "n_samples": u.n_samples, "loss": loss,
                "metrics": dict(u.metrics), **extra}
        ledger.add("UPDATE", "up", message_bytes(Kind.UPDATE, body, meta))
        if sent is None:
            return u
        if self.decoding.at_sum(self.strategy, self.codec):  # the body's codes kept for the sum, as at intake
            spec = {k: (np.shape(v), np.asarray(v).dtype.name) for k, v in start.items()}
            try:
                coded = coded_change(body, spec, self.codec.compression.method)
                return dataclasses.replace(u, weights={}, version=extra["version"], coded=coded)
            except ProtocolError:  # a hostile worker's body (a scale not finite): screened as its decoded delta
                pass
        return dataclasses.replace(u, weights={}, delta=sent, version=extra["version"])



def _progress(it, desc: str, enabled: bool):
    if not enabled:
        return it
    try:
        from tqdm.auto import tqdm

        return tqdm(it, desc=desc, leave=False)
    except ImportError:  # pragma: no cover
        return it
