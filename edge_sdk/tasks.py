"""What crosses between a strategy and a device: the settings, the task, the update.

Public for strategy and driver authors: the server's strategies build
:class:`Task` objects and combine :class:`Update` objects; a device's
:class:`~edge_sdk.worker.LocalWorker` turns the one into the other. A task
offers one model (most methods) or K (IFCA, where the device keeps the one
with the lowest loss on a local batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .compress.frames import CodedChange

__all__ = ["Task", "TrainSettings", "Update", "Weights"]

#: A model's tensors by parameter name.
Weights = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class TrainSettings:
    """Local training settings a strategy sends with a task."""

    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 32
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if int(self.epochs) < 1:
            raise ValueError(f"epochs must be a positive integer, got {self.epochs!r}")
        if not float(self.lr) > 0:
            raise ValueError(f"lr must be positive, got {self.lr!r}")
        if int(self.batch_size) < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"epochs": int(self.epochs), "lr": float(self.lr),
                "batch_size": int(self.batch_size), "optimizer": self.optimizer}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainSettings:
        return cls(epochs=int(d.get("epochs", 1)), lr=float(d.get("lr", 1e-3)),
                   batch_size=int(d.get("batch_size", 32)), optimizer=str(d.get("optimizer", "adam")))


@dataclass(frozen=True)
class Task:
    """One client's work for one round.

    ``models`` maps a model key (``"global"``, ``"c0"``, ...) to its weights.
    With several models the client evaluates each on one local batch and
    trains the one with the lowest loss (IFCA's selection).
    """

    cid: str
    round: int
    models: Mapping[str, Weights]
    settings: TrainSettings = field(default_factory=TrainSettings)
    evaluate_first: bool = True
    #: Over-selected: a margin over what the round needs, so that a slow device does not hold it open.
    spare: bool = False

    @property
    def group(self) -> tuple[str, ...]:
        """The model keys offered, sorted: the tasks of a round that offer the same models form one group."""
        return tuple(sorted(self.models))


@dataclass(frozen=True)
class Update:
    """A client's answer to a :class:`Task`.

    A compressed update arrives as ``delta`` (decoded: the change from the
    model it was trained from, version ``version``), with ``weights`` empty
    until the server's aggregation adds it to that model; or, where the
    server decodes an ``int8`` or ``int4`` update only as it sums it, as
    ``coded`` (its codes as they came, with the norm of their change), with
    ``weights`` empty and ``delta`` None.
    """

    cid: str
    round: int
    model_key: str
    weights: dict[str, np.ndarray]
    n_samples: int
    loss: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    delta: Mapping[str, np.ndarray] | None = None
    version: int | None = None
    coded: CodedChange | None = None

    @property
    def speaks_for(self) -> tuple[str, ...]:
        """The devices whose training it carries: its own (a server's partial sum carries several)."""
        return (self.cid,)
