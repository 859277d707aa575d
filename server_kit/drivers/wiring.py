"""The parts of one MQTT run, built and wired to each other in one place.

:func:`wire_run` builds what the :class:`~.orchestrator.Orchestrator` drives
and hands back a :class:`RunParts`: the :class:`~.link.ServerLink` (sending,
and the inbox pumped through the :class:`~.router.MessageRouter`), the
:class:`~.fleet.Fleet`, the :class:`~.models.RunModels`, the
:class:`~.intake.Intake`, the :class:`~.delivery.Delivery`, the
:class:`~.assignment.Assignments`, the :class:`~server_kit.serving.service.ModelService`,
the :class:`~.resketch.Resketch`, the aggregators' :class:`~.remote.RemoteRound`
(with aggregators only) and the run's :class:`~server_kit.rounds.training.TrainingRound`
over an :class:`~.round_port.MqttRoundPort`. Every callback between the parts
is made here, so no part reaches into the orchestrator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.protocol import Message, Topics
from edge_sdk.rejections import RejectionLog

from ..privacy.record import privacy_record
from ..privacy.secure_sum import SecureSettings, SecureSums
from ..rounds.pace import Pace
from ..rounds.training import TrainingRound
from ..serving.service import ModelService
from ..strategies.base import Strategy
from ..strategies.capabilities import partials_refusal
from .assignment import ASK_AGAIN_S, Assignments
from .config import ServerConfig
from .delivery import Delivery
from .fleet import Fleet
from .intake import Intake
from .link import ServerLink
from .models import RunModels
from .phase import Phase
from .remote import Ingest, RemoteRound
from .resketch import Resketch
from .round_port import MqttRoundPort
from .router import MessageRouter

__all__ = ["RunParts", "round_deadline", "wire_run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunParts:
    """What one MQTT run is made of (see the module docstring)."""

    topics: Topics
    rejections: RejectionLog
    link: ServerLink
    pace: Pace
    run_models: RunModels
    fleet: Fleet
    intake: Intake
    delivery: Delivery
    assignments: Assignments
    service: ModelService
    resketch: Resketch
    #: The aggregators' side of the rounds (their receipts and partial sums), or None without aggregators.
    remote: RemoteRound | None
    router: MessageRouter
    #: The run's training rounds, their messages over MQTT.
    training: TrainingRound

    #: The run's settings.
    config: ServerConfig

    def privacy(self) -> dict[str, Any]:
        """What the run gave away so far (:func:`server_kit.privacy.record.privacy_record`)."""
        return privacy_record(self.intake.strategy, self.intake, self.config.flip_prob, self.config.num_classes,
                              self.run_models.latent)


def round_deadline(config: ServerConfig, pace: Pace) -> Callable[[int], float]:
    """``deadline(rnd)``: the seconds round ``rnd`` waits before it looks at progress reports.

    The first round includes every device's start-up (loading data, the
    first torch import): ``first_round_timeout_s`` (default 3 x
    ``round_timeout_s``). Later rounds wait ``round_timeout_s`` or twice
    the slowest update seen so far, whichever is longer.
    """
    def deadline(rnd: int) -> float:
        slowest = pace.slowest_s
        if rnd == 1 or not slowest:
            return config.first_round_timeout_s or 3 * config.round_timeout_s
        return max(config.round_timeout_s, 2 * slowest)
    return deadline


def _no_router(topic: str, msg: Message) -> None:
    raise RuntimeError("a message reached the link before its router was wired")


def wire_run(strategy: Strategy, transport: Any, config: ServerConfig, *, run_id: Callable[[], str],
             write_state: Callable[[str | Path, int], None], template: Mapping[str, np.ndarray] | None = None,
             aggregators: Mapping[str, Any] | None = None, ingest: Ingest | None = None,
             secure: SecureSettings | None = None) -> RunParts:
    """Build the parts of a run of ``strategy`` over ``transport``, wired to each other.

    ``run_id()``: the run's id now (a resumed run takes its checkpoint's);
    ``write_state(folder, rnd)``: writes the server's state (the export's
    ``server-state``). With ``aggregators`` (their public keys by id), the
    transport accepts their signed messages and the rounds take their
    receipts and partial sums; a strategy that cannot combine partial sums is
    refused here. With ``ingest`` (some of those aggregators are ingest
    workers), devices send their updates to the workers' partitions. With
    ``secure``, each cluster's round is summed by secure aggregation.
    """
    if aggregators:
        why = partials_refusal(strategy.capabilities, strategy.robust.aggregator)
        if why:
            raise ValueError(f"strategy {strategy.name!r} cannot take partial sums from aggregators: {why}")
    topics = Topics(config.root, config.federation)
    rejections = RejectionLog(log)
    def set_online(cid: str, online: bool) -> None:  # the pending follow confirmations and the phase's wait
        delivery.set_online(cid, online)
        intake.set_online(cid, online)

    # the link hands every message to the router, built below from the parts that need the link
    link = ServerLink(transport, topics, config.federation, handler=_no_router, rejections=rejections,
                      round_of=lambda: intake.round, on_refused=lambda cid, reason: intake.refuse_update(cid, reason))
    pace = Pace(config.bench_after)
    run_models = RunModels(strategy, config.encoder, config.architecture, seed=config.seed,
                           latent_dim=config.latent_dim, template=template)
    fleet = Fleet(link, config.num_classes, on_online=set_online)
    intake = Intake(link, strategy, run_models, config.num_classes, pace, config.decode_updates)
    delivery = Delivery(link, config.model_delivery, fleet.online)
    deadline = round_deadline(config, pace)
    assignments = Assignments(strategy, config, link, fleet, intake, delivery, run_models)
    service = ModelService(strategy=strategy, config=config, link=link, fleet=fleet, delivery=delivery,
                           assignments=assignments, intake=intake, run_models=run_models, run_id=run_id,
                           write_state=write_state, ask_again_s=ASK_AGAIN_S)
    resketch = Resketch(strategy, config, link, fleet, intake, assignments, delivery, deadline)
    remote = None
    if aggregators:
        transport.accept_aggregators(aggregators)
        remote = RemoteRound(link, intake, strategy, run_models, aggregators, timeout_s=config.partial_timeout_s,
                             ingest=ingest)

    def hand_over(cid: str) -> None:  # while serving: a device just placed (or known) gets its model and a keep
        if intake.phase is Phase.SERVE:
            service.hand_over(cid)

    port = MqttRoundPort(strategy=strategy, config=config, link=link, fleet=fleet, delivery=delivery, pace=pace,
                         codec=intake.codec, architecture=lambda: run_models.architecture, deadline=deadline,
                         remote=remote)
    router = MessageRouter(strategy=strategy, link=link, fleet=fleet, intake=intake, delivery=delivery,
                           assignments=assignments, resketch=resketch, run_models=run_models, remote=remote,
                           hand_over=hand_over)
    link.handler = router.route
    training = TrainingRound(strategy, intake, port, pace, over_select=config.over_select,
                             report_goal=config.report_goal)
    if secure is not None:
        intake.secure = training.secure = SecureSums(secure, run_id, fleet.secure_keys)
    return RunParts(topics=topics, rejections=rejections, link=link, pace=pace, run_models=run_models, fleet=fleet,
                    intake=intake, delivery=delivery, assignments=assignments, service=service, resketch=resketch,
                    remote=remote, router=router, training=training, config=config)
