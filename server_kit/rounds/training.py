"""One training round from start to end: plan, send, wait, close, combine, report.

:class:`TrainingRound` owns a round's steps and their order; a driver gives
it what moves messages (a :class:`RoundPort`) and where arrivals are recorded
(a :class:`RoundIntake`), so the same round runs over MQTT, or in a test with
a scripted port and no broker:

1. **plan**: the strategy's tasks, spares included (:func:`.plan.plan_tasks`);
2. **open**: the intake expects an update from each task's device, for a
   model it was sent; the round's :class:`~.round_wait.RoundWait` keeps whom it
   waits for;
3. **send**: the port gets each device its models and its ``train`` command;
4. **wait**: the port lets the answers in until the round may close
   (:mod:`.closing`); then what arrives for it is late;
5. **judge, flush, combine**: the round screens what arrived (the verdicts
   from the norms of every update, those ingest workers hold included:
   :func:`.judging.screen_round`); the
   port's workers sum what they hold by those verdicts (the only I/O of this
   step, done by the round, never by the strategy); the strategy combines its
   own updates and the partial sums; the screening's refusals join the
   round's wait;
6. **report**: the devices benched by their pace, and a frozen
   :class:`RoundReport` (what ``results.json`` keeps per round, from one
   :meth:`RoundReport.to_dict`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from edge_sdk.tasks import Task, Update

from ..ids import some_ids
from .arrivals import PartialSum, Receipt
from .judging import Aggregation, screen_round
from .pace import Pace
from .plan import plan_tasks
from .round_wait import RoundClose, RoundWait, WaitRecord

__all__ = ["HeldElsewhere", "OpenRound", "RoundIntake", "RoundPort", "RoundReport", "TrainingRound"]

log = logging.getLogger(__name__)


class RoundIntake(Protocol):
    """Where a round's arrivals are recorded as they come (the server's intake)."""

    #: The devices tasked this round.
    tasked: set[str]

    def open_round(self, rnd: int, tasks: list[Task], online: Collection[str], *, report_goal: float = 1.0
                   ) -> RoundWait:
        """Round ``rnd`` begins: expect an update from each task's device."""
        ...

    def close_round(self) -> None:
        """The round closed: what arrives for it from now on is late."""
        ...

    def arrivals(self) -> tuple[list[Update], list[Receipt]]:
        """The round's updates and receipts, in the order they are combined (the intake's deterministic order)."""
        ...


class HeldElsewhere(Protocol):
    """The round's updates that ingest workers hold (:class:`server_kit.drivers.remote.RemoteRound`).

    The server knows each one's norm and model from its receipt; once the
    round's verdicts are decided from every norm, :meth:`collect` tells each
    worker what to sum (the round's only I/O after its wait) and returns their
    partial sums.
    """

    #: Each held update's delta norm (None: not computable; ``inf``: not finite), by device.
    norms: Mapping[str, float | None]
    #: Each held update's model key, by device.
    keys: Mapping[str, str]
    #: The held updates no partial sum carried, with the reason.
    refused_by: dict[str, str]

    def collect(self, verdicts: Mapping[str, Any], registered: Mapping[str, int]
                ) -> tuple[list[PartialSum], int]:
        """The partial sums, and how many members' sample counts were capped."""
        ...


class RoundPort(Protocol):
    """What a driver does for a round: reach the devices, and let their answers in."""

    def online_ids(self) -> Collection[str]:
        """The devices online now."""
        ...

    def send(self, rnd: int, tasks: Sequence[Task]) -> tuple[int, dict[str, int]]:
        """Get each task's device its models and its command; the model bytes and the deliveries' counts."""
        ...

    def wait(self, rnd: int, wait: RoundWait) -> RoundClose:
        """Let the answers in until the round may close."""
        ...

    def remote(self) -> HeldElsewhere | None:
        """The updates ingest workers hold this round, or None (no workers)."""
        ...

    def bench(self, cid: str, reason: str) -> None:
        """Leave device ``cid`` out of the next rounds, for ``reason``."""
        ...

    def unmask(self, rnd: int, secure: Any) -> list[PartialSum]:
        """Secure aggregation (a driver that takes ``--secure``): close the groups, ask the survivors to reveal,
        return each group's sum."""
        ...


