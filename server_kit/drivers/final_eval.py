"""The run's final evaluation over MQTT: each asked device evaluates its cluster's model and says how it did.

One phase of :class:`~server_kit.drivers.orchestrator.Orchestrator`
(``EVALUATE``): the devices to ask (all the assigned online devices, or a
seeded sample with at least one per cluster: :func:`~.records.eval_sample`),
each told its model again where that changed, the models delivered, one
broadcast ``evaluate`` for the sample (each device knows whether it is in
it) and a command per added device; then the metrics collected as a round's
updates are (:mod:`~server_kit.rounds.answers`): until, in every cluster,
the share ``report_goal`` of the devices waited for and online answered
(all of them below 10 at the default 0.9), then the stragglers' grace; or
until all answered, or ``eval_timeout_s``.

A benched device is never waited for, nor asked on its own: the broadcast
reaches it when it is in the sample, and its accuracy counts if it comes
before the close.
"""

from __future__ import annotations

import logging

from edge_sdk.protocol.commands import Op
from edge_sdk.training.sampling import in_sample

from ..rounds.answers import GoalWait, wait_answers
from ..rounds.round_wait import CloseReason, RoundClose
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
    sampled, extra = eval_sample({c: k for c, k in keys.items() if c not in fleet.benched}, config.eval_fraction,
                                 config.seed)
    # the broadcast reaches the benched devices of the sample too: heard if they answer, never waited for
    heard = [c for c in keys if c in fleet.benched and in_sample(c, config.eval_fraction, config.seed)]
    waited = sorted(sampled + extra)
    asked = sorted(waited + heard) if sampled else waited
    for cid in asked:  # a device evaluates the model it was told: tell it again where that changed
        if assignments.told.get(cid) != keys[cid]:
            assignments.assign(cid, keys[cid])
    delivery.await_confirmations(config.round_timeout_s)
    intake.eval_keys = {c: keys[c] for c in asked}
    awaited = intake.awaited = GoalWait("metrics", {c: keys[c] for c in waited}, fleet.online_ids,
                                        config.report_goal)
    delivered, deliveries = delivery.deliver_models({c: [keys[c]] for c in asked}, strategy.models,
                                                     strategy.versions)
    arch = {"architecture": architecture} if architecture else {}
    if sampled:  # one command for the sample; each device knows its model and whether it is in it
        link.broadcast(Op.EVALUATE, round=intake.round, fraction=config.eval_fraction, seed=config.seed, **arch)
    for cid in extra:
        link.command(cid, Op.EVALUATE, round=intake.round, model_key=keys[cid], **arch)
    log.info("final evaluation: %d of %d assigned device(s) asked (fraction %g, %d added so that every "
             "cluster is evaluated, %d benched not waited for); models once on %d cluster topic(s), %d copies per "
             "device", len(asked), len(keys), config.eval_fraction, len(extra), len(asked) - len(waited),
             deliveries["cluster_topic"], deliveries["per_device"])
    close = wait_answers(link.pump, awaited, timeout_s=config.eval_timeout_s, straggler_grace=config.straggler_grace)
    _log_close(close, sum(awaited.goals.values()), len(awaited.answered), len(awaited.left))
    intake.eval_keys = {}
    unanswered = sorted(set(asked) - set(intake.metrics))
    if unanswered:
        log.warning("final evaluation: %d asked device(s) sent no accuracy by its close: %s", len(unanswered),
                    ", ".join(unanswered[:10]) + (" ..." if len(unanswered) > 10 else ""))
    return eval_result(intake.metrics, keys, eval_fraction=config.eval_fraction, asked=len(asked),
                       delivered=delivered, deliveries=deliveries, broadcast=bool(sampled), per_device=len(extra),
                       unanswered=unanswered)


def _log_close(close: RoundClose, goal: int, answered: int, left: int) -> None:
    """How the final evaluation's wait ended, in one line."""
    if close.reason is CloseReason.ALL_ANSWERED:
        log.info("final evaluation: closed at %.1f s, every device waited for answered or went offline",
                 close.close_s)
    elif close.reason is CloseReason.GOAL:
        log.info("final evaluation: report goals (%d answers) reached at %.1f s; closed after the grace, at %.1f s, "
                 "with %d answer(s), without %d device(s) still awaited", goal, close.goal_s or 0.0, close.close_s,
                 answered, left)
    else:
        log.warning("final evaluation: closed at its timeout (%.1f s) with %d answer(s), short of its goals (%d)",
                    close.close_s, answered, goal)
