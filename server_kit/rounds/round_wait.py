"""Whom a training round waits for, per group of devices, and what became of each device it tasked.

A round tasks devices in groups: the devices that train the same models
(one cluster's model, or all of IFCA's K). Each group needs a number of
updates (the strategy's sample: ``fraction`` of the cluster), may have been
given spare devices on top (``--over-select``), and has a report goal: the
share ``--report-goal`` of what it needs. :class:`RoundWait` keeps, in O(1)
per message:

- the devices still awaited (tasked, online, neither answered nor refused);
- per group, the valid updates counted and the devices still awaited;
- when each valid update came (seconds since the round began);
- the refused ones, with the reason. A refused update counts toward its
  group's report goal as an answer (the device did answer; nothing it sent
  can be used), so it never holds the round past its goal; the device keeps
  its place until the round closes, and a valid update it sends by then
  still counts (on a broker without the shipped ACL, the refused message may
  have been somebody else's forgery on its topic).

A round closes (see :class:`CloseReason`) when nobody is left to wait for;
when every group reached its goal (after a grace for the stragglers and the
refused); at its deadline, unless a device's progress claims are plausible
(:mod:`~server_kit.rounds.pace`); or at the longest a round may last.
:class:`DeviceOutcome` says what became of each tasked device.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

from edge_sdk.tasks import Task

from .goals import goal_count
from .reask import Reasks

__all__ = ["Awaited", "CloseReason", "DeviceOutcome", "GroupedAwaited", "RoundClose", "RoundGroup", "RoundWait", "WaitRecord"]


class Awaited:
    """The clients a phase waits for: expected, not answered, not given up on, online.

    Handlers and status changes update it in O(1), so that the pump's
    stopping rule never scans the clients. ``kind`` names the phase, so that
    a stray message of another phase answers nothing.
    """

    def __init__(self, kind: str, expected: Any = (), online: Any = ()) -> None:
        self.kind = kind
        self.expected = frozenset(expected)
        self.answered: set[str] = set()
        self.given_up: set[str] = set()
        #: Expected, online, neither answered nor given up on.
        self.left: set[str] = set()
        for c in self.expected:
            if c in online:
                self._wait_for(c)

    def answer(self, kind: str, cid: str) -> None:
        if kind == self.kind and cid in self.expected and cid not in self.answered:
            self.answered.add(cid)
            self._stop_waiting(cid)

    def give_up(self, kind: str, cid: str) -> None:
        if kind == self.kind and cid in self.expected and cid not in self.answered:
            self.given_up.add(cid)
            self._stop_waiting(cid)

    def set_online(self, cid: str, online: bool) -> None:
        if cid not in self.expected:
            return
        if not online:
            self._stop_waiting(cid)
        elif cid not in self.answered and cid not in self.given_up:
            self._wait_for(cid)

    # the two changes of ``left``: a subclass keeps its own counts in step here
    def _wait_for(self, cid: str) -> None:
        self.left.add(cid)

    def _stop_waiting(self, cid: str) -> None:
        self.left.discard(cid)


class GroupedAwaited(Awaited):
    """An :class:`Awaited` whose clients are in groups: it also counts, per group, the clients still awaited (O(1)).

    ``group_of``: each client expected, and its group.
    """

    def __init__(self, kind: str, group_of: Mapping[str, Hashable], online: Any = ()) -> None:
        self.group_of = dict(group_of)
        self._waiting = dict.fromkeys(self.group_of.values(), 0)
        super().__init__(kind, self.group_of, online)

    def _wait_for(self, cid: str) -> None:
        if cid not in self.left:
            self._waiting[self.group_of[cid]] += 1
        super()._wait_for(cid)

    def _stop_waiting(self, cid: str) -> None:
        if cid in self.left:
            self._waiting[self.group_of[cid]] -= 1
        super()._stop_waiting(cid)


@dataclass(frozen=True)
class RoundGroup:
    """The devices of one round that train the same models."""

    #: The model keys its tasks offer (``Task.group``).
    models: tuple[str, ...]
    #: Every device tasked in the group, spares included.
    members: frozenset[str]
    #: Updates the strategy's sample asks for (the group's tasks that are not spares).
    needed: int
    #: Answers that close the group (``report_goal`` of ``needed``, at least one): valid updates and refused ones.
    goal: int


class CloseReason(Enum):
    """Why a round closed."""

    #: Nobody left to wait for: every tasked device sent a valid update or went offline.
    ALL_ANSWERED = "all-answered"
    #: Every group reached its report goal; the stragglers had their grace.
    GOAL = "goal"
    #: The deadline passed and no awaited device's progress claim was plausible.
    DEADLINE = "deadline"
    #: The longest a round may last (``max_round_s``).
    CAP = "cap"


class DeviceOutcome(Enum):
    """What became of a device a round tasked."""

    REPORTED = "reported"
    REFUSED = "refused"
    #: Online, not refused, no update by the close: dropped as a straggler (its late update is refused).
    STRAGGLER = "straggler"
    OFFLINE = "offline"


@dataclass(frozen=True)
class RoundClose:
    """How a round's wait ended."""

    reason: CloseReason
    #: Seconds from the round's start to its close.
    close_s: float
    #: Seconds from the start until every group had its goal (None: never).
    goal_s: float | None
    #: The devices whose progress claims kept the round open past its deadline.
    extended_by: frozenset[str]


