"""Plain FedAvg (McMahan et al.): the interface at its smallest, and the worked example of a strategy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edge_sdk.tasks import Task, Update

from .base import Strategy, add_updates

__all__ = ["FedAvg"]


class FedAvg(Strategy):
    """Plain FedAvg (McMahan et al.): one model, a fraction of the clients per round."""

    name = "fedavg"

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        chosen = self._sample([c for c in available if c in self.clients], rnd)
        model = self.models[self.default_key]
        return [Task(cid, rnd, {self.default_key: model}, self.settings) for cid in chosen]

    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        agg = self._new_aggregator(self.models[self.default_key])
        accepted = add_updates(agg, updates, self.default_key)
        if accepted:
            self.models[self.default_key] = agg.result()
        return {"updates": accepted, "rejected": len(updates) - accepted}
