"""Hostile devices, for the robustness tests and ``benchmarks/robustness.py``.

Each is a :class:`edge_sdk.worker.LocalWorker` whose ``fit`` attacks its
cluster the way one admitted device did in issue 11 (its ``attack``):

* ``scale``: its honest update's delta times 1000;
* ``huge``: every weight 1e30;
* ``random``: standard normal weights, claiming 10**12 samples;
* ``cross``: ``scale``, sent under another cluster's model key (:func:`other_key`).

:class:`SurvivingWorker` is the honest device of those runs: when training
from a wrecked model diverges (only without defences) it sends the model back
unchanged, so that an undefended run still ends and can be scored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from edge_sdk.tasks import Task, Update
from edge_sdk.worker import LocalWorker

__all__ = ["ATTACKS", "HostileWorker", "SurvivingWorker", "other_key"]

#: The attacks a :class:`HostileWorker` knows.
ATTACKS = ("scale", "huge", "random", "cross")


def other_key(key: str) -> str:
    """The cluster a cross-cluster attacker targets: c1 from c0, else c0."""
    return "c1" if key == "c0" else "c0"


class SurvivingWorker(LocalWorker):
    """An honest device that sends the model back unchanged when training from a wrecked model diverges."""

    def fit(self, task: Task, **kw: Any) -> Update:
        try:
            return super().fit(task, **kw)
        except RuntimeError:  # "training diverged": only in the undefended runs
            key = next(iter(task.models))
            return Update(self.cid, task.round, key, dict(task.models[key]), len(self.y), float("nan"))


class HostileWorker(SurvivingWorker):
    """The hostile device: its ``attack`` (see the module docstring) replaces every update."""

    attack = "scale"

    def fit(self, task: Task, **kw: Any) -> Update:
        if self.attack in ("scale", "cross"):
            u = super().fit(task, **kw)
            ref = task.models[u.model_key]
            weights = {k: (ref[k] + 1000 * (v - ref[k])).astype(v.dtype) if v.dtype.kind == "f" else v
                       for k, v in u.weights.items()}
            key = other_key(u.model_key) if self.attack == "cross" else u.model_key
            return dataclasses.replace(u, weights=weights, model_key=key)
        key = next(iter(task.models))
        ref = task.models[key]
        if self.attack == "huge":
            return Update(self.cid, task.round, key, {k: np.full_like(v, 1e30) if v.dtype.kind == "f" else v
                                                      for k, v in ref.items()}, len(self.y), 0.1)
        rng = np.random.default_rng(task.round)
        return Update(self.cid, task.round, key, {k: rng.standard_normal(v.shape).astype(v.dtype)
                                                  if v.dtype.kind == "f" else v for k, v in ref.items()},
                      10**12, 0.1)
