"""When a training round closes: its report goal, a grace for the stragglers, its deadline, plausible claims.

:func:`wait_round` pumps the server's messages for one round and returns
how the wait ended (:class:`~.round_wait.RoundClose`):

1. until nobody is left to wait for, or every group of the round has its
   report goal, or the round's deadline;
2. nobody left (every tasked device sent a valid update or went offline):
   the round closes at once (``ALL_ANSWERED``);
3. every group at its goal: the devices still awaited (stragglers, and
   refused devices that may still send a valid update) get a grace of
   ``straggler_grace`` times the time the goal took (at least
   ``min_grace_s``), then the round closes (``GOAL``); a device's "still
   training" never extends it further;
4. past the deadline, goal not reached: the round stays open only while an
   awaited device reported progress on this round within
   ``progress_grace_s`` AND its claim is plausible
   (:meth:`~.pace.Pace.may_extend`: the round is younger than twice the
   device's measured training time, or its group's, and the device never
   broke such a promise); otherwise it closes (``DEADLINE``);
5. never past ``max_round_s`` (``CAP``).

:func:`~.answers.wait_answers` closes the final evaluation the same way (its
goals, the same grace: :mod:`.goals`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from .goals import MIN_GRACE_S, grace_s
from .pace import Pace
from .round_wait import CloseReason, RoundClose, RoundWait

__all__ = ["ClosePolicy", "wait_round"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClosePolicy:
    """How long a round waits (from :class:`~.config.ServerConfig`)."""

    #: Seconds before progress claims are looked at.
    deadline_s: float
    #: Longest the round may last.
    max_round_s: float
    #: A claim counts this long after it was made (a device reports every 10 s while it trains).
    progress_grace_s: float
    #: The stragglers' grace once every group has its goal, as a share of the time the goal took.
    straggler_grace: float
    #: The shortest such grace (0 when ``straggler_grace`` is 0): rounds of a fraction of a second still let the
    #: devices a few network round trips behind the others in.
    min_grace_s: float = MIN_GRACE_S


def wait_round(pump: Callable[[Callable[[], bool], float], bool], wait: RoundWait, policy: ClosePolicy, pace: Pace,
               claims: Callable[[], Mapping[str, tuple[int, float]]],
               clock: Callable[[], float] = time.monotonic) -> RoundClose:
    """Wait for round ``wait.round`` as the module docstring says; returns how the wait ended.

    Parameters
    ----------
    pump : callable
        ``pump(until, timeout)``: handle messages until ``until()`` or ``timeout`` seconds (``ServerLink.pump``).
    wait : RoundWait
        The round's wait, kept up to date by the message handlers.
    policy : ClosePolicy
    pace : Pace
        The run's measured training times and broken promises.
    claims : callable
        The awaited devices' last progress claims: ``{cid: (round, when)}`` (``when`` on ``clock``).
    clock : callable
        The clock of ``claims`` and of ``wait``.
    """
    extended: set[str] = set()

    def closed(reason: CloseReason) -> RoundClose:
        return RoundClose(reason, wait.elapsed(), wait.goal_s, frozenset(extended))

    pump(wait.settled, max(0.0, policy.deadline_s - wait.elapsed()))
    while True:
        elapsed = wait.elapsed()
        if not wait.left:
            return closed(CloseReason.ALL_ANSWERED)
        if wait.goal_met():
            goal_s = wait.goal_s if wait.goal_s is not None else elapsed
            grace = max(0.0, goal_s + grace_s(goal_s, policy.straggler_grace, policy.min_grace_s) - elapsed)
            grace = min(grace, max(0.0, policy.max_round_s - elapsed))
            if not pump(lambda: not wait.left, grace) and wait.left:
                log.info("round %d: report goal reached at %.1f s; closing after a %.1f s grace without %d "
                         "device(s) still awaited", wait.round, goal_s, grace, len(wait.left))
            return closed(CloseReason.ALL_ANSWERED if not wait.left else CloseReason.GOAL)
        if elapsed >= policy.max_round_s:
            return closed(CloseReason.CAP)
        now = clock()
        live = claims()
        working = sorted(cid for cid in wait.left if (w := live.get(cid)) is not None and w[0] == wait.round
                         and now - w[1] <= policy.progress_grace_s
                         and pace.may_extend(cid, wait.group_of[cid], elapsed))
        if not working:
            return closed(CloseReason.DEADLINE)
        extended.update(working)
        log.info("round %d: past its deadline, %d device(s) still training (%s): waiting on", wait.round,
                 len(working), ", ".join(working[:5]) + (" ..." if len(working) > 5 else ""))
        # look again when the last plausible claim runs out, or a claim goes stale
        plausible = max((pace.plausible_s(c, wait.group_of[c]) or policy.max_round_s) for c in working)
        until = min(elapsed + policy.progress_grace_s, policy.max_round_s, plausible + 0.01)
        pump(wait.settled, max(0.01, until - elapsed))
