"""Fresh sketches during training, for a strategy that follows drift: asked, sent unasked, acted on.

A strategy that follows drift (``strategy.capabilities.follows_drift``: ours with
``follow_drift`` or ``resketch_every``) gets fresh sketches while training
goes on, as the in-process driver gives them
(:meth:`server_kit.drivers.simulate.Simulator._drift_step`):

- **asked**: before each round, the server asks the online clustered devices
  that can train which ``strategy.resketch_asked(rnd, ...)`` names (ours: in
  the rounds its tracker is due, a seeded share of them, the simulator's too)
  for a fresh sketch with the usual ``sketch`` command: one broadcast when
  the sample is all of them, one command per device otherwise. It cannot ask
  exactly the devices the round will train: which those are depends on the
  clusters, which the fresh sketches may change. It waits for them like the
  first sketches (``sketch_quorum``), at most ``sketch_timeout_s`` or the
  round's deadline, whichever is shorter;
- **unasked**: a device whose data changed sends its new sketch with
  ``unasked`` in the meta (:meth:`edge_sdk.client.EdgeClient.data_changed`).
  One that arrives during a round is kept and handed to the strategy before
  the next round trains (never during an aggregation); one that arrived
  between rounds is handled at once, at the start of the next round. A run
  whose strategy does not follow drift refuses it (counted as
  ``unasked-sketch``; the device keeps its cluster, nothing else changes).

The strategy then decides (``strategy.on_resketch``: moves, a pool, new
clusters with their models, retired clusters). Every device whose cluster
changed is told its new model through the usual assignment
(:meth:`~.assignment.Assignments.assign`: with automatic delivery it
follows its new cluster's topic, and confirms, before the round's models go
out), so it gets its new cluster's model before it trains. The round's
record holds the summary under ``summary["drift"]`` (with the sketches
asked, answered and sent unasked, the devices re-assigned and the bytes),
and the run's result sums them (:func:`drift_totals`). Sketches kept and not
yet handed to the strategy go into the checkpoint.

A run whose strategy does not follow drift sends and waits for nothing here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

from edge_sdk.protocol import Message
from edge_sdk.protocol.commands import Op
from edge_sdk.sketch import Sketch

from ..ids import some_ids
from ..strategies.base import Strategy
from ..strategies.drift import DriftReport
from .assignment import Assignments
from .config import ServerConfig
from .delivery import Delivery
from .fleet import Fleet
from .intake import Intake
from .link import ServerLink

__all__ = ["Resketch", "ResketchOutcome", "drift_totals"]

log = logging.getLogger(__name__)

#: The per-round counts of a drift summary that :func:`drift_totals` adds up.
_COUNTED = ("sketches", "asked", "answered", "unasked", "reassigned", "bytes")
_LISTED = ("moves", "pooled", "new_clusters", "retired")


@dataclass(frozen=True)
class ResketchOutcome:
    """What fresh sketches did before a round: the strategy's report, and what the server asked and moved."""

    #: What the strategy changed (moves, pool, new and retired clusters), or None: it ignored them.
    report: DriftReport | None
    asked: int
    answered: int
    unasked: int
    reassigned: int
    #: Bytes of the sketches and of the commands asking for them, since the last outcome.
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        """The round record's ``summary["drift"]``."""
        out = {} if self.report is None else self.report.summary()
        out.update({"asked": self.asked, "answered": self.answered, "unasked": self.unasked,
                    "reassigned": self.reassigned, "bytes": self.bytes})
        return out


