"""The intake of a driver that records each update itself: the simulator's, Flower's.

:class:`RecordedIntake` is a :class:`~.training.RoundIntake` whose driver puts
each update in :attr:`RecordedIntake.updates` as it has it (trained in
process, or read from a Flower reply), in the order the round planned its
tasks; the round combines them in that order.
"""

from __future__ import annotations

from collections.abc import Collection

from edge_sdk.tasks import Task, Update

from .arrivals import Receipt
from .round_wait import RoundWait

__all__ = ["RecordedIntake"]


class RecordedIntake:
    """What a round recorded: the updates, in the order the tasks were planned (see the module docstring)."""

    def __init__(self) -> None:
        self.updates: dict[str, Update] = {}
        self.tasked: set[str] = set()
        self.wait: RoundWait | None = None

    def open_round(self, rnd: int, tasks: list[Task], online: Collection[str], *, report_goal: float = 1.0
                   ) -> RoundWait:
        self.updates, self.tasked = {}, {t.cid for t in tasks}
        self.wait = RoundWait(rnd, tasks, online, report_goal=report_goal)
        return self.wait

    def close_round(self) -> None:
        self.wait = None

    def arrivals(self) -> tuple[list[Update], list[Receipt]]:
        return list(self.updates.values()), []
