"""A phase that waits for one answer per device, closed at a report goal per group (the final evaluation's).

:class:`GoalWait` is a :class:`~.round_wait.GroupedAwaited` whose devices are
grouped (by the model they evaluate: one group per cluster), each group
with a report goal: :func:`~.goals.goal_count` of its devices online when
the wait began, so that a group of fewer than 10 waits for all of them at
the default 0.9, as a round's group does. It keeps its counts in O(1) per
message. :func:`wait_answers` pumps until nobody is left, or every group
has its goal (then the round's grace, :func:`~.goals.grace_s`), or the
timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from .goals import MIN_GRACE_S, goal_count, grace_s
from .round_wait import CloseReason, GroupedAwaited, RoundClose

__all__ = ["GoalWait", "wait_answers"]


class GoalWait(GroupedAwaited):
    """The devices a phase waits for, by group, each group with its report goal.

    Parameters
    ----------
    kind : str
        The answer's kind (``"metrics"``).
    group_of : mapping of str to str
        Each device waited for, and its group (its model key).
    online : iterable of str
        The devices online now (the others are not waited for, nor counted in a goal).
    report_goal : float
        The share of each group's online devices whose answers meet its goal, in (0, 1].
    """

    def __init__(self, kind: str, group_of: Mapping[str, str], online: Iterable[str], report_goal: float) -> None:
        #: Per group, its devices answered.
        self._answered = dict.fromkeys(group_of.values(), 0)
        super().__init__(kind, group_of, online)
        #: Per group, the answers that meet its goal (of its devices online now).
        self.goals = {g: goal_count(report_goal, n) for g, n in self._waiting.items()}

    def answer(self, kind: str, cid: str) -> None:
        if kind == self.kind and cid in self.expected and cid not in self.answered:
            self._answered[self.group_of[cid]] += 1
        super().answer(kind, cid)

    def goal_met(self) -> bool:
        """Every group has its goal of answers, or nobody left to wait for (O(groups))."""
        return all(self._answered[g] >= goal or self._waiting[g] == 0 for g, goal in self.goals.items())


def wait_answers(pump: Callable[[Callable[[], bool], float], bool], awaited: GoalWait, *, timeout_s: float,
                 straggler_grace: float, min_grace_s: float = MIN_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> RoundClose:
    """Wait for ``awaited``'s answers until every group has its goal (then a grace), nobody is left, or ``timeout_s``.

    Parameters
    ----------
    pump : callable
        ``pump(until, timeout)``: handle messages until ``until()`` or ``timeout`` seconds (``ServerLink.pump``).
    awaited : GoalWait
        The devices asked, kept up to date by the message handlers.
    timeout_s : float
        The longest the wait may last, grace included.
    straggler_grace, min_grace_s : float
        The grace once every goal is met (:func:`~.goals.grace_s`).
    clock : callable
        Monotonic seconds (the pump's clock).

    Returns
    -------
    RoundClose
        ``ALL_ANSWERED`` (nobody left: every device asked answered or went
        offline), ``GOAL`` (every goal met, the grace over, devices still
        out) or ``DEADLINE`` (``timeout_s`` passed before the goals).
    """
    started = clock()

    def closed(reason: CloseReason, goal_s: float | None) -> RoundClose:
        return RoundClose(reason, clock() - started, goal_s, frozenset())

    pump(lambda: not awaited.left or awaited.goal_met(), timeout_s)
    goal_s = clock() - started if awaited.goal_met() else None
    if not awaited.left:
        return closed(CloseReason.ALL_ANSWERED, goal_s)
    if goal_s is None:
        return closed(CloseReason.DEADLINE, None)
    grace = min(grace_s(goal_s, straggler_grace, min_grace_s), max(0.0, timeout_s - goal_s))
    pump(lambda: not awaited.left, grace)
    return closed(CloseReason.ALL_ANSWERED if not awaited.left else CloseReason.GOAL, goal_s)