def drift_totals(history: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The run's drift counts: each round's ``summary["drift"]`` added up (moves, pooled, ... bytes)."""
    totals = {k: 0 for k in _LISTED + _COUNTED}
    for rec in history:
        drift = (rec.get("summary") or {}).get("drift") or {}
        for k in _LISTED:
            totals[k] += len(drift.get(k) or ())
        for k in _COUNTED:
            totals[k] += int(drift.get(k) or 0)
    totals["rounds"] = sum(1 for rec in history if (rec.get("summary") or {}).get("drift"))
    return totals


class Resketch:
    """Asks for fresh sketches, keeps those sent unasked, and acts on them between rounds (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        Whether it follows drift (``capabilities.follows_drift``), whom it asks for fresh sketches (``resketch_asked``), what it
        makes of them (``on_resketch``).
    config : ServerConfig
        The sketch quorum and deadline, the round deadline of confirmations.
    link, fleet, intake, assignments, delivery
        The driver's parts this one speaks through and reads.
    deadline : callable
        ``deadline(rnd)``: the seconds round ``rnd`` waits (``Orchestrator.round_deadline``).
    """

    def __init__(self, strategy: Strategy, config: ServerConfig, link: ServerLink, fleet: Fleet, intake: Intake,
                 assignments: Assignments, delivery: Delivery, deadline: Callable[[int], float]) -> None:
        self.strategy = strategy
        self.config = config
        self.deadline = deadline
        self.link = link
        self.fleet = fleet
        self.intake = intake
        self.assignments = assignments
        self.delivery = delivery
        #: Fresh sketches of clustered devices, not yet handed to the strategy.
        self.fresh: dict[str, Sketch] = {}
        self._unasked: set[str] = set()
        self._bytes = 0

    @property
    def follows(self) -> bool:
        """Whether the strategy acts on sketches sent during training."""
        return self.strategy.capabilities.follows_drift

    def totals(self, history: Sequence[Mapping[str, Any]]) -> dict[str, int] | None:
        """The run's drift counts (:func:`drift_totals`); ``None`` for a strategy that does not follow drift."""
        return drift_totals(history) if self.follows else None

    # -- what arrives ----------------------------------------------------------
    def admits(self, cid: str, msg: Message) -> bool:
        """Whether a summary is taken: one sent unasked during training, only by a run that follows drift."""
        if not msg.meta.get("unasked") or self.follows or not self.intake.phase.trains:
            return True
        self.link.reject("unasked-sketch", "a sketch sent unasked (the device's data changed); this run does "
                                           "not follow drift: the device keeps its cluster", cid)
        return False

    def collect(self, cid: str, sketch: Any, msg: Message) -> None:
        """A clustered device's sketch during training: kept for the next :meth:`before_round` (O(1))."""
        if not self.follows or not isinstance(sketch, Sketch):
            return
        self.fresh[cid] = sketch
        self._bytes += msg.wire_size()
        if msg.meta.get("unasked"):
            self._unasked.add(cid)

    # -- between rounds ----------------------------------------------------------
    def before_round(self, rnd: int) -> ResketchOutcome | None:
        """Before round ``rnd`` trains: ask if due, hand the fresh sketches over, re-assign; None: no fresh sketch."""
        if not self.follows:
            return None
        self.link.drain()  # what arrived between rounds counts now
        asked = self._ask(rnd)
        if not self.fresh:
            return None
        fresh, self.fresh = self.fresh, {}
        unasked, self._unasked = len(self._unasked & set(fresh)), set()
        before = self.strategy.clusters()
        report = self.strategy.on_resketch(rnd, fresh)
        reassigned = self._reassign(before)
        outcome = ResketchOutcome(report, asked=len(asked), answered=len(set(asked) & set(fresh)), unasked=unasked,
                                  reassigned=len(reassigned), bytes=self._bytes)
        self._bytes = 0
        log.info("round %d: %d fresh sketch(es) (%d asked, %d unasked): %d device(s) re-assigned%s", rnd,
                 len(fresh), len(asked), unasked, len(reassigned),
                 f" ({some_ids(reassigned)})" if reassigned else "")
        return outcome

    def _ask(self, rnd: int) -> list[str]:
        """Ask the clustered devices that can train the strategy wants fresh sketches of (if any); wait for them."""
        cands = [c for c in self.fleet.trainable() if self.strategy.is_clustered(c)]
        asked = self.strategy.resketch_asked(rnd, cands)
        if not asked:
            return []
        awaited = self.intake.expect("sketch", asked, self.fleet.online_ids)
        request = self.assignments.sketch_request()
        if len(asked) == len(cands) and len(asked) > 1:  # all of them: one broadcast
            self._bytes += self.link.broadcast(Op.SKETCH, **request) or 0
        else:
            for cid in asked:
                self._bytes += self.link.command(cid, Op.SKETCH, **request) or 0
        need = max(1, math.ceil(self.config.sketch_quorum * len(asked)))
        limit = min(self.config.sketch_timeout_s, self.deadline(rnd))
        if not self.link.pump(lambda: len(awaited.answered) >= need or not awaited.left, limit):
            log.warning("round %d: %d of the %d fresh sketches asked for arrived within %g s", rnd,
                        len(awaited.answered), len(asked), limit)
        return asked

    def _reassign(self, before: Mapping[str, int]) -> list[str]:
        """Tell every device whose cluster changed its new model (and topic); wait for them to follow it."""
        after = self.strategy.clusters()
        moved = sorted(c for c, k in after.items() if before.get(c) != k)
        for cid in moved:
            key = self.strategy.model_key_for(cid)
            if self.assignments.told.get(cid) != key:
                self.assignments.assign(cid, key)
        if moved:
            self.delivery.await_confirmations(self.config.round_timeout_s)
        return moved

    # -- checkpoints ---------------------------------------------------------
    def pending(self) -> dict[str, Sketch] | None:
        """The fresh sketches not yet handed to the strategy, for a checkpoint (None: this run does not follow)."""
        return dict(self.fresh) if self.follows else None

    def restore(self, fresh: Mapping[str, Sketch]) -> None:
        """The fresh sketches a checkpoint kept (handed to the strategy before the next round)."""
        self.fresh = dict(fresh)