@dataclass(frozen=True)
class RoundReport:
    """What became of one round: its record in ``results.json`` (:meth:`to_dict`)."""

    round: int
    tasked: int
    updates: int
    missing: tuple[str, ...]
    acc_before: float | None
    acc_before_per_model: Mapping[str, float]
    loss: float | None
    model_bytes_delivered: int
    deliveries: Mapping[str, int]
    clipped: int
    refused_norm: int
    #: The strategy's summary of its combination (and the screening's figures).
    summary: Mapping[str, Any]
    seconds: float
    #: Seconds spent judging and combining the updates (the flush of partial sums included).
    aggregate_s: float = 0.0
    #: The mean training loss of the updates of each model.
    loss_per_model: Mapping[str, float] = field(default_factory=dict)
    #: The round's wait: selected, spares, reported, stragglers, offline, refused, goals, close...
    wait: WaitRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        """The round's record, as ``results.json`` and the report page read it."""
        return {
            "round": self.round, "tasked": self.tasked, "updates": self.updates, "missing": list(self.missing),
            "acc_before": self.acc_before, "acc_before_per_model": dict(self.acc_before_per_model),
            "loss": self.loss, "model_bytes_delivered": self.model_bytes_delivered,
            "deliveries": dict(self.deliveries), "clipped": self.clipped, "refused_norm": self.refused_norm,
            "summary": dict(self.summary), "seconds": self.seconds, "aggregate_s": self.aggregate_s,
            "loss_per_model": dict(self.loss_per_model), **(self.wait.to_dict() if self.wait else {}),
        }


def _mean_per_model(arrived: Sequence[Update | Receipt], what: str) -> dict[str, float]:
    """The mean of each arrival's ``what`` (an attribute: ``loss``) per model key."""
    per_model: dict[str, list[float]] = {}
    for u in arrived:
        value = getattr(u, what, None)
        if value is not None and np.isfinite(value):
            per_model.setdefault(u.model_key, []).append(float(value))
    return {k: float(np.mean(v)) for k, v in sorted(per_model.items())}


def _accuracies_before(arrived: Sequence[Update | Receipt]) -> tuple[float | None, dict[str, float]]:
    """The mean accuracy the devices measured before training, overall and per model (what each reached)."""
    every = [u.metrics["acc_before"] for u in arrived if "acc_before" in u.metrics]
    per_model: dict[str, list[float]] = {}
    for u in arrived:
        if "acc_before" in u.metrics:
            per_model.setdefault(u.model_key, []).append(float(u.metrics["acc_before"]))
    return (float(np.mean(every)) if every else None), {k: float(np.mean(v)) for k, v in sorted(per_model.items())}


@dataclass(frozen=True)
class OpenRound:
    """A round planned and opened (:meth:`TrainingRound.open`), waiting for its :meth:`TrainingRound.finish`."""

    round: int
    tasks: list[Task]
    wait: RoundWait
    #: When it began (the round's clock).
    started: float
    #: Secure aggregation: each tasked device's ``secure`` record for its train command (empty: off).
    secure: Mapping[str, Any] = field(default_factory=dict)


