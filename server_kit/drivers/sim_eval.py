"""A simulated round's evaluation: each device's current model on its test images, one by one or on one device.

:func:`mean_accuracy` asks every device to evaluate its model as it would
alone (:meth:`edge_sdk.worker.LocalWorker.evaluate`: a torch model built and
run per device). :class:`DeviceEvaluation` does the same arithmetic where the
round trains (a GPU): every device's test images are put on the device once
for the whole run, and each model of the round is built once and run over the
test images of all its devices together, in batches of ``batch_size``; each
device's accuracy is read from its rows. The logits of a sample do not depend
on the others in its batch, so both give the same accuracies (the tests
compare them on the CPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edge_sdk.training.batched_train import ResidentData
from edge_sdk.worker import LocalWorker

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
        import torch

        from edge_sdk.models.model_checks import check_weights

        w = check_weights(self._info, weights)
        self._model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in w.items()}, strict=True)
        data = [self._resident.get(c, self._info, self.workers[c].x_test, self.workers[c].y_test) for c in cids]
        x, y = torch.cat([d[0] for d in data]), torch.cat([d[1] for d in data])
        with torch.no_grad():
            right = torch.cat([self._model(x[i:i + self.batch_size]).argmax(dim=1) == y[i:i + self.batch_size]
                               for i in range(0, x.shape[0], self.batch_size)])
        counts = [int(d[1].shape[0]) for d in data]
        hits = torch.stack([part.sum() for part in torch.split(right, counts)]).cpu().numpy()
        return {c: float(h) / n for c, h, n in zip(cids, hits, counts)}  # np.mean's float64 quotient

    def mean_accuracy(self, strategy: Strategy, cids: Sequence[str]) -> tuple[float, dict[str, float]]:
        """As :func:`mean_accuracy`, the devices of each model evaluated together."""
        groups: dict[str, list[str]] = {}
        for cid in cids:
            groups.setdefault(strategy.model_key_for(cid), []).append(cid)
        accs: dict[str, float] = {}
        for key, members in groups.items():
            accs.update(self.accuracies(strategy.models[key], members))
        return _means({c: accs[c] for c in cids}, strategy)
