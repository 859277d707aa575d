"""The in-process side of a training round: each task trained where it is, its bytes counted as sent.

The simulator's :class:`~server_kit.rounds.training.RoundPort` and
:class:`~server_kit.rounds.recorded.RecordedIntake`: "sending" a round counts the
``train`` command and the models each device would download; "waiting" trains
the round's tasks with their devices' :class:`~edge_sdk.worker.LocalWorker`
(:class:`~server_kit.drivers.sim_training.RoundTraining`: one by one or batched)
and records each update, in plan order, as the device would send it (the run's
update codec, its bytes counted). Every device answers: the round closes with all answered.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from edge_sdk.tasks import Task, Update

from ..rounds.recorded import RecordedIntake
from ..rounds.round_wait import CloseReason, RoundClose, RoundWait

__all__ = ["SimulatedPort"]


class SimulatedPort:
    """Trains each task in process (see the module docstring).

    ``count_tasks(tasks)``: the command and model bytes of the round's tasks;
    ``train_round(tasks) -> updates``: the tasks trained, each update as the server gets it, in order.
    """

    def __init__(self, intake: RecordedIntake, devices: Collection[str], *,
                 count_tasks: Callable[[Sequence[Task]], None],
                 train_round: Callable[[Sequence[Task]], Sequence[Update]]) -> None:
        self.intake = intake
        self.devices = frozenset(devices)
        self.count_tasks = count_tasks
        self.train_round = train_round
        #: The round's tasks, in plan order.
        self.tasks: list[Task] = []

    def online_ids(self) -> Collection[str]:
        return self.devices

    def send(self, rnd: int, tasks: Sequence[Task]) -> tuple[int, dict[str, int]]:
        self.count_tasks(tasks)
        self.tasks = list(tasks)
        return 0, {}  # the bytes are in the simulator's ledger

    def wait(self, rnd: int, wait: RoundWait) -> RoundClose:
        for t, u in zip(self.tasks, self.train_round(self.tasks), strict=True):
            self.intake.updates[t.cid] = u
            wait.answer("update", t.cid)
        return RoundClose(CloseReason.ALL_ANSWERED, wait.elapsed(), wait.goal_s, frozenset())

    def remote(self) -> None:
        return None

    def bench(self, cid: str, reason: str) -> None:
        return None  # every simulated device answers: none is benched
