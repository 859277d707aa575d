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
   cluster; :func:`edge_sdk.training.sampling.in_sample` tells the server and each
   device alike who is in it).

The orchestrator owns the order of these phases; each phase and each part is
in its module of this package. The parts are built and wired to each other
in one place, :func:`~.wiring.wire_run` (a :class:`~.wiring.RunParts`: the
link and its router, the fleet, the run's models, the intake, the delivery,
the assignments, the model service, the resketch, the aggregators' side and
the training round). Phase 1 is :func:`~.registration.register`, 2
:func:`~.ae_phase.pretrain_ae`, 3 :func:`~.sketch_phase.cluster_from_sketches`,
4 the :class:`~server_kit.rounds.training.TrainingRound` and 5
:func:`~.final_eval.final_evaluation`; the trained models in use (export,
keep, serving) are :class:`~server_kit.serving.service.ModelService`. The
phase itself is a :class:`~.phase.Phase`, moved only by :class:`~.phase.RunPhase`;
the run's own record and its checkpoints are :mod:`~.run_state`.

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

from ..strategies.base import Strategy
from .ae_phase import pretrain_ae
from .config import ServerConfig
from .device_table import DeviceTallies, device_rows, model_keys, most_watched
from .final_eval import final_evaluation
from .phase import Phase
from .registration import register, rejoin
from .remote import Ingest
from .result import RunResult
from .run_state import RunRecord, restore_run, save_run
from .sketch_phase import cluster_from_sketches
from .wiring import SecureSettings, wire_run

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
        ingest: Ingest | None = None,
        secure: SecureSettings | None = None,
    ) -> None:
        if ingest is not None and not set(ingest.workers) <= set(aggregators or ()):
            raise ValueError("the ingest workers must be among the aggregators (their keys)")
        self.strategy = strategy
        self.transport = transport
        self.config = config
        self.on_round = on_round
        #: What the run has done so far: its id, its rounds' records, its timings.
        self.record = RunRecord()
        self.parts = parts = wire_run(strategy, transport, config, run_id=lambda: self.record.run_id,
                                      write_state=self._write_state, template=template, aggregators=aggregators,
                                      ingest=ingest, secure=secure)
        self.topics, self.link, self.pace, self.run_models = parts.topics, parts.link, parts.pace, parts.run_models
        self.fleet, self.intake, self.delivery = parts.fleet, parts.intake, parts.delivery
        self.assignments, self.service, self.resketch = parts.assignments, parts.service, parts.resketch
        self.remote, self.router, self.training = parts.remote, parts.router, parts.training
        #: Refused messages per reason (logged once per sender and reason per interval).
        self.rejected: dict[str, int] = parts.rejections.counts
        #: Whether only aggregators take the devices' updates (ingest workers): the server does not subscribe.
        self.updates_elsewhere = ingest is not None
        #: What the rounds did with each device (rounds done, refusals, its last round's time).
        self.tallies = DeviceTallies()
        #: The final evaluation's record, once done.
        self.final: dict[str, Any] = {}

    @property
    def run_id(self) -> str:
        """The run's id, announced on the server's status topic (a resumed run keeps its checkpoint's)."""
        return self.record.run_id

    @property
    def training_round(self) -> int:
        """The training round the run is in (0 before training; the last one during and after the final
        evaluation, whose round on the wire is one more)."""
        return min(self.intake.round, self.config.rounds)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Each finished round's record (what ``results.json`` keeps)."""
        return self.record.history

    @property
    def clients(self) -> dict[str, Any]:
        """Admitted devices (:class:`~.fleet.ClientState` by id)."""
        return self.fleet.clients

    def _run_round(self, rnd: int) -> dict[str, Any]:
        t0 = time.monotonic()
        drift = self.resketch.before_round(rnd)  # fresh sketches, moves (a run that follows drift)
        report = self.training.run(rnd, self.fleet.trainable(), drift=None if drift is None else drift.to_dict(),
                                   started=t0)
        rec = report.to_dict()
        self.record.history.append(rec)
        self.tallies.add_round(rec)
        if self.config.checkpoint_dir:
            self._write_state(self.config.checkpoint_dir, rnd)
            self.export_models(Path(self.config.checkpoint_dir) / "models", rnd=rnd)
        if self.on_round:
            self.on_round(rec)
        log.info("round %d: %d/%d updates, loss %s", rnd, report.updates, report.tasked, report.loss)
        return rec

    def _write_state(self, folder: str | Path, rnd: int) -> None:
        save_run(folder, rnd, self.parts, self.strategy, self.config, self.record)

    def export_models(self, folder: str | Path, *, rnd: int | None = None) -> Any:
        """Export the run's models to ``folder`` (:meth:`ModelService.export`: an ``ExportedRun``); None if it
        failed (logged)."""
        return self.service.export(folder, rnd=rnd)

    def serve(self, seconds: float | None = None, *, from_export: bool = False,
              until: Callable[[], bool] | None = None) -> dict[str, list[str]]:
        """Serve the trained models to devices that arrive, for ``seconds`` (None: until interrupted) or until
        ``until()`` says so.

        After :meth:`run`; or, with ``from_export``, instead of it: the server's state is read from the
        export's ``server-state`` (``config.checkpoint_dir``) and nothing is trained. Returns the devices
        served, with the model keys each was sent (one, or all of them where the device chooses).
        """
        service = self.service
        if from_export:
            self.link.subscribe(("hello", "sketch", "status", "metrics"))
            last = restore_run(self.parts, self.strategy, self.config, self.record)
            service.offers_from_export(last)
            self.intake.run.enter(Phase.SERVE, rnd=last + 1)
        else:
            self.intake.run.enter(Phase.SERVE)
        self.link.announce(self.run_id, serving=True)
        log.info("serving %d model(s) of run %s to the devices that ask (%s)", len(service.offers), self.run_id,
                 f"for {seconds:g} s" if seconds is not None else "until interrupted")
        try:
            self.link.pump(until or (lambda: False), float("inf") if seconds is None else float(seconds))
        except KeyboardInterrupt:
            log.info("serving ends (interrupted)")
        self.link.announce(self.run_id, online=False)
        self.intake.run.enter(Phase.DONE)
        log.info("served %d device(s)", len(service.served))
        return dict(service.served)

    # -- the run ------------------------------------------------------------
    def _start(self) -> None:
        """A fresh run: registration, then (pre-training and) clustering, then each device told its model."""
        t0 = time.monotonic()
        register(self.parts, self.config, self.run_id)
        timings = self.record.timings
        timings["register_s"] = time.monotonic() - t0
        models = self.run_models
        self.strategy.setup([s.info for s in self.clients.values()], models.template)
        if models.portable_template:  # the devices build it: it goes free
            self.strategy.versions.note_initial(models.architecture, models.seed, models.template)
        capabilities = self.strategy.capabilities
        if capabilities.pretrain is not None:
            done = pretrain_ae(capabilities.pretrain, self.config, link=self.link, fleet=self.fleet,
                               intake=self.intake, delivery=self.delivery, models=self.run_models)
            self.record.pretrain_history = done.history
            timings["pretrain_s"] = done.seconds
        if capabilities.needs_sketches:
            timings["sketch_collect_s"], timings["clustering_s"] = cluster_from_sketches(
                self.parts, self.strategy, self.config)
        self.intake.run.enter(Phase.TRAIN, rnd=0)
        self.assignments.announce()

    def _resume(self) -> int:
        """A killed run, continued: its checkpoint, then the devices asked to say hello; returns its last round."""
        last = restore_run(self.parts, self.strategy, self.config, self.record)
        self.tallies = DeviceTallies.from_history(self.record.history)
        self.intake.run.enter(Phase.TRAIN, rnd=last)
        rejoin(self.parts, self.config, self.run_id)
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
            self.link.stop_devices(self.run_id, reason, failed=True)
            log.error("told the devices: %s", reason)
        except Exception as e:  # the transport itself failed: nothing more to tell
            log.warning("could not tell the devices that the run failed: %s", e)

    def _run(self, resume: bool) -> RunResult:
        t0 = time.monotonic()
        leaves = ("hello", "sketch", "status", "metrics") if self.updates_elsewhere else (
            "hello", "sketch", "update", "status", "metrics")
        self.link.subscribe(leaves)
        if self.remote is not None:
            self.link.subscribe_aggregators()
        start = self._resume() + 1 if resume else 1
        if not resume:
            self._start()
        self.link.pump(lambda: False, 0.2)
        self.delivery.await_confirmations(self.config.round_timeout_s)
        t_train = time.monotonic()
        for rnd in range(start, self.config.rounds + 1):
            self._run_round(rnd)
        models = self.run_models
        final = final_evaluation(self.config, self.strategy, architecture=models.architecture, link=self.link,
                                 fleet=self.fleet, intake=self.intake, assignments=self.assignments,
                                 delivery=self.delivery)
        timings = self.record.timings
        timings["training_s"] = time.monotonic() - t_train
        self.final = final.to_dict()
        self.service.keep(final)
        if self.config.checkpoint_dir:  # the checkpoint's export, now with the final evaluation's accuracies
            self.export_models(Path(self.config.checkpoint_dir) / "models")
        if self.config.stop_clients:
            self.link.stop_devices(self.run_id, "finished")
        self.intake.run.enter(Phase.DONE)
        timings["total_s"] = time.monotonic() - t0
        return self.result()

    def result(self, *, fleet_rows: int | None = None) -> RunResult:
        """What the run has done so far (the whole run once it is done): a :class:`~.result.RunResult`.

        On the driver's thread: the live page takes one between messages, with only the ``fleet_rows`` most
        refused and slowest devices in its ``fleet`` (None: every device).
        """
        fleet = self.fleet
        rows = None if fleet_rows is None else most_watched(self.tallies, fleet.clients, fleet_rows)
        assignment = self.strategy.clusters()
        return RunResult(
            strategy=self.strategy.name, assignment=assignment, history=list(self.history),
            final=dict(self.final),
            timings=dict(self.record.timings), rejected=dict(self.rejected), transport=self.transport.stats(),
            delivered=dict(self.delivery.delivered), pretrain=list(self.record.pretrain_history),
            encoder=self.run_models.encoder, architecture=self.run_models.architecture, refused=dict(fleet.refused),
            not_training=dict(fleet.not_training),
            dropped={c: f"offline since round {fleet.went_offline.get(c, 0)}"
                     for c, st in sorted(self.clients.items()) if not st.online},
            benched=dict(fleet.benched),
            drift=self.resketch.totals(self.history), run_id=self.run_id,
            devices={c: speed.to_dict() for c, speed in sorted(fleet.speeds.items())},
            phase=self.intake.phase.value, round=self.training_round,
            fleet={r.device: r.to_dict() for r in device_rows(
                fleet, model_keys(self.strategy, fleet.clients if rows is None else rows), self.tallies, rows)},
            privacy=self.parts.privacy(),
        )
