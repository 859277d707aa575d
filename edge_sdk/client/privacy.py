"""The device's privacy steps: what a sketch about to go gives away, logged, and its owner's budget kept."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..privacy import SketchOverBudget, sketch_epsilon
from ..protocol import Kind

if TYPE_CHECKING:
    from .commands import DeviceContext

__all__ = ["spend_sketch_budget"]

log = logging.getLogger("edge_sdk.client.commands")


def spend_sketch_budget(ctx: DeviceContext, flip_prob: float, num_classes: int, latent_dim: int, rnd: int) -> bool:
    """Log what the sketch about to go gives away; False (the server told, nothing sent) past the owner's budget."""
    eps = sketch_epsilon(flip_prob, num_classes, latent_dim)
    budget = ctx.sketch_budget
    if budget is not None:
        try:
            budget.spend(eps)
        except SketchOverBudget as e:
            log.warning("%s", e)
            link = ctx.link
            link.send(link.topics.status(link.cid), Kind.STATUS, rnd, {"state": "online", "declined": "sketch"})
            return False
    spent = "" if budget is None else f"; spent {budget.spent:.1f} of the budget {budget.max_epsilon:g}"
    log.info("%s%s", eps.describe(), spent)
    return True
