"""FedAvg per cluster: the base of every method that ends with one model per cluster."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Task, TrainSettings, Update

from .base import Strategy, add_updates, copy_weights

__all__ = ["ClusteredFedAvg"]


class ClusteredFedAvg(Strategy):
    """FedAvg per cluster for a given assignment of clients to clusters.

    The base of every method that ends with one model per cluster. With
    ``shared_prefixes`` (for example the convolution layers of LeNet-5, as in
    the paper's reference setting), parameters whose name starts with one of
    them are averaged over all clients of the round, the rest per cluster.
    """

    name = "clustered"

    def __init__(self, *, shared_prefixes: Sequence[str] = (), **kw: Any) -> None:
        super().__init__(**kw)
        self.shared_prefixes = tuple(shared_prefixes)
        self.assignment: dict[str, int] = {}

    @staticmethod
    def key(cluster: int) -> str:
        return f"c{int(cluster)}"

    def set_assignment(self, assignment: Mapping[str, int]) -> None:
        """Give every client a cluster; each cluster starts from the current global model."""
        self.assignment = {cid: int(k) for cid, k in assignment.items()}
        base = self.models.get(self.default_key) or next(iter(self.models.values()))
        for k in sorted(set(self.assignment.values())):
            self.models.setdefault(self.key(k), copy_weights(base))
        self.models.pop(self.default_key, None)

    def clusters(self) -> dict[str, int]:
        return dict(self.assignment) if self.assignment else super().clusters()

    def is_clustered(self, cid: str) -> bool:
        return cid in self.assignment if self.assignment else cid in self.clients

    def model_key_for(self, cid: str) -> str:
        if not self.assignment:
            return self.default_key
        if cid not in self.assignment:
            raise KeyError(f"client {cid!r} has no cluster")
        return self.key(self.assignment[cid])

    def configure_round(self, rnd: int, available: Sequence[str]) -> list[Task]:
        if not self.assignment:
            chosen = self._sample([c for c in available if c in self.clients], rnd)
            return [Task(c, rnd, {self.default_key: self.models[self.default_key]}, self.settings) for c in chosen]
        tasks = []
        for k in sorted(set(self.assignment.values())):
            members = [c for c in available if self.assignment.get(c) == k]
            key = self.key(k)
            chosen = self._sample(members, rnd, k + 1, self.cluster_fraction(k, rnd))
            settings = self.cluster_settings(k, rnd)
            tasks += [Task(c, rnd, {key: self.models[key]}, settings) for c in chosen]
        return tasks

    def cluster_settings(self, cluster: int, rnd: int) -> TrainSettings:
        """The local training settings of ``cluster``'s devices in round ``rnd`` (default: the strategy's)."""
        return self.settings

    def cluster_fraction(self, cluster: int, rnd: int) -> float | None:
        """The share of ``cluster``'s devices that train in round ``rnd`` (None: the strategy's ``fraction``)."""
        return None

    def _is_shared(self, name: str) -> bool:
        return bool(self.shared_prefixes) and name.startswith(self.shared_prefixes)

    def _combine(self, rnd: int, updates: Sequence[Update]) -> dict[str, Any]:
        summary: dict[str, Any] = {}
        accepted = 0
        for key in sorted(self.models):
            agg = self._new_aggregator(self.models[key])
            n = add_updates(agg, updates, key)
            accepted += n
            if n:
                self.models[key] = agg.result()
            summary[key] = n
        shared = [n for n in next(iter(self.models.values())) if self._is_shared(n)]
        if shared and len(self.models) > 1:
            template = {n: next(iter(self.models.values()))[n] for n in shared}
            agg = self._new_aggregator(template)
            n_shared = sum(add_updates(agg, updates, key, shared) for key in sorted(self.models))
            if n_shared:
                avg = agg.result()
                for key in self.models:
                    self.models[key].update({n: v.copy() for n, v in avg.items()})
            summary["shared"] = n_shared
        summary["updates"] = accepted
        summary["rejected"] = len(updates) - accepted
        return summary

    def state(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        meta, tensors = super().state()
        meta["assignment"] = dict(self.assignment)
        return meta, tensors

    def load_state(self, meta: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
        super().load_state(meta, tensors)
        self.assignment = {c: int(k) for c, k in meta.get("assignment", {}).items()}
