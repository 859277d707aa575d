"""A round's plan: the strategy's tasks, plus spares where a group can have them (``--over-select``).

The default (``over_select`` None) protects a fleet without changing a lab:
a group that needs at least :data:`SPARES_FROM` (10) devices gets
:data:`DEFAULT_OVER_SELECT` (10 %) more, rounded up; a smaller group none,
exactly as without spares. A number given applies to every group.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from edge_sdk.tasks import Task

__all__ = ["DEFAULT_OVER_SELECT", "SPARES_FROM", "SPARE_SALT", "Planner", "plan_tasks", "spare_count"]

#: The salt of the seeded choice of spare devices (:func:`plan_tasks`).
SPARE_SALT = 7919
#: The default rule's share of spares (``over_select`` None) ...
DEFAULT_OVER_SELECT = 0.1
#: ... in the groups that need at least this many devices (the smaller ones get none).
SPARES_FROM = 10


class Planner(Protocol):
    """What a round's plan asks of a strategy (every :class:`~server_kit.strategies.base.Strategy` is one)."""

    seed: int
    clients: Mapping[str, Any]

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]: ...

    def model_key_for(self, cid: str) -> str: ...


def spare_count(needed: int, over_select: float | None) -> int:
    """The spares of a group that needs ``needed`` devices: ``ceil(needed x (1 + over_select)) - needed``.

    ``over_select`` None: the default rule (see the module docstring).

    >>> spare_count(9, None), spare_count(10, None), spare_count(20, None), spare_count(2, 0.3)
    (0, 1, 2, 1)
    """
    if over_select is None:
        if needed < SPARES_FROM:
            return 0
        over_select = DEFAULT_OVER_SELECT
    return max(0, math.ceil(needed * (1.0 + over_select) - 1e-9) - needed)


def plan_tasks(strategy: Planner, rnd: int, available: Sequence[str], over_select: float | None = 0.0
               ) -> list[Task]:
    """The strategy's tasks of round ``rnd`` (``configure_round``), plus spares: ``over_select`` more devices per group.

    A group is the devices offered the same models (one cluster's, or all of
    IFCA's K). A group whose round needs ``n`` devices gets
    :func:`spare_count` spares (as many as it has; ``over_select`` None: the
    default rule of the module docstring), seeded by
    round, from the available devices of the strategy not tasked yet whose
    model (``model_key_for``) the group offers; each spare gets its group's
    models and settings, marked ``Task.spare``. With 0 (the default) the
    tasks are ``configure_round``'s, unchanged.
    """
    tasks = strategy.configure_round(rnd, available)
    if (over_select is not None and over_select <= 0) or not tasks:
        return tasks
    groups: dict[tuple[str, ...], list[Task]] = {}
    for t in tasks:
        groups.setdefault(t.group, []).append(t)
    taken = {t.cid for t in tasks}
    free = sorted(c for c in available if c not in taken and c in strategy.clients)
    spares: list[Task] = []
    for i, (group, members) in enumerate(sorted(groups.items())):
        want = spare_count(len(members), over_select)
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
