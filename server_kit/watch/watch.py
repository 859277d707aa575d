"""The watch on a running federation: its views taken at a pace, read by the metrics and the live page.

:class:`Watch` is attached to an :class:`~server_kit.drivers.orchestrator.Orchestrator`
(:meth:`Watch.attach`): the driver's thread calls :meth:`Watch.tick` between
messages (``ServerLink.on_tick``) and :meth:`Watch.on_round` after each round.
A tick takes a new :class:`~.view.RunView` when the last is ``refresh_s`` old:
what the metrics endpoint and the live page read, from their own threads,
without touching the run's state. The run's result (``results.json``'s
input, with the page's 200 most refused and slowest devices) goes into a view
only while someone reads the live page, at most every ``RESULT_S``.
At the end, :meth:`Watch.finish` is given the run's final results (and its
report folder): from then on the page is the final report itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

from ..drivers.device_table import device_rows, model_keys, most_watched
from ..drivers.phase import Phase
from ..report.page import FLEET_ROWS
from .options import DEVICE_LIMIT
from .view import OpenRoundView, RoundTotals, RunView, health_summary

__all__ = ["REFRESH_S", "Watch"]

log = logging.getLogger(__name__)

#: Seconds between two views.
REFRESH_S = 1.0
#: Seconds the run's result keeps being taken after the live page was last read.
PAGE_READ_S = 30.0
#: Seconds between two takes of the run's result (the live page reloads itself every 2 s).
RESULT_S = 2.0
#: Seconds between two passes over the fleet (its health summed up, the devices watched one by one chosen); a
#: closed round makes one at once. Between them a view costs O(watched devices), whatever the fleet's size.
FLEET_S = 10.0


class Watch:
    """Views of one run, taken on its driver's thread (see the module docstring).

    Parameters
    ----------
    device_limit : int
        Devices watched one by one (the most refused, then the slowest).
    refresh_s : float
        Seconds between two views.
    clock : callable
        Monotonic time.
    """

    def __init__(self, *, device_limit: int = DEVICE_LIMIT, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if device_limit < 0:
            raise ValueError(f"--metrics-devices must be 0 or more, got {device_limit}")
        self.device_limit = int(device_limit)
        self.refresh_s = float(refresh_s)
        self.clock = clock
        self.totals = RoundTotals()
        self._orch: Any = None
        self._view: RunView | None = None
        self._taken = -float("inf")
        self._page_read = -float("inf")
        self._result_taken = -float("inf")
        self._fleet_taken = -float("inf")
        self._health = health_summary([])
        self._watched_ids: list[str] = []
        #: The run's final results (``build_results``'s output), once :meth:`finish` had them.
        self.final: Mapping[str, Any] | None = None
        #: The report folder the final page and its files are read from (None: the page is rendered).
        self.report_dir: Path | None = None
        #: CPU seconds the views took (on the driver's thread).
        self.cpu_s = 0.0

    # -- the driver's side ------------------------------------------------------------
    def attach(self, orch: Any) -> None:
        """Watch ``orch``: its link ticks this watch, its rounds are added as they close."""
        self._orch = orch
        before = orch.on_round

        def on_round(rec: dict[str, Any]) -> None:
            self.on_round(rec)
            if before is not None:
                before(rec)

        orch.on_round = on_round
        orch.link.on_tick = self.tick
        self.refresh()

    def on_round(self, rec: Mapping[str, Any]) -> None:
        """A round closed: its record added, and a view taken at once (with a fresh result, if the page is read)."""
        self.totals.add(rec)
        self._result_taken = self._fleet_taken = -float("inf")
        self.refresh()

    def tick(self) -> None:
        """Take a view if the last one is ``refresh_s`` old (cheap otherwise: one clock read)."""
        if self.clock() - self._taken >= self.refresh_s:
            self.refresh()

    def refresh(self) -> None:
        """Take a view now (on the driver's thread)."""
        if self._orch is None:
            return
        cpu = time.thread_time()
        self._taken = now = self.clock()
        result = None
        if now - self._page_read < PAGE_READ_S:  # someone reads the page: the run's result, every RESULT_S
            last = self._view
            if last is not None and last.result is not None and now - self._result_taken < RESULT_S:
                result = last.result
            else:
                result = self._orch.result(fleet_rows=FLEET_ROWS).to_dict()
                self._result_taken = now
        if now - self._fleet_taken >= FLEET_S:
            self._pass_over_fleet()
            self._fleet_taken = now
        self._view = self._take(result)
        self.cpu_s += time.thread_time() - cpu

    def finish(self, results: Mapping[str, Any], report_dir: str | Path | None = None) -> None:
        """The run is over: ``results`` (what ``results.json`` holds) and its report folder, if written."""
        final = results.get("final_evaluation") or {}
        if final.get("per_cluster"):
            self.totals.accuracy = dict(final["per_cluster"])
            self.totals.accuracy_mean = final.get("mean")
        self.final = results
        self.report_dir = None if report_dir is None else Path(report_dir)
        self._result_taken = -float("inf")
        self.refresh()

    # -- the readers' side (any thread) -----------------------------------------------
    @property
    def view(self) -> RunView | None:
        """The last view (None before the run is attached)."""
        return self._view

    def page_read(self) -> None:
        """Someone reads the live page: the next views carry the run's whole result."""
        if self.clock() - self._page_read >= PAGE_READ_S:
            self._taken = -float("inf")  # the next tick takes one at once
        self._page_read = self.clock()

    # -- taking a view --------------------------------------------------------------
    def _pass_over_fleet(self) -> None:
        """The fleet's health summed up and the devices watched one by one chosen: O(devices)."""
        orch = self._orch
        clients = orch.fleet.clients
        self._health = health_summary([getattr(s, "health", None) for s in list(clients.values())])
        self._watched_ids = most_watched(orch.tallies, clients, self.device_limit)

    def _take(self, result: Mapping[str, Any] | None) -> RunView:
        orch = self._orch
        fleet, intake, strategy = orch.fleet, orch.intake, orch.strategy
        history = orch.history
        while self.totals.rounds < len(history):  # a resumed run's rounds, or one the callback did not see
            self.totals.add(history[self.totals.rounds])
        now = self.clock()
        admitted, online = len(fleet.clients), len(fleet.online_ids)
        devices = {"admitted": admitted, "online": online, "offline": admitted - online,
                   "benched": len(fleet.benched), "not_training": len(fleet.not_training),
                   "refused": len(fleet.refused)}
        watched_ids = self._watched_ids
        watched = device_rows(fleet, model_keys(strategy, watched_ids), orch.tallies, watched_ids, now=now)
        return RunView(
            run_id=orch.run_id, strategy=strategy.name, federation=orch.config.federation, phase=intake.phase,
            round=orch.training_round, rounds_planned=orch.config.rounds, devices=devices, open_round=_open_round(intake),
            last_round=_last_round(history), totals=self.totals.copy(), rejected=dict(orch.rejected),
            transport=orch.transport.stats(), delivered=dict(orch.delivery.delivered),
            clustering_s=orch.record.timings.get("clustering_s"),
            health=self._health,
            watched=tuple(watched), result=result)


def _open_round(intake: Any) -> OpenRoundView | None:
    wait = intake.wait
    if wait is None or intake.phase is not Phase.TRAIN:
        return None
    refused = sum(1 for c in wait.refusals if c not in wait.answered)  # a refused device may still answer
    return OpenRoundView(round=wait.round, tasked=len(wait.expected), reported=len(wait.answered), refused=refused,
                         awaited=len(wait.left), elapsed_s=wait.elapsed(), goal_met=wait.goal_met())


def _last_round(history: list[Mapping[str, Any]]) -> dict[str, int]:
    if not history:
        return {}
    rec = history[-1]
    return {"tasked": int(rec.get("selected") or rec.get("tasked") or 0), "reported": int(rec.get("reported") or 0),
            "refused": len(rec.get("refused") or {})}