class RoundWait(GroupedAwaited):
    """One training round's wait (see the module docstring).

    Parameters
    ----------
    rnd : int
        The round.
    tasks : sequence of Task
        The round's tasks; ``Task.spare`` marks the over-selected ones.
    online : iterable of str
        The devices online now.
    report_goal : float
        Share of each group's needed updates that closes it, in (0, 1].
    clock : callable
        Monotonic time (replaceable in tests).
    """

    def __init__(self, rnd: int, tasks: Sequence[Task], online: Iterable[str], *, report_goal: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.round = rnd
        self.clock = clock
        self.started = clock()
        by_group: dict[tuple[str, ...], list[Task]] = {}
        for t in tasks:
            by_group.setdefault(t.group, []).append(t)
        self.groups: dict[tuple[str, ...], RoundGroup] = {}
        for g, ts in sorted(by_group.items()):
            needed = sum(1 for t in ts if not t.spare) or len(ts)
            goal = min(len(ts), goal_count(report_goal, needed))
            self.groups[g] = RoundGroup(g, frozenset(t.cid for t in ts), needed, goal)
        self.spares = frozenset(t.cid for t in tasks if t.spare)
        self._reported = {g: 0 for g in self.groups}
        #: Per group, the devices refused and not (yet) answered with a valid update.
        self._refused = {g: 0 for g in self.groups}
        #: Seconds from the start to each valid update.
        self.reported_at: dict[str, float] = {}
        #: Each refused device's last reason (it may still answer with a valid update).
        self.refusals: dict[str, str] = {}
        #: Valid updates that robust screening then refused at aggregation, with the reason.
        self.screened: dict[str, str] = {}
        #: When every group first had its goal (seconds from the start), or None.
        self.goal_s: float | None = None
        #: The round's requests for updates again (the receiver had no room, or lost one).
        self.reasks = Reasks(rnd, clock=clock)
        super().__init__("update", {t.cid: t.group for t in tasks}, online)

    def elapsed(self) -> float:
        return self.clock() - self.started

    def answer(self, kind: str, cid: str) -> None:
        """A valid update of ``cid`` (once; a refused device that answers now counts as reported)."""
        if kind != self.kind or cid not in self.expected or cid in self.answered:
            return
        self.reported_at[cid] = self.elapsed()
        g = self.group_of[cid]
        if cid in self.refusals:
            self._refused[g] -= 1
        self._reported[g] += 1
        super().answer(kind, cid)
        if self.goal_s is None and self.goal_met():
            self.goal_s = self.reported_at[cid]

    def reopen(self, cid: str) -> None:
        """``cid``'s valid update was lost after it arrived (the ingest worker holding it died): awaited again."""
        if cid not in self.answered:
            return
        self.answered.discard(cid)
        self._reported[self.group_of[cid]] -= 1
        self.reported_at.pop(cid, None)
        if cid in self.refusals:
            self._refused[self.group_of[cid]] += 1
        if not self.goal_met():
            self.goal_s = None
        self._wait_for(cid)

    def refuse(self, cid: str, reason: str) -> bool:
        """A refused update of ``cid``: recorded, counted toward the goal as an answer. Whether it was tasked.

        ``cid`` keeps its place: a valid update before the close still counts.
        """
        if cid not in self.expected:
            return False
        if cid not in self.answered:
            if cid not in self.refusals:
                self._refused[self.group_of[cid]] += 1
                if self.goal_s is None and self.goal_met():
                    self.goal_s = self.elapsed()
            self.refusals[cid] = reason
        return True

    def screen(self, refused_by: dict[str, str]) -> None:
        """Updates the aggregation's screening refused (after the close): recorded as refusals."""
        for cid, reason in refused_by.items():
            if cid in self.answered:
                self.screened[cid] = reason
                self.refusals[cid] = reason

    def was_refused(self, cid: str) -> bool:
        """Whether the round counted nothing of ``cid``'s: its updates refused, or its valid one screened out."""
        return cid in self.screened or (cid in self.refusals and cid not in self.answered)

    def goal_met(self) -> bool:
        """Every group has its goal of answers, valid or refused (a group with nobody left to wait for is done)."""
        return all(self._reported[g] + self._refused[g] >= grp.goal or self._waiting[g] == 0
                   for g, grp in self.groups.items())

    def settled(self) -> bool:
        """Nothing left to wait for, or every group at its goal: what the first wait stops on."""
        return not self.left or self.goal_met()

    def outcome(self, cid: str, online: Callable[[str], bool]) -> DeviceOutcome:
        """What became of tasked device ``cid`` (call after the close)."""
        if self.was_refused(cid):
            return DeviceOutcome.REFUSED
        if cid in self.answered:
            return DeviceOutcome.REPORTED
        return DeviceOutcome.STRAGGLER if online(cid) else DeviceOutcome.OFFLINE

    def record(self, close: RoundClose, online: Callable[[str], bool]) -> WaitRecord:
        """What became of the round's wait: selected, reported, stragglers, refused, goals, close."""
        outcomes = {c: self.outcome(c, online) for c in sorted(self.expected)}
        return WaitRecord(
            selected=len(self.expected), spares=len(self.spares),
            reported=sum(1 for o in outcomes.values() if o is DeviceOutcome.REPORTED),
            stragglers=tuple(sorted(c for c, o in outcomes.items() if o is DeviceOutcome.STRAGGLER)),
            offline=tuple(sorted(c for c, o in outcomes.items() if o is DeviceOutcome.OFFLINE)),
            refused={c: self.refusals[c] for c, o in outcomes.items() if o is DeviceOutcome.REFUSED},
            goals={"+".join(g): GroupGoal(needed=grp.needed, goal=grp.goal, selected=len(grp.members),
                                          reported=self._reported[g]) for g, grp in self.groups.items()},
            reported_s={c: round(s, 3) for c, s in sorted(self.reported_at.items())},
            close=close.reason, close_s=round(close.close_s, 3),
            goal_s=None if close.goal_s is None else round(close.goal_s, 3),
            extended_by=tuple(sorted(close.extended_by)), reasked=self.reasks.to_dict(),
            unreceipted=self.reasks.unreceipted())


@dataclass(frozen=True)
class GroupGoal:
    """One group's report goal in a round: the updates it needed, its goal, its selected and reported devices."""

    needed: int
    goal: int
    selected: int
    reported: int


@dataclass(frozen=True)
class WaitRecord:
    """What became of a round's wait (:meth:`RoundWait.record`); :meth:`to_dict` is its part of the round's record."""

    selected: int
    spares: int
    reported: int
    stragglers: tuple[str, ...]
    offline: tuple[str, ...]
    #: The devices whose answer was refused, with the reason.
    refused: dict[str, str]
    #: Each group's goal, by its model keys joined with "+".
    goals: dict[str, GroupGoal]
    #: When each device's update arrived (seconds into the round).
    reported_s: dict[str, float]
    close: CloseReason
    close_s: float
    goal_s: float | None = None
    #: The devices whose progress claims extended the deadline.
    extended_by: tuple[str, ...] = field(default_factory=tuple)
    #: Updates asked for again, per reason (:class:`~.reask.ReaskWhy`'s value).
    reasked: dict[str, int] = field(default_factory=dict)
    #: Updates said sent that their receiver (an ingest worker's id, or "server") never took, per receiver.
    unreceipted: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The wait's fields of the round's record in ``results.json``."""
        return {
            "selected": self.selected, "spares": self.spares, "reported": self.reported,
            "stragglers": list(self.stragglers), "offline": list(self.offline), "refused": dict(self.refused),
            "goals": {k: vars(g).copy() for k, g in self.goals.items()}, "reported_s": dict(self.reported_s),
            "close": self.close.value, "close_s": self.close_s, "goal_s": self.goal_s,
            "extended_by": list(self.extended_by), "reasked": dict(self.reasked),
            "unreceipted": dict(self.unreceipted),
        }
