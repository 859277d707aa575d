"""What reaches a round besides a device's own update: an ingest worker's receipt of one, and its partial sum.

A device's update is an :class:`edge_sdk.tasks.Update`. With ingest workers
(:mod:`server_kit.partials`), the server gets instead

- a :class:`Receipt` per update a worker holds: who trained which model, on
  how many samples, with what loss (the weights stay with the worker);
- at the close, a :class:`PartialSum` per worker and model: the weighted mean
  of the kept updates of its ``members``, which a strategy combines as one
  update weighted by their total samples.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["PartialSum", "Receipt"]


@dataclass(frozen=True)
class Receipt:
    """An ingest worker holds ``cid``'s update of round ``round`` for ``model_key`` (its weights stay there)."""

    cid: str
    round: int
    model_key: str
    n_samples: int
    loss: float = math.nan
    metrics: Mapping[str, float] = field(default_factory=dict)
    version: int | None = None


@dataclass(frozen=True)
class PartialSum:
    """Ingest worker ``aggregator``'s weighted mean of its ``members``' updates of ``model_key``.

    It is combined as one update of ``n_samples`` (the members' total) samples;
    a method that reads each update refuses partial sums
    (:func:`server_kit.strategies.capabilities.partials_refusal`).
    """

    aggregator: str
    round: int
    model_key: str
    weights: dict[str, np.ndarray]
    n_samples: int
    members: tuple[str, ...]

    @property
    def cid(self) -> str:
        """Who sent it (the logs name the worker)."""
        return self.aggregator

    @property
    def speaks_for(self) -> tuple[str, ...]:
        """The devices whose updates it carries."""
        return self.members
