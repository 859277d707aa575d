"""What a client does with its data, whatever carries the messages.

A :class:`LocalWorker` holds one client's local data and answers the
server's requests: its registration facts, its sketch, a training task, an
evaluation. The MQTT edge client (:mod:`edge_sdk.client`) and the in-process
simulator (:mod:`server_kit.drivers.simulate`) both call it, so a simulated run and a
real fleet execute the same client code.

It turns a :class:`~edge_sdk.tasks.Task` into an
:class:`~edge_sdk.tasks.Update` (:mod:`edge_sdk.tasks`: what crosses between a
strategy and a device).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .sketch import Sketch, Sketcher
from .tasks import Task, Update, Weights

if TYPE_CHECKING:
    from .training.trainer import TrainResult

__all__ = ["FitAsk", "FitPlan", "LocalWorker", "lowest_loss"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitPlan:
    """A training task's choices before it trains: the model's key, the shuffling seed, metrics so far."""

    key: str
    seed: int | None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FitAsk:
    """What a training task needs evaluated before it trains; whoever holds the models may answer it.

    A device answers its own (:meth:`LocalWorker.plan_asked`); a simulator on
    a GPU answers a round's at once, each model run once over the rows of
    every device it is offered to
    (:class:`server_kit.drivers.sim_eval.DeviceEvaluation`).
    """

    #: Rows of the local training data the offered models' losses are compared on (IFCA); None: one model offered.
    rows: np.ndarray | None
    #: Whether the chosen model is evaluated on the local test data before training.
    evaluate_first: bool
    #: The task's shuffling seed.
    seed: int | None

    def answered(self, key: str, before: Mapping[str, float] | None) -> FitPlan:
        """The plan once answered: the model ``key`` chosen, ``before`` its evaluation (if asked)."""
        metrics = {} if before is None else {"acc_before": float(before["accuracy"]),
                                             "loss_before": float(before["loss"])}
        return FitPlan(key, self.seed, metrics)


def lowest_loss(losses: Mapping[str, float]) -> str:
    """The key of the lowest loss; of equal losses, the first key in sorted order."""
    return min(sorted(losses), key=lambda k: losses[k])


class LocalWorker:
    """One client's local data and the operations the server may ask for.

    Parameters
    ----------
    cid : str
        Client id.
    x, y : ndarray
        Local training samples (float32 in [0, 1], the model's input shape or
        its image shape) and integer labels.
    x_test, y_test : ndarray, optional
        Local test samples for evaluation (default: the training data).
    architecture : str, optional
        Key of the classifier in :data:`edge_sdk.training.nets.ARCHITECTURES`; None
        until the server says which (its ``welcome`` and ``train`` commands).
    num_classes : int
        Number of classes of the federation.
    seed : int, optional
        Seed of local shuffling.
    selection : {"onnx", "torch"}
        Runtime of the evaluations :meth:`select` makes to pick a model
        (IFCA): ``"onnx"`` (default) runs the architecture's shipped ONNX
        template in ONNX Runtime, as a device without torch does; ``"torch"``
        runs the torch model (falling back to ONNX where torch is missing).
    """

    def __init__(
        self,
        cid: str,
        x: np.ndarray,
        y: np.ndarray,
        x_test: np.ndarray | None = None,
        y_test: np.ndarray | None = None,
        *,
        architecture: str | None = None,
        num_classes: int = 10,
        seed: int | None = None,
        selection: str = "onnx",
    ) -> None:
        if selection not in ("onnx", "torch"):
            raise ValueError(f"selection must be 'onnx' or 'torch', got {selection!r}")
        self.cid = cid
        self.replace_data(x, y, x_test, y_test)
        self.architecture = architecture
        self.num_classes = int(num_classes)
        self.seed = seed
        self.selection = selection
        self._calls = 0

    def replace_data(self, x: np.ndarray, y: np.ndarray, x_test: np.ndarray | None = None,
                     y_test: np.ndarray | None = None) -> None:
        """Use new local data from now on (the device's data changed: a moved camera, new samples)."""
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if len(y) == 0:
            raise ValueError(f"client {self.cid!r} has no training samples")
        self.x, self.y = np.asarray(x, dtype=np.float32), np.asarray(y, dtype=np.int64)
        #: Whether the device has a test split of its own (else it is evaluated on its training data).
        self.has_test = x_test is not None
        self.x_test = self.x if x_test is None else np.asarray(x_test, dtype=np.float32)
        self.y_test = self.y if y_test is None else np.asarray(y_test, dtype=np.int64)

    def hello(self) -> dict[str, Any]:
        """Registration facts: sample count, classes, sample shape, capabilities (torch or not), version."""
        from . import __version__
        from .training.trainer import torch_available

        caps = ["sketch", "evaluate-onnx"] + (["train-torch", "evaluate-torch"] if torch_available() else [])
        hello = {
            "n_samples": int(len(self.y)),
            "n_test": int(len(self.y_test)),
            "classes_present": int(len(np.unique(self.y))),
            "label_max": int(max(self.y.max(), self.y_test.max())),
            "input_shape": [int(d) for d in self.x.shape[1:]],
            "capabilities": caps,
            "version": __version__,
        }
        if self.architecture:
            hello["architecture"] = self.architecture
        return hello

    def sketch(self, sketcher: Sketcher) -> Sketch:
        """The client's sketch of its training data."""
        return sketcher.sketch(self.x, self.y)

    def evaluate(self, weights: Weights) -> dict[str, float]:
        """Accuracy and loss of ``weights`` on the local test data."""
        from .training.trainer import evaluate

        r = evaluate(self.architecture, weights, self.x_test, self.y_test)
        return {"accuracy": float(r.accuracy), "loss": float(r.loss), "n_test": int(r.n)}

    def select(self, models: Mapping[str, Weights], batch_size: int) -> str:
        """Key of the model with the lowest loss on one local batch (IFCA)."""
        rows = self._selection_rows(len(models), batch_size)
        return next(iter(models)) if rows is None else self._choose(models, rows)

    def _selection_rows(self, offered: int, batch_size: int) -> np.ndarray | None:
        """The rows a choice among ``offered`` models is made on (None: nothing to choose)."""
        if offered == 1:
            return None
        rng = np.random.default_rng(None if self.seed is None else self.seed + 7919 * self._calls)
        return rng.choice(len(self.y), size=min(batch_size, len(self.y)), replace=False)

    def _choose(self, models: Mapping[str, Weights], rows: np.ndarray) -> str:
        from .training.trainer import evaluate

        onnx = self.selection == "onnx"
        losses = {k: evaluate(self.architecture, w, self.x[rows], self.y[rows], force_onnx=onnx).loss
                  for k, w in models.items()}
        best = lowest_loss(losses)
        log.debug("client %s selects %s from losses %s", self.cid, best, losses)
        return best

    def ask_fit(self, task: Task) -> FitAsk:
        """What ``task`` needs evaluated before it trains (the rows to choose on, the evaluation, the seed)."""
        if not task.models:
            raise ValueError(f"task for {self.cid!r} in round {task.round} offers no model")
        self._calls += 1
        seed = None if self.seed is None else self.seed * 100_003 + task.round
        return FitAsk(self._selection_rows(len(task.models), task.settings.batch_size), task.evaluate_first, seed)

    def plan_asked(self, task: Task, ask: FitAsk) -> FitPlan:
        """``ask`` answered here: the model chosen on its rows, evaluated first if asked."""
        key = next(iter(task.models)) if ask.rows is None else self._choose(task.models, ask.rows)
        return ask.answered(key, self.evaluate(task.models[key]) if ask.evaluate_first else None)

    def plan_fit(self, task: Task) -> FitPlan:
        """What a training task trains before it trains: the model chosen (IFCA), its evaluation, the seed."""
        return self.plan_asked(task, self.ask_fit(task))

    def fitted(self, task: Task, plan: FitPlan, res: TrainResult) -> Update:
        """The update of a task trained as ``plan`` says, from its training's result."""
        metrics = {**plan.metrics, "train_seconds": float(res.seconds)}
        return Update(self.cid, task.round, plan.key, dict(res.weights), int(res.n_samples), float(res.loss), metrics)

    def fit(self, task: Task, *, device: str = "cpu") -> Update:
        """Run a training task: optionally evaluate, select a model, train (on ``device``), return the update."""
        from .training.trainer import train_local

        plan = self.plan_fit(task)
        s = task.settings
        res = train_local(
            self.architecture, task.models[plan.key], self.x, self.y,
            epochs=s.epochs, lr=s.lr, batch_size=s.batch_size, optimizer=s.optimizer, seed=plan.seed,
            device=device,
        )
        return self.fitted(task, plan, res)
