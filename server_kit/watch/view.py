"""What a watched run looks like at one moment: a :class:`RunView`, taken on the driver's thread.

A view is immutable: the metrics endpoint and the live page read the last
one from their own threads while the run goes on. Figures that add up over
the rounds (rounds closed by reason, stragglers, refused updates, the
durations of the histograms) are kept by a :class:`RoundTotals` that takes
each round's record once, so that taking a view never scans the run's
history; the fleet's health is one pass over the devices, at the watch's
pace (:class:`~server_kit.watch.watch.Watch`), never per message.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from edge_sdk.health import DeviceHealth

from ..drivers.device_table import DeviceRow
from ..drivers.phase import Phase

__all__ = ["HealthSummary", "OpenRoundView", "RoundTotals", "RunView", "health_summary"]

#: The health figures whose exposure is counted (``fedsketch_devices_health_exposed{figure}``).
HEALTH_FIGURES = {"cpu_temperature": "cpu_temp_c", "throttled": "throttled", "memory": "mem_available_mb",
                  "load": "load1"}


@dataclass(frozen=True)
class HealthSummary:
    """The fleet's health in three figures (every device, no per-device series)."""

    #: Per figure (:data:`HEALTH_FIGURES`), the devices whose last health carried it.
    exposed: Mapping[str, int]
    #: Devices whose board throttles or is under-volted now.
    throttled: int
    #: The hottest CPU reported, or None.
    max_cpu_temp_c: float | None


def health_summary(healths: list[DeviceHealth | None]) -> HealthSummary:
    """Sum up the devices' last healths (None: a device that sent none)."""
    exposed = dict.fromkeys(HEALTH_FIGURES, 0)
    throttled, hottest = 0, None
    for h in healths:
        if h is None:
            continue
        for figure, attr in HEALTH_FIGURES.items():
            if getattr(h, attr) is not None:
                exposed[figure] += 1
        if h.throttling_now:
            throttled += 1
        if h.cpu_temp_c is not None and (hottest is None or h.cpu_temp_c > hottest):
            hottest = h.cpu_temp_c
    return HealthSummary(exposed, throttled, hottest)


@dataclass(frozen=True)
class OpenRoundView:
    """The round being waited for: how it is closing."""

    round: int
    tasked: int
    reported: int
    refused: int
    #: Tasked devices still awaited (online, no answer yet).
    awaited: int
    elapsed_s: float
    #: Whether every group has its report goal (the round closes after the grace).
    goal_met: bool


@dataclass
class RoundTotals:
    """What the closed rounds add up to, each round's record taken once (:meth:`add`)."""

    rounds: int = 0
    closed_by: dict[str, int] = field(default_factory=dict)
    stragglers: int = 0
    refused: dict[str, int] = field(default_factory=dict)
    seconds: list[float] = field(default_factory=list)
    goal_seconds: list[float] = field(default_factory=list)
    aggregate_seconds: list[float] = field(default_factory=list)
    #: The last round's accuracy (measured before training in the next round: set by that round) and loss.
    accuracy: dict[str, float] = field(default_factory=dict)
    accuracy_mean: float | None = None
    loss: dict[str, float] = field(default_factory=dict)

    def copy(self) -> RoundTotals:
        """A copy of its own (a view's: the readers' threads never see it change)."""
        return replace(self, closed_by=dict(self.closed_by), refused=dict(self.refused), seconds=list(self.seconds),
                       goal_seconds=list(self.goal_seconds), aggregate_seconds=list(self.aggregate_seconds),
                       accuracy=dict(self.accuracy), loss=dict(self.loss))

    def add(self, rec: Mapping[str, Any]) -> None:
        self.rounds += 1
        if rec.get("close"):
            self.closed_by[rec["close"]] = self.closed_by.get(rec["close"], 0) + 1
        self.stragglers += len(rec.get("stragglers") or ())
        for reason in (rec.get("refused") or {}).values():
            self.refused[reason] = self.refused.get(reason, 0) + 1
        if rec.get("seconds") is not None:
            self.seconds.append(float(rec["seconds"]))
        if rec.get("goal_s") is not None:
            self.goal_seconds.append(float(rec["goal_s"]))
        if rec.get("aggregate_s") is not None:
            self.aggregate_seconds.append(float(rec["aggregate_s"]))
        if rec.get("acc_before_per_model"):
            self.accuracy = dict(rec["acc_before_per_model"])
            self.accuracy_mean = rec.get("acc_before")
        if rec.get("loss_per_model"):
            self.loss = dict(rec["loss_per_model"])


@dataclass(frozen=True)
class RunView:
    """A watched run at one moment (see the module docstring)."""

    run_id: str | None
    strategy: str
    federation: str
    phase: Phase
    round: int
    rounds_planned: int
    #: Devices by state: admitted, online, offline, benched, not_training, refused.
    devices: Mapping[str, int]
    open_round: OpenRoundView | None
    #: The last closed round's devices (tasked, reported, refused), when no round is open.
    last_round: Mapping[str, int]
    totals: RoundTotals
    #: Refused messages per reason.
    rejected: Mapping[str, int]
    #: The server transport's counters (``sent``, ``received``: kind -> messages, bytes).
    transport: Mapping[str, Any]
    #: Bytes the devices downloaded, per kind.
    delivered: Mapping[str, int]
    clustering_s: float | None
    health: HealthSummary
    #: The devices watched one by one (the most refused and the slowest, at most the watch's limit).
    watched: tuple[DeviceRow, ...]
    #: The run's result so far (``build_results``'s input), taken only while someone reads the live page.
    result: Mapping[str, Any] | None = None
    #: When it was taken (seconds since the epoch).
    taken: float = field(default_factory=time.time)

    @property
    def accuracy(self) -> Mapping[str, float]:
        return self.totals.accuracy

    @property
    def loss(self) -> Mapping[str, float]:
        return self.totals.loss
