"""Clustering before training over MQTT: every online device asked for its summary, the strategy clusters once.

One broadcast ``sketch`` command (a device not admitted ignores it) asks
for the summary the strategy wants (:meth:`~.assignment.Assignments.sketch_request`);
the sketches are collected until ``sketch_quorum`` of the online devices sent
one or ``sketch_timeout_s``, then the strategy clusters those it got
(``Strategy.on_sketches``).
"""

from __future__ import annotations

import logging
import math
import time

from edge_sdk.protocol.commands import Op

from ..strategies.base import Strategy
from .config import ServerConfig
from .phase import Phase
from .wiring import RunParts

__all__ = ["PhaseSeconds", "cluster_from_sketches"]

log = logging.getLogger(__name__)

#: Seconds spent collecting the sketches, and clustering them.
PhaseSeconds = tuple[float, float]


def cluster_from_sketches(parts: RunParts, strategy: Strategy, config: ServerConfig) -> PhaseSeconds:
    """The phase (see the module docstring); raises ``TimeoutError`` when no sketch arrived by the deadline."""
    t0 = time.monotonic()
    intake = parts.intake
    intake.run.enter(Phase.CLUSTER, rnd=0)
    cids = parts.fleet.online()
    awaited = intake.expect("sketch", cids, parts.fleet.online_ids)
    for cid in cids:
        if cid in intake.sketches:
            awaited.answer("sketch", cid)
    parts.link.broadcast(Op.SKETCH, **parts.assignments.sketch_request())
    need = max(1, math.ceil(config.sketch_quorum * len(cids)))
    # a device that declined (its owner's privacy budget) counts as heard from: nobody waits for its sketch
    parts.link.pump(lambda: len(awaited.answered) + len(awaited.given_up) >= need, config.sketch_timeout_s)
    got = {c: intake.sketches[c] for c in cids if c in intake.sketches}
    if len(got) + len(awaited.given_up) < need:
        log.warning("sketch deadline: %d of %d sketches (quorum %d); clustering those", len(got), len(cids), need)
    if not got:
        raise TimeoutError("no sketch arrived before the deadline")
    collected = time.monotonic() - t0
    t1 = time.monotonic()
    strategy.on_sketches(got)
    return collected, time.monotonic() - t1
