"""The report goal's arithmetic, one rule for a training round, a pre-training round and the final evaluation.

- :func:`goal_count`: the answers a share ``report_goal`` of ``n`` asks for
  (rounded up, at least one: below 10 devices a goal of 0.9 asks for all);
- :func:`grace_s`: once a goal is met, how long the devices still out are
  waited for (``straggler_grace`` times the time the goal took, at least
  ``min_grace_s``).
"""

from __future__ import annotations

import math

__all__ = ["DEFAULT_REPORT_GOAL", "MIN_GRACE_S", "goal_count", "grace_s"]

#: The server's default report goal: every answer below 10 devices, 90 % from 10 on.
DEFAULT_REPORT_GOAL = 0.9
#: The shortest grace after a goal (seconds): rounds of a fraction of a second still let the devices a few network
#: round trips behind the others in.
MIN_GRACE_S = 0.2


def goal_count(report_goal: float, n: int) -> int:
    """The answers that meet the share ``report_goal`` of ``n``: ``ceil(report_goal x n)``, at least 1.

    >>> goal_count(0.9, 9), goal_count(0.9, 10), goal_count(0.9, 20), goal_count(0.9, 70)
    (9, 9, 18, 63)
    """
    return max(1, math.ceil(report_goal * n - 1e-9))


def grace_s(goal_s: float, straggler_grace: float, min_grace_s: float = MIN_GRACE_S) -> float:
    """The wait after a goal met ``goal_s`` seconds in: ``straggler_grace x goal_s``, at least ``min_grace_s``.

    No grace at all when ``straggler_grace`` is 0.

    >>> grace_s(5.0, 0.2), grace_s(0.1, 0.2), grace_s(5.0, 0.0)
    (1.0, 0.2, 0.0)
    """
    if straggler_grace <= 0:
        return 0.0
    return max(straggler_grace * goal_s, min_grace_s)
