"""The MQTT driver: a real federation of client processes behind a broker.

The :class:`Orchestrator` runs a :class:`~server_kit.strategies.base.Strategy` over
clients it reaches through a transport (:class:`edge_sdk.transport.MqttTransport`,
or its in-memory twin in unit tests):

1. registration: clients say hello (the server broadcasts a request, so
   clients started before it re-register); closed by quorum or deadline;
2. if the strategy pre-trains the sketch autoencoder (``strategy.capabilities.pretrain``,
   "fedsketch-fedae"): FedAvg rounds of the autoencoder over the clients'
   images (model key "ae"), then its encoder exported to ONNX and sent to
   every client (model key "encoder", raw .onnx bytes, sha256 in meta);
3. if the strategy clusters from sketches: ask every client for its sketch,
   collect until quorum or deadline, cluster once, tell each client its model;
4. rounds, each a :class:`~server_kit.rounds.training.TrainingRound` over
   :class:`~.round_port.MqttRoundPort`: (a strategy that follows drift: fresh
   sketches first, see :mod:`~server_kit.drivers.resketch`) the strategy's tasks plus spares
   (``over_select``), each client delivered the models it needs (see
   :mod:`~server_kit.drivers.delivery`) and commanded to train; updates
   collected until every group of the round has its report goal (then a
   grace for the stragglers; a refused update counts as its device's
   answer), nobody is left to wait for (a device that vanished, announced
   by its last will, is not waited for), or the deadline (see :mod:`~server_kit.rounds.closing`); aggregate, checkpoint;
   a device refused round after round is benched (:mod:`~server_kit.rounds.pace`);
5. a final evaluation: one broadcast ``evaluate`` command (each device
   evaluates the model it was assigned), of all the assigned online devices
   or of a seeded sample of them (``eval_fraction``, at least one per
   cluster; :func:`edge_sdk.sampling.in_sample` tells the server and each
   device alike who is in it).

The orchestrator owns these phases and composes the rest, each in its module
of this package: a :class:`~.link.ServerLink` (sending, and the inbox pumped
through :class:`~.router.MessageRouter`), a :class:`~.fleet.Fleet` (the devices,
admitted or refused, online or not), :class:`~.models.RunModels` (encoder,
architecture, template), an :class:`~.intake.Intake` (the phase, and the
checks and records of what the devices send), a :class:`~.delivery.Delivery`
(the model topics each device follows, each model sent once or per device)
and :class:`~.assignment.Assignments` (which model each device is told);
phase 2 is :func:`~.ae_phase.pretrain_ae` and phase 5
:func:`~.final_eval.final_evaluation`; the trained models in use (export,
keep, serving) are :class:`~server_kit.serving.service.ModelService`. The
phase itself is a :class:`~.phase.Phase`, moved only by :class:`~.phase.RunPhase`.

Every message from a client is validated on arrival (envelope, sender vs
topic, registration, round, tensor names/shapes/dtypes, NaN); a bad one is
logged and counted, never fatal. State after every round goes to a
checkpoint folder (JSON + safetensors, :mod:`~server_kit.drivers.checkpoint`),
and :meth:`Orchestrator.run` with ``resume=True`` continues a killed server
from its last finished round.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np

from edge_sdk.install import install_hint
from edge_sdk.keep_offer import KeepOffer
from edge_sdk.protocol import Message, Topics
from edge_sdk.protocol.commands import Op
from edge_sdk.rejections import RejectionLog

from ..rounds.pace import Pace
from ..rounds.training import TrainingRound
from ..serving.export import ExportedRun
from ..serving.service import ModelService
from ..strategies.base import Strategy
from ..strategies.capabilities import partials_refusal
from .ae_phase import pretrain_ae
from .assignment import ASK_AGAIN_S, Assignments
from .checkpoint import read_checkpoint, read_encoder, write_checkpoint
from .config import ServerConfig
from .delivery import Delivery
from .final_eval import final_evaluation
from .fleet import ClientState, Fleet
from .intake import Intake
from .link import ServerLink, new_run_id
from .models import RunModels
from .phase import Phase
from .remote import RemoteRound
from .resketch import Resketch, drift_totals
from .result import RunResult
from .round_port import MqttRoundPort
from .router import MessageRouter

__all__ = ["Orchestrator", "ServerConfig"]

log = logging.getLogger(__name__)


class Orchestrator:
    """Drives a strategy over MQTT clients. See the module docstring."""

    def __init__(
        self,
        strategy: Strategy,
        transport: Any,
        config: ServerConfig,
        *,
        template: Mapping[str, np.ndarray] | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
        aggregators: Mapping[str, Any] | None = None,
        updates_elsewhere: bool = False,
        alive: Callable[[str], bool] | None = None,
    ) -> None:
        self.strategy = strategy
        self.transport = transport
        self.config = config
        self.topics = Topics(config.root, config.federation)
        self.on_round = on_round
        #: The run's id, announced on the server's status topic (a resumed run keeps its checkpoint's).
        self.run_id = new_run_id()
        self._rejections = RejectionLog(log)
        #: Refused messages per reason (logged once per sender and reason per interval).
        self.rejected: dict[str, int] = self._rejections.counts
        self.link = ServerLink(transport, self.topics, config.federation, handler=self._handle,
                               rejections=self._rejections, round_of=lambda: self.intake.round,
                               on_refused=lambda cid, reason: self.intake.refuse_update(cid, reason))
        #: The run's memory of its devices' pace: training times, broken promises, refusals in a row.
        self.pace = Pace(config.bench_after)
        self.run_models = RunModels(strategy, config.encoder, config.architecture, seed=config.seed,
                                    latent_dim=config.latent_dim, template=template)
        self.fleet = Fleet(self.link, config.num_classes, on_online=self._set_online)
        self.intake = Intake(self.link, strategy, self.run_models, config.num_classes, self.pace)
        self.delivery = Delivery(self.link, config.model_delivery, self.fleet.online)
        #: Bytes of models (and encoders) the clients downloaded, per kind (see :mod:`~server_kit.drivers.delivery`).
        self.delivered: dict[str, int] = self.delivery.delivered
        #: Devices refused at registration, with the reason they were told.
        self.refused: dict[str, str] = self.fleet.refused
        #: Admitted devices left out of training, with the reason.
        self.not_training: dict[str, str] = self.fleet.not_training
        self.history: list[dict[str, Any]] = []
        self.timings: dict[str, float] = {}
        self.pretrain_history: list[dict[str, Any]] = []
        self.assignments = Assignments(strategy, config, self.link, self.fleet, self.intake, self.delivery,
                                       self.run_models)
        #: The trained models in use: exported, kept by the devices, handed to newcomers while serving.
        self.service = ModelService(strategy=strategy, config=config, link=self.link, fleet=self.fleet,
                                    delivery=self.delivery, assignments=self.assignments, intake=self.intake,
                                    run_models=self.run_models, run_id=lambda: self.run_id,
                                    write_state=self._write_checkpoint, ask_again_s=ASK_AGAIN_S)
        self.resketch = Resketch(strategy, config, self.link, self.fleet, self.intake, self.assignments,
                                 self.delivery, self.round_deadline)
        #: The aggregators' side of the rounds (their receipts and partial sums), or None without aggregators.
        self.remote: RemoteRound | None = None
        #: Whether only aggregators take the devices' updates (ingest workers): the server does not subscribe.
        self.updates_elsewhere = bool(updates_elsewhere)
        if aggregators:
            why = partials_refusal(strategy.capabilities, strategy.robust.aggregator)
            if why:
                raise ValueError(f"strategy {strategy.name!r} cannot take partial sums from aggregators: {why}")
            transport.accept_aggregators(aggregators)
            self.remote = RemoteRound(self.link, self.intake, strategy, self.run_models, list(aggregators),
                                      timeout_s=config.partial_timeout_s, alive=alive)
        elif updates_elsewhere:
            raise ValueError("updates_elsewhere needs aggregators to take the updates")
        port = MqttRoundPort(strategy=strategy, config=config, link=self.link, fleet=self.fleet,
                             delivery=self.delivery, pace=self.pace, codec=self.intake.codec,
                             architecture=lambda: self.architecture, deadline=self.round_deadline, remote=self.remote)
        self.router = MessageRouter(strategy=strategy, link=self.link, fleet=self.fleet, intake=self.intake,
                                    delivery=self.delivery, assignments=self.assignments, resketch=self.resketch,
                                    run_models=self.run_models, remote=self.remote, hand_over=self._hand_over)
        #: The run's training rounds (:class:`~server_kit.rounds.training.TrainingRound`), their messages over MQTT.
        self.training = TrainingRound(strategy, self.intake, port, self.pace, over_select=config.over_select,
                                      report_goal=config.report_goal)

    # -- the run's devices and models ---------------------------------------
    @property
    def clients(self) -> dict[str, ClientState]:
        """Admitted devices."""
        return self.fleet.clients

    @property
    def sketches(self) -> dict[str, Any]:
        """Each client's summary (a sketch, or a float array)."""
        return self.intake.sketches

    @property
    def encoder_name(self) -> str | None:
        """The encoder the clients sketch with (the federated one after pre-training); None until chosen."""
        return self.run_models.encoder

    @property
    def architecture(self) -> str | None:
        """The classifier architecture of the run; None until chosen (or when a template was given)."""
        return self.run_models.architecture

    @property
    def template(self) -> dict[str, np.ndarray] | None:
        """The initial weights of the classifier; None until chosen."""
        return self.run_models.template

    @property
    def models_chosen(self) -> bool:
        """Whether the run's models are chosen."""
        return self.run_models.chosen

    def online(self) -> list[str]:
        """Online admitted clients."""
        return self.fleet.online()

    def trainable(self) -> list[str]:
        """Online admitted clients that can train (a scan: once per phase, never per message)."""
        return self.fleet.trainable()

    def _set_online(self, cid: str, online: bool) -> None:
        """The fleet's listener: the pending follow confirmations and the phase's wait, in step (O(1))."""
        self.delivery.set_online(cid, online)
        self.intake.set_online(cid, online)

    def _choose_models(self) -> None:
        """After registration: the models of the run, then each waiting device admitted or refused."""
        fleet = self.fleet
        if not self.models_chosen:
            from ..admission import choose_models

            enc, arch, how = choose_models(fleet.pending, self.encoder_name, self.architecture)
            self.run_models.use(enc, arch, how)
        for cid in sorted(fleet.pending):
            fleet.admit(cid, fleet.pending.pop(cid), self.run_models, registering=self.intake.phase.registering)

    # -- message handling -----------------------------------------------
    def _handle(self, topic: str, msg: Message) -> None:
        """The link's handler: each message to whom it concerns (:class:`~.router.MessageRouter`)."""
        self.router.route(topic, msg)

    # -- phases -------------------------------------------------------------
    def _register(self) -> None:
        t0 = time.monotonic()
        self.link.announce(self.run_id)
        self.link.broadcast(Op.HELLO)
        need = self.config.min_clients
        quorum = max(1, int(np.ceil(self.config.register_quorum * need)))
        fleet = self.fleet

        def count() -> int:
            return len(fleet.clients) + len(fleet.pending)

        ok = self.link.pump(lambda: count() >= need, self.config.register_timeout_s)
        # let stragglers of the same start register too (short grace)
        self.link.pump(lambda: False, 0.5)
        if not ok:
            if count() < quorum:
                raise TimeoutError(
                    f"only {count()} of the {need} clients needed registered within "
                    f"{self.config.register_timeout_s:g} s (at least {quorum} to start: --register-quorum)")
            log.warning("registration deadline: starting with %d of the %d clients asked for (quorum %d)",
                        count(), need, quorum)
        self._choose_models()
        self.timings["register_s"] = time.monotonic() - t0
        if len(self.clients) < quorum:
            raise RuntimeError(f"only {len(self.clients)} client(s) admitted, {quorum} needed; refused: "
                               + "; ".join(f"{c}: {r}" for c, r in sorted(self.refused.items())))
        if not self.trainable():
            raise RuntimeError(f"none of the {len(self.clients)} admitted clients can train "
                               f"({'; '.join(f'{c}: {r}' for c, r in sorted(self.not_training.items()))}): "
                               f"install torch on the devices ({install_hint('train')})")
        log.info("registration closed: %d clients admitted (%d train)%s", len(self.clients),
                 len(self.trainable()), f", {len(self.refused)} refused" if self.refused else "")


    def _cluster(self) -> None:
        t0 = time.monotonic()
        self.intake.run.enter(Phase.CLUSTER, rnd=0)
        cids = self.online()
        awaited = self.intake.expect("sketch", cids, self.fleet.online_ids)
        for cid in cids:
            if cid in self.sketches:
                awaited.answer("sketch", cid)
        # the same request for every admitted device: one broadcast (a device not admitted ignores it)
        self.link.broadcast(Op.SKETCH, **self.assignments.sketch_request())
        need = max(1, int(np.ceil(self.config.sketch_quorum * len(cids))))
        self.link.pump(lambda: len(awaited.answered) >= need, self.config.sketch_timeout_s)
        got = {c: self.sketches[c] for c in cids if c in self.sketches}
        if len(got) < need:
            log.warning("sketch deadline: %d of %d sketches (quorum %d); clustering those", len(got), len(cids), need)
        if not got:
            raise TimeoutError("no sketch arrived before the deadline")
        self.timings["sketch_collect_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        self.strategy.on_sketches(got)
        self.timings["clustering_s"] = time.monotonic() - t1

    def _run_round(self, rnd: int) -> dict[str, Any]:
        t0 = time.monotonic()
        drift = self.resketch.before_round(rnd)  # fresh sketches, moves (a run that follows drift)
        report = self.training.run(rnd, self.trainable(), drift=drift, started=t0)
        rec = report.to_dict()
        self.history.append(rec)
        self._checkpoint(rnd)
        if self.on_round:
            self.on_round(rec)
        log.info("round %d: %d/%d updates, loss %s", rnd, report.updates, report.tasked, report.loss)
        return rec

    def round_deadline(self, rnd: int) -> float:
        """Seconds round ``rnd`` waits before it looks at progress reports.

        The first round includes every device's start-up (loading data, the
        first torch import): ``first_round_timeout_s`` (default 3 x
        ``round_timeout_s``). Later rounds wait ``round_timeout_s`` or twice
        the slowest update seen so far, whichever is longer.
        """
        c = self.config
        slowest = self.pace.slowest_s
        if rnd == 1 or not slowest:
            return c.first_round_timeout_s or 3 * c.round_timeout_s
        return max(c.round_timeout_s, 2 * slowest)

    # -- checkpoints ------------------------------------------------------
    def _checkpoint(self, rnd: int) -> None:
        if not self.config.checkpoint_dir:
            return
        self._write_checkpoint(self.config.checkpoint_dir, rnd)
        self.export_models(Path(self.config.checkpoint_dir) / "models", rnd=rnd)

    def _write_checkpoint(self, folder: str | Path, rnd: int) -> None:
        write_checkpoint(folder, rnd, self.strategy, history=self.history,
                         timings=self.timings, clients={c: s.info for c, s in self.clients.items()},
                         sketches=self.sketches, config=self.config, encoder=self.encoder_name,
                         architecture=self.architecture, latent_dim=self.run_models.latent,
                         pretrain_history=self.pretrain_history, fresh=self.resketch.pending(),
                         pace=self.pace.state(), run_id=self.run_id)

    @property
    def offers(self) -> dict[str, KeepOffer]:
        """Each model's figures (sha256, accuracy...): what the keep commands and the export give."""
        return self.service.offers

    @property
    def served(self) -> dict[str, list[str]]:
        """Devices served while serving (cold start), with the model keys sent (several: the device chooses)."""
        return self.service.served

    def export_models(self, folder: str | Path, *, rnd: int | None = None) -> ExportedRun | None:
        """Export the run's models to ``folder`` (:meth:`ModelService.export`); None if it failed (logged)."""
        return self.service.export(folder, rnd=rnd)

    def _hand_over(self, cid: str) -> None:
        """While serving: the device just placed (or known) is sent its model and told to keep it."""
        if self.intake.phase is Phase.SERVE:
            self.service.hand_over(cid)

    def serve(self, seconds: float | None = None, *, from_export: bool = False,
              until: Callable[[], bool] | None = None) -> dict[str, list[str]]:
        """Serve the trained models to devices that arrive, for ``seconds`` (None: until interrupted) or until
        ``until()`` says so.

        After :meth:`run`; or, with ``from_export``, instead of it: the server's state is read from the
        export's ``server-state`` (``config.checkpoint_dir``) and nothing is trained. Returns the devices
        served, with the model keys each was sent (one, or all of them where the device chooses).
        """
        if from_export:
            self.link.subscribe(("hello", "sketch", "status", "metrics"))
            last = self._restore()
            self.service.offers_from_export(last)
            self.intake.run.enter(Phase.SERVE, rnd=last + 1)
        else:
            self.intake.run.enter(Phase.SERVE)
        self.link.announce(self.run_id, serving=True)
        log.info("serving %d model(s) of run %s to the devices that ask (%s)", len(self.offers), self.run_id,
                 f"for {seconds:g} s" if seconds is not None else "until interrupted")
        try:
            self.link.pump(until or (lambda: False), float("inf") if seconds is None else float(seconds))
        except KeyboardInterrupt:
            log.info("serving ends (interrupted)")
        self.link.announce(self.run_id, online=False)
        self.intake.run.enter(Phase.DONE)
        log.info("served %d device(s)", len(self.served))
        return dict(self.served)

    def _restore(self) -> int:
        ck = read_checkpoint(self.config.checkpoint_dir or "")
        models = self.run_models
        arch = ck.architecture or models.architecture
        if not models.chosen or arch != models.architecture:
            models.use(ck.encoder or models.encoder, arch, "from the checkpoint")
        self.strategy.setup(list(ck.clients.values()), models.template)
        self.strategy.load_state(ck.strategy, ck.tensors)
        self.fleet.restore(ck.clients)
        self.pace.load_state(ck.pace)
        for cid, reason in self.pace.benched.items():
            self.fleet.bench(cid, reason)
        self.intake.sketches = ck.sketches
        self.resketch.restore(ck.fresh)
        self.history = ck.history
        self.timings = ck.timings
        self.run_id = ck.run_id or self.run_id
        self.pretrain_history = ck.pretrain_history
        models.encoder = ck.encoder or models.encoder
        if ck.latent_dim is not None:
            models.latent = ck.latent_dim
        encoder_msg = read_encoder(ck.path, models.encoder)  # the federated encoder, for late clients
        if encoder_msg is not None:
            models.encoder_msg = encoder_msg
        log.info("resumed from %s after round %d (%d clients known)", ck.path, ck.round, len(self.clients))
        return ck.round

    # -- the run ------------------------------------------------------------
    def _start(self) -> None:
        """A fresh run: registration, then (pre-training and) clustering, then each device told its model."""
        self._register()
        self.strategy.setup([s.info for s in self.clients.values()], self.template)
        pretrain = self.strategy.capabilities.pretrain
        if pretrain is not None:
            done = pretrain_ae(pretrain, self.config, link=self.link, fleet=self.fleet, intake=self.intake,
                               delivery=self.delivery, models=self.run_models)
            self.pretrain_history = done.history
            self.timings["pretrain_s"] = done.seconds
        if self.strategy.capabilities.needs_sketches:
            self._cluster()
        self.intake.run.enter(Phase.TRAIN, rnd=0)
        self.assignments.announce()

    def _resume(self) -> int:
        """A killed run, continued: its checkpoint, then the devices asked to say hello; returns its last round."""
        last = self._restore()
        self.intake.run.enter(Phase.TRAIN, rnd=last)
        self.link.announce(self.run_id)
        self.link.broadcast(Op.HELLO)
        self.link.pump(lambda: len(self.fleet.online_ids) >= min(self.config.min_clients, len(self.clients)),
                       self.config.register_timeout_s)
        self.link.pump(lambda: False, 0.5)
        return last

    def run(self, *, resume: bool = False) -> RunResult:
        """Run the federation; returns its :class:`~.result.RunResult` (assignment, history, final evaluation...).

        Whatever ends the run early (a deadline with nobody to cluster, a bad checkpoint, an error in a
        strategy, Ctrl-C) is told to the devices first, in a ``stop`` command with ``failed`` and the reason
        (signed like every command), then raised: no device waits in vain.
        """
        try:
            return self._run(resume)
        except (Exception, KeyboardInterrupt) as e:
            if self.config.stop_clients:
                self._tell_failure(e)
            raise

    def _tell_failure(self, error: BaseException) -> None:
        """Tell every device that the run failed, and why (best effort: the broker may be what failed)."""
        why = str(error) or type(error).__name__
        reason = (f"the server could not finish the run ({self.intake.phase.value} phase, round "
                  f"{self.intake.round}): {why}")[:300]
        try:
            self.link.broadcast(Op.STOP, reason=reason, failed=True, run=self.run_id)
            self.link.announce(self.run_id, online=False)
            log.error("told the devices: %s", reason)
        except Exception as e:  # the transport itself failed: nothing more to tell
            log.warning("could not tell the devices that the run failed: %s", e)

    def _run(self, resume: bool) -> RunResult:
        t0 = time.monotonic()
        leaves = ("hello", "sketch", "status", "metrics") if self.updates_elsewhere else (
            "hello", "sketch", "update", "status", "metrics")
        self.link.subscribe(leaves)
        if self.remote is not None:
            for leaf in ("receipt", "partial"):
                self.transport.subscribe(self.topics.aggregator("+", leaf), self.link.enqueue)
        start = self._resume() + 1 if resume else 1
        if not resume:
            self._start()
        self.link.pump(lambda: False, 0.2)
        self.delivery.await_confirmations(self.config.round_timeout_s)
        t_train = time.monotonic()
        for rnd in range(start, self.config.rounds + 1):
            self._run_round(rnd)
        final = final_evaluation(self.config, self.strategy, architecture=self.architecture, link=self.link,
                                 fleet=self.fleet, intake=self.intake, assignments=self.assignments,
                                 delivery=self.delivery)
        self.timings["training_s"] = time.monotonic() - t_train
        self.service.keep(final)
        if self.config.checkpoint_dir:  # the checkpoint's export, now with the final evaluation's accuracies
            self.export_models(Path(self.config.checkpoint_dir) / "models")
        if self.config.stop_clients:
            self.link.broadcast(Op.STOP, reason="finished", run=self.run_id)
            self.link.announce(self.run_id, online=False)
        self.intake.run.enter(Phase.DONE)
        self.timings["total_s"] = time.monotonic() - t0
        return RunResult(
            strategy=self.strategy.name, assignment=self.strategy.clusters(), history=self.history, final=final,
            timings=self.timings, rejected=dict(self.rejected), transport=self.transport.stats(),
            delivered=dict(self.delivered), pretrain=list(self.pretrain_history), encoder=self.encoder_name,
            architecture=self.architecture, refused=dict(self.refused), not_training=dict(self.not_training),
            dropped={c: f"offline since round {self.fleet.went_offline.get(c, 0)}"
                     for c, st in sorted(self.clients.items()) if not st.online},
            benched=dict(self.fleet.benched),
            drift=drift_totals(self.history) if self.resketch.follows else None, run_id=self.run_id,
            devices={c: speed.to_dict() for c, speed in sorted(self.fleet.speeds.items())},
        )
