"""A round's plan: the strategy's tasks, plus spares where a group can have them (``--over-select``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from edge_sdk.tasks import Task

__all__ = ["SPARE_SALT", "Planner", "plan_tasks"]

#: The salt of the seeded choice of spare devices (:func:`plan_tasks`).
SPARE_SALT = 7919


class Planner(Protocol):
    """What a round's plan asks of a strategy (every :class:`~server_kit.strategies.base.Strategy` is one)."""

    seed: int
    clients: Mapping[str, Any]

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]: ...

    def model_key_for(self, cid: str) -> str: ...


def plan_tasks(strategy: Planner, rnd: int, available: Sequence[str], over_select: float = 0.0) -> list[Task]:
    """The strategy's tasks of round ``rnd`` (``configure_round``), plus spares: ``over_select`` more devices per group.

    A group is the devices offered the same models (one cluster's, or all of
    IFCA's K). A group whose round needs ``n`` devices gets
    ``ceil(n * (1 + over_select)) - n`` spares (as many as it has), seeded by
    round, from the available devices of the strategy not tasked yet whose
    model (``model_key_for``) the group offers; each spare gets its group's
    models and settings, marked ``Task.spare``. With 0 (the default) the
    tasks are ``configure_round``'s, unchanged.
    """
    tasks = strategy.configure_round(rnd, available)
    if over_select <= 0 or not tasks:
        return tasks
    groups: dict[tuple[str, ...], list[Task]] = {}
    for t in tasks:
        groups.setdefault(t.group, []).append(t)
    taken = {t.cid for t in tasks}
    free = sorted(c for c in available if c not in taken and c in strategy.clients)
    spares: list[Task] = []
    for i, (group, members) in enumerate(sorted(groups.items())):
        want = math.ceil(len(members) * (1.0 + over_select) - 1e-9) - len(members)
        pool = [c for c in free if c not in taken and _offers(strategy, c, group)]
        if want <= 0 or not pool:
            continue
        rng = np.random.default_rng([strategy.seed, rnd, SPARE_SALT, i])
        chosen = sorted(rng.choice(pool, size=min(want, len(pool)), replace=False).tolist())
        model = members[0]
        spares += [Task(c, rnd, model.models, model.settings, model.evaluate_first, spare=True) for c in chosen]
        taken.update(chosen)
    return tasks + spares


def _offers(strategy: Planner, cid: str, group: tuple[str, ...]) -> bool:
    """Whether device ``cid`` belongs with a group offered the models ``group``."""
    try:
        return strategy.model_key_for(cid) in group
    except KeyError:  # a device without a cluster yet
        return False