class TrainingRound:
    """One round of training (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        Plans the tasks and combines the updates.
    intake : RoundIntake
        Where the round's updates and receipts are recorded as they arrive.
    port : RoundPort
        What reaches the devices and lets their answers in.
    pace : Pace
        The run's memory of its devices' pace (benches the silent and the refused).
    over_select : float or None
        Spares per group on top of what it needs (``--over-select``; None: the default rule of
        :mod:`.plan`, spares only in groups of at least 10).
    report_goal : float
        The share of each group's needed updates that closes the round (``--report-goal``).
    clock : callable
        Monotonic seconds (a test's scripted clock).
    """

    def __init__(self, strategy: Any, intake: RoundIntake, port: RoundPort, pace: Pace, *,
                 over_select: float | None = 0.0, report_goal: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.strategy = strategy
        self.intake = intake
        self.port = port
        self.pace = pace
        self.over_select = None if over_select is None else float(over_select)
        self.report_goal = float(report_goal)
        self.clock = clock
        #: Secure aggregation's groups (``--secure``: :class:`server_kit.privacy.secure_sum.SecureSums`), or None.
        self.secure: Any = None

    def run(self, rnd: int, available: Sequence[str], *, drift: Mapping[str, Any] | None = None,
            started: float | None = None) -> RoundReport:
        """Run round ``rnd`` with the ``available`` devices; ``drift``: what the round's resketch did."""
        opened = self.open(rnd, available, started=started)
        if opened.secure:
            delivered, deliveries = self.port.send(rnd, opened.tasks, secure=opened.secure)
        else:
            delivered, deliveries = self.port.send(rnd, opened.tasks)
        close = self.port.wait(rnd, opened.wait)
        return self.finish(opened, close, delivered=delivered, deliveries=deliveries, drift=drift)

    def open(self, rnd: int, available: Sequence[str], *, started: float | None = None) -> OpenRound:
        """Plan round ``rnd`` and open it: the intake expects an update from each task's device.

        :meth:`run` calls it; a driver whose framework sends and waits itself (Flower) calls it, then
        :meth:`finish` with the replies recorded.
        """
        t0 = self.clock() if started is None else started
        tasks = plan_tasks(self.strategy, rnd, available, self.over_select)
        dp = getattr(self.strategy, "dp", None)
        paused = dp.stopped if dp is not None else frozenset()
        if paused:  # their DP budget is spent: their devices are not asked
            tasks = [t for t in tasks if not set(t.models) <= paused]
        secure: Mapping[str, Any] = {}
        if self.secure is not None:  # a device that cannot join a secure group is not asked
            secure = self.secure.command_fields(rnd, tasks)
            tasks = [t for t in tasks if t.cid in secure]
        wait = self.intake.open_round(rnd, tasks, self.port.online_ids(), report_goal=self.report_goal)
        return OpenRound(rnd, tasks, wait, t0, secure)

    def finish(self, opened: OpenRound, close: RoundClose, *, delivered: int = 0,
               deliveries: Mapping[str, int] | None = None, drift: Mapping[str, Any] | None = None) -> RoundReport:
        """Close the round: what arrives from now on is late; combine what arrived; bench; the report."""
        rnd, tasks, wait = opened.round, opened.tasks, opened.wait
        self.intake.close_round()
        updates, receipts = self.intake.arrivals()
        masked = self.intake.masked_arrivals() if self.secure is not None else []
        arrived: list[Update | Receipt] = [*updates, *receipts, *masked]
        missing = sorted(self.intake.tasked - {u.cid for u in arrived})
        if missing:
            log.warning("round %d closed (%s at %.1f s) without %d client(s): %s", rnd, close.reason.value,
                        close.close_s, len(missing), some_ids(missing))
        t_combine = self.clock()
        aggregation = self._combine(rnd, updates, wait, bool(receipts), bool(masked))
        aggregate_s = self.clock() - t_combine
        summary = {"updates": 0} if aggregation is None else aggregation.to_dict()
        if drift is not None:
            summary["drift"] = drift
        online = set(self.port.online_ids())  # at the close: a device online without an answer was silent
        for cid in self.pace.after_round(wait, close.extended_by, online=online.__contains__):
            self.port.bench(cid, self.pace.benched[cid])
        acc_before, acc_per_model = _accuracies_before(arrived)
        return RoundReport(
            round=rnd, tasked=len(tasks), updates=len(arrived), missing=tuple(missing), acc_before=acc_before,
            acc_before_per_model=acc_per_model,
            loss=float(np.mean([u.loss for u in arrived])) if arrived else None,
            model_bytes_delivered=delivered, deliveries=dict(deliveries or {}),
            clipped=aggregation.screen.clipped if aggregation else 0,
            refused_norm=aggregation.screen.refused_norm if aggregation else 0,
            summary=summary, seconds=self.clock() - opened.started, aggregate_s=aggregate_s,
            loss_per_model=_mean_per_model(arrived, "loss"), wait=wait.record(close, online.__contains__))

    def _combine(self, rnd: int, updates: list[Update], wait: RoundWait, any_held: bool,
                 any_masked: bool = False) -> Aggregation | None:
        """Judge, flush, combine: every update screened (those held elsewhere by their norms), the ingest workers
        sum what they hold by those verdicts, the strategy combines; refusals join the wait. None: nothing arrived.
        Secure: the survivors reveal, each group's sum is one partial sum (:meth:`RoundPort.unmask`)."""
        if any_masked:
            sums = self.port.unmask(rnd, self.secure)
            return self.strategy.aggregate(rnd, [], partials=sums) if sums else None
        remote = self.port.remote() if any_held else None
        if not updates and remote is None:
            return None
        if remote is None:
            aggregation = self.strategy.aggregate(rnd, updates)
        else:
            screening = screen_round(self.strategy, rnd, updates, held_norms=remote.norms, held_keys=remote.keys)
            partials, capped = remote.collect(screening.verdicts, screening.registered)  # the flush: I/O here
            aggregation = self.strategy.aggregate(rnd, updates, screening=screening, partials=partials,
                                                  partials_capped=capped)
        wait.screen(aggregation.screen.refused_by)
        if remote is not None:
            wait.screen(remote.refused_by)
        return aggregation
