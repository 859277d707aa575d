"""The run's final evaluation over MQTT: each asked device evaluates its cluster's model and says how it did.

One phase of :class:`~server_kit.drivers.orchestrator.Orchestrator`
(``EVALUATE``): the devices to ask (all the assigned online devices, or a
seeded sample with at least one per cluster: :func:`~.records.eval_sample`),
each told its model again where that changed, the models delivered, one
broadcast ``evaluate`` for the sample (each device knows whether it is in
it) and a command per added device; then the metrics collected until all
answered or ``eval_timeout_s``.
"""

from __future__ import annotations

import logging

from edge_sdk.protocol.commands import Op

from ..strategies.base import Strategy
from .assignment import Assignments
from .config import ServerConfig
from .delivery import Delivery
from .fleet import Fleet
from .intake import Intake
from .link import ServerLink
from .phase import Phase
from .records import FinalEvaluation, eval_result, eval_sample

__all__ = ["final_evaluation"]

log = logging.getLogger(__name__)


def final_evaluation(config: ServerConfig, strategy: Strategy, *, architecture: str | None, link: ServerLink,
                     fleet: Fleet, intake: Intake, assignments: Assignments, delivery: Delivery) -> FinalEvaluation:
    """Run the final evaluation (see the module docstring); returns what it found (:func:`~.records.eval_result`)."""
    intake.run.enter(Phase.EVALUATE, rnd=config.rounds + 1)
    intake.metrics = {}
    keys = {c: strategy.model_key_for(c) for c in fleet.online() if strategy.is_clustered(c)}
    sampled, extra = eval_sample(keys, config.eval_fraction, config.seed)
    asked = sorted(sampled + extra)
    for cid in asked:  # a device evaluates the model it was told: tell it again where that changed
        if assignments.told.get(cid) != keys[cid]:
            assignments.assign(cid, keys[cid])
    delivery.await_confirmations(config.round_timeout_s)
    intake.eval_keys = {c: keys[c] for c in asked}
    awaited = intake.expect("metrics", asked, fleet.online_ids)
    delivered, deliveries = delivery.deliver_models({c: [keys[c]] for c in asked}, strategy.models,
                                                     strategy.versions)
    arch = {"architecture": architecture} if architecture else {}
    if sampled:  # one command for the sample; each device knows its model and whether it is in it
        link.broadcast(Op.EVALUATE, round=intake.round, fraction=config.eval_fraction, seed=config.seed, **arch)
    for cid in extra:
        link.command(cid, Op.EVALUATE, round=intake.round, model_key=keys[cid], **arch)
    log.info("final evaluation: %d of %d assigned device(s) asked (fraction %g, %d added so that every "
             "cluster is evaluated); models once on %d cluster topic(s), %d copies per device", len(asked),
             len(keys), config.eval_fraction, len(extra), deliveries["cluster_topic"], deliveries["per_device"])
    link.pump(lambda: not awaited.left, config.eval_timeout_s)
    intake.eval_keys = {}
    unanswered = sorted(set(asked) - set(intake.metrics))
    if unanswered:
        log.warning("final evaluation: %d asked device(s) sent no accuracy within %g s: %s", len(unanswered),
                    config.eval_timeout_s, ", ".join(unanswered[:10]) + (" ..." if len(unanswered) > 10 else ""))
    return eval_result(intake.metrics, keys, eval_fraction=config.eval_fraction, asked=len(asked),
                       delivered=delivered, deliveries=deliveries, broadcast=bool(sampled), per_device=len(extra),
                       unanswered=unanswered)
