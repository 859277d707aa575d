"""A round's evaluation on one device (the GPU path, run here on the CPU) gives each device's own accuracy."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from edge_sdk.training.trainer import initial_weights  # noqa: E402
from edge_sdk.worker import LocalWorker  # noqa: E402
from server_kit.data.partition import load_digits_images, rotation_partition  # noqa: E402
from server_kit.drivers.sim_eval import DeviceEvaluation, mean_accuracy  # noqa: E402

ARCH = "digits_cnn_1x8x8_10"


class _Two:
    """A strategy's view for the evaluation: two models, each client on one."""

    def __init__(self, cids):
        rng = np.random.default_rng(3)
        good = initial_weights(ARCH, 0)
        self.models = {"a": good, "b": {k: (v + rng.normal(0, 0.3, v.shape).astype(v.dtype)) if v.dtype.kind == "f"
                                        else v for k, v in good.items()}}
        self._key = {c: "ab"[i % 2] for i, c in enumerate(cids)}

    def model_key_for(self, cid):
        return self._key[cid]


def test_each_model_run_once_over_its_devices_gives_every_devices_own_accuracy():
    x, y = load_digits_images()
    clients = rotation_partition(x, y, 9, groups=3, seed=0)
    workers = {c.cid: LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
               for i, c in enumerate(clients)}
    cids = sorted(workers)[:7]
    # trained a little, so that the accuracies differ from device to device
    s = _Two(cids)
    from edge_sdk.training.trainer import train_local

    s.models["a"] = train_local(ARCH, s.models["a"], clients[0].x_train, clients[0].y_train, epochs=2, lr=1e-2,
                                batch_size=16, seed=0).weights
    evaluation = DeviceEvaluation(workers, "cpu", batch_size=50)  # several batches, across devices' images
    one_by_one = mean_accuracy(workers, s, cids)
    together = evaluation.mean_accuracy(s, cids)
    assert together == one_by_one
    per = {c: workers[c].evaluate(s.models[s.model_key_for(c)])["accuracy"] for c in cids}
    assert evaluation.accuracies(s.models["a"], [c for c in cids if s.model_key_for(c) == "a"]) == \
        {c: per[c] for c in cids if s.model_key_for(c) == "a"}
    assert len(set(per.values())) > 2  # the check compares different figures
    # a device's data replaced: its new test images are put on the device
    w = workers[cids[0]]
    w.replace_data(w.x[:20], w.y[:20], w.x[:20], w.y[:20])
    assert evaluation.accuracies(s.models["a"], [cids[0]])[cids[0]] == w.evaluate(s.models["a"])["accuracy"]
