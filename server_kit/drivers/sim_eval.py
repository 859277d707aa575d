"""A simulated round's evaluations: each device's current model on its test images, one by one or on one device.

:func:`mean_accuracy` asks every device to evaluate its model as it would
alone (:meth:`edge_sdk.worker.LocalWorker.evaluate`: a torch model built and
run per device). :class:`DeviceEvaluation` does the same arithmetic where the
round trains (a GPU): every device's test images are put on the device once
for the whole run, and each model of the round is built once and run over the
test images of all its devices together, in batches of ``batch_size``; each
device's accuracy is read from its rows. The logits of a sample do not depend
on the others in its batch, so both give the same accuracies (the tests
compare them on the CPU).

It also answers what a round's training tasks ask before they train
(:meth:`DeviceEvaluation.plans`, for :class:`~server_kit.drivers.sim_training.RoundTraining`
on a GPU): IFCA's choice, each offered model run once over the chosen rows
of every device it is offered to, and the evaluation first of the model
chosen. The losses are each device's mean cross-entropy, in float64 from the
logits, as a device computes them (its ONNX Runtime or torch on the CPU):
they differ only in the last bits of the logits, so the same model is chosen
except between models whose losses tie to about 1e-6.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from edge_sdk.tasks import Task
from edge_sdk.training.batched_train import ResidentData
from edge_sdk.worker import FitAsk, FitPlan, LocalWorker, lowest_loss

from ..strategies.base import Strategy

__all__ = ["DeviceEvaluation", "mean_accuracy"]


def mean_accuracy(workers: Mapping[str, LocalWorker], strategy: Strategy, cids: Sequence[str]
                  ) -> tuple[float, dict[str, float]]:
    """Mean local test accuracy over ``cids`` of their current models, overall and per model."""
    return _means({cid: workers[cid].evaluate(strategy.models[strategy.model_key_for(cid)])["accuracy"]
                   for cid in cids}, strategy)


def _means(accs: Mapping[str, float], strategy: Strategy) -> tuple[float, dict[str, float]]:
    per_model: dict[str, list[float]] = {}
    for cid, acc in accs.items():
        per_model.setdefault(strategy.model_key_for(cid), []).append(acc)
    overall = float(np.mean(list(accs.values()))) if accs else float("nan")
    return overall, {k: float(np.mean(v)) for k, v in per_model.items()}


class DeviceEvaluation:
    """Every device's test images resident on ``device``; each model run once over all its devices' images.

    Parameters
    ----------
    workers : mapping of str to LocalWorker
        The simulated devices (one architecture).
    device : str
        A torch device (``cuda`` in the simulator; any device in the tests).
    batch_size : int
        Samples per forward pass.
    """

    def __init__(self, workers: Mapping[str, LocalWorker], device: str, batch_size: int = 4096) -> None:
        import torch

        from edge_sdk.training.torch_support import build_classifier

        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        archs = {w.architecture for w in workers.values()}
        if len(archs) != 1:
            raise ValueError(f"DeviceEvaluation takes devices of one architecture, got {sorted(archs)}")
        self.architecture = archs.pop()
        self._model, self._info = build_classifier(self.architecture)
        self._model.to(self.device).eval()
        self.workers = workers
        # each device's test images and labels on the device for the run (new data: new copies)
        self._resident = ResidentData(device)

    def accuracies(self, weights: Mapping[str, np.ndarray], cids: Sequence[str]) -> dict[str, float]:
        """Each of ``cids``' accuracy of ``weights`` on its test images (one model, their images together)."""
        return {c: acc for c, (acc, _) in self.scores(weights, cids).items()}

    def scores(self, weights: Mapping[str, np.ndarray], cids: Sequence[str]) -> dict[str, tuple[float, float]]:
        """Each of ``cids``' accuracy and mean loss of ``weights`` on its test images."""
        data = [self._resident.get(c, self._info, self.workers[c].x_test, self.workers[c].y_test) for c in cids]
        return dict(zip(cids, self._forward(weights, data)))

    def _forward(self, weights: Mapping[str, np.ndarray], data: Sequence[tuple[Any, Any]]
                 ) -> list[tuple[float, float]]:
        """Accuracy and mean cross-entropy (float64 from the logits) of one model on each part of ``data``."""
        import torch

        from edge_sdk.models.model_checks import check_weights

        w = check_weights(self._info, weights)
        self._model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}, strict=True)
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        right, loss = [], []
        with torch.no_grad():
            for i in range(0, x.shape[0], self.batch_size):
                logits, yb = self._model(x[i:i + self.batch_size]).double(), y[i:i + self.batch_size]
                right.append(logits.argmax(dim=1) == yb)
                loss.append(torch.nn.functional.cross_entropy(logits, yb, reduction="none"))
        counts = [int(d[1].shape[0]) for d in data]
        hits = torch.stack([part.sum() for part in torch.split(torch.cat(right), counts)]).cpu().numpy()
        sums = torch.stack([part.sum() for part in torch.split(torch.cat(loss), counts)]).cpu().numpy()
        return [(float(h) / n, float(s) / n) for h, s, n in zip(hits, sums, counts)]  # np.mean's quotients

    def plans(self, asked: Sequence[tuple[Task, FitAsk]], train: ResidentData | None = None) -> list[FitPlan]:
        """Each task's plan, its ``FitAsk`` answered here: each model run once over all the devices it serves.

        ``train``: the devices' training data resident on this device (the
        rows to choose on are taken there); else the rows are copied.
        """
        import torch

        from edge_sdk.models.model_checks import check_data

        losses: list[dict[str, float]] = [{} for _ in asked]
        offered = ((i, k, w) for i, (t, a) in enumerate(asked) if a.rows is not None for k, w in t.models.items())
        for key, weights, members in _by_model(offered):
            data = []
            for i in members:
                task, ask = asked[i]
                w = self.workers[task.cid]
                if train is not None and train.device == self.device:
                    xs, ys = train.get(task.cid, self._info, w.x, w.y)
                    rows = torch.from_numpy(np.asarray(ask.rows, dtype=np.int64)).to(self.device)
                    data.append((xs[rows], ys[rows]))
                else:
                    xr, yr = check_data(self._info, w.x[ask.rows], w.y[ask.rows])
                    data.append((torch.from_numpy(xr).to(self.device), torch.from_numpy(yr).to(self.device)))
            for i, (_, loss) in zip(members, self._forward(weights, data)):
                losses[i][key] = loss
        keys = [lowest_loss(losses[i]) if ask.rows is not None else next(iter(task.models))
                for i, (task, ask) in enumerate(asked)]
        before: dict[int, tuple[float, float]] = {}
        chosen = ((i, key, t.models[key]) for i, ((t, a), key) in enumerate(zip(asked, keys)) if a.evaluate_first)
        for _, weights, members in _by_model(chosen):
            before.update(zip(members, self.scores(weights, [asked[i][0].cid for i in members]).values()))
        return [ask.answered(key, None if i not in before else {"accuracy": before[i][0], "loss": before[i][1]})
                for i, ((_, ask), key) in enumerate(zip(asked, keys))]

    def mean_accuracy(self, strategy: Strategy, cids: Sequence[str]) -> tuple[float, dict[str, float]]:
        """As :func:`mean_accuracy`, the devices of each model evaluated together."""
        groups: dict[str, list[str]] = {}
        for cid in cids:
            groups.setdefault(strategy.model_key_for(cid), []).append(cid)
        accs: dict[str, float] = {}
        for key, members in groups.items():
            accs.update(self.accuracies(strategy.models[key], members))
        return _means({c: accs[c] for c in cids}, strategy)



def _by_model(items: Iterable[tuple[int, str, Mapping[str, np.ndarray]]]
              ) -> list[tuple[str, Mapping[str, np.ndarray], list[int]]]:
    """Task indices grouped by the model they run (its key and its weights object), each model once."""
    groups: dict[tuple[str, int], tuple[str, Mapping[str, np.ndarray], list[int]]] = {}
    for i, key, weights in items:
        groups.setdefault((key, id(weights)), (key, weights, []))[2].append(i)
    return list(groups.values())
