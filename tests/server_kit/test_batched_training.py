"""Batched local training: many clients at once give the models each would train alone (CPU, digits)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edge_sdk.tasks import Task, TrainSettings  # noqa: E402
from edge_sdk.training.batched_train import ClientJob, train_local_batched  # noqa: E402
from edge_sdk.training.trainer import initial_weights, train_local  # noqa: E402
from edge_sdk.worker import LocalWorker  # noqa: E402
from server_kit.drivers.sim_training import RoundTraining  # noqa: E402

ARCH = "digits_cnn_1x8x8_10"
SIZES = (40, 57, 64, 9, 33)  # different batch counts; one client smaller than a batch


@pytest.fixture(scope="module")
def jobs(digits12):
    w0 = initial_weights(ARCH, 0)
    return [ClientJob(w0, c.x_train[:n], c.y_train[:n], seed=100 + i) for i, (c, n) in enumerate(zip(digits12, SIZES))]


def _alone(jobs, **kw):
    return [train_local(ARCH, j.weights, j.x, j.y, seed=j.seed, **kw) for j in jobs]


def _max_diff(a, b):
    return max(float(np.abs(x.weights[k] - y.weights[k]).max()) for x, y in zip(a, b) for k in x.weights)


@pytest.mark.parametrize("optimizer, tol", [("sgd", 1e-6), ("adam", 2e-4)])
def test_a_batch_trains_the_models_each_client_trains_alone(jobs, optimizer, tol):
    kw = dict(epochs=3, lr=0.05 if optimizer == "sgd" else 0.01, batch_size=16, optimizer=optimizer)
    alone, batched = _alone(jobs, **kw), train_local_batched(ARCH, jobs, **kw)
    assert [r.n_samples for r in batched] == list(SIZES)
    assert _max_diff(alone, batched) <= tol
    assert np.allclose([r.loss for r in batched], [r.loss for r in alone], rtol=1e-5, atol=1e-6)
    # the training moved every model (a batch that did nothing would fail the comparison with the start)
    assert all(float(np.abs(r.weights["fc2.weight"] - jobs[0].weights["fc2.weight"]).max()) > 1e-3 for r in batched)


def test_a_batch_refuses_what_it_cannot_train(jobs):
    kw = dict(epochs=1, lr=0.01, batch_size=16)
    with pytest.raises(ValueError, match="train_local_batched needs at least one job"):
        train_local_batched(ARCH, [], **kw)
    with pytest.raises(ValueError, match=r"architecture 'resnet18_3x32x32_10' has buffers or dropout"):
        train_local_batched("resnet18_3x32x32_10", jobs[:1], **kw)
    bad = ClientJob({**jobs[0].weights, "fc2.weight": jobs[0].weights["fc2.weight"][:, :3]}, jobs[0].x, jobs[0].y, 1)
    with pytest.raises(ValueError, match="fc2.weight"):
        train_local_batched(ARCH, [jobs[1], bad], **kw)
    with pytest.raises(RuntimeError, match="training diverged"):
        train_local_batched(ARCH, jobs[:2], epochs=2, lr=1e30, batch_size=16, optimizer="sgd")


class _Picky(LocalWorker):
    """A device of another kind: it trains alone (its fit is its own)."""

    def fit(self, task, **kw):
        u = super().fit(task, **kw)
        return dataclasses.replace(u, metrics={**u.metrics, "picky": 1.0})


def test_a_round_batched_gives_each_device_its_update_in_task_order(digits12, caplog):
    workers = {c.cid: LocalWorker(c.cid, c.x_train, c.y_train, architecture=ARCH, seed=i)
               for i, c in enumerate(digits12[:5])}
    workers[digits12[2].cid].__class__ = _Picky
    w0 = initial_weights(ARCH, 3)
    tasks = [Task(cid, 1, {"c0": w0}, TrainSettings(epochs=1, lr=0.01, batch_size=16)) for cid in sorted(workers)[::-1]]
    with caplog.at_level(logging.DEBUG, logger="server_kit.drivers.sim_training"):
        batched = RoundTraining(workers, device="cpu", batched=True, chunk=3).train(tasks)
    assert [r.getMessage() for r in caplog.records] == [
        f"{ARCH}: 3 clients trained in one batch on cpu", f"{ARCH}: 1 clients trained in one batch on cpu"]
    alone = RoundTraining(workers, device="cpu", batched=False).train(tasks)
    assert [u.cid for u in batched] == [t.cid for t in tasks] == [u.cid for u in alone]
    assert [u.metrics.get("picky") for u in batched] == [1.0 if t.cid == digits12[2].cid else None for t in tasks]
    for a, b in zip(alone, batched):
        assert (a.model_key, a.n_samples, a.round) == (b.model_key, b.n_samples, b.round)
        assert max(float(np.abs(a.weights[k] - b.weights[k]).max()) for k in a.weights) <= 2e-4


def test_the_device_choice_is_checked():
    with pytest.raises(ValueError, match="device must be one of"):
        RoundTraining({}, device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device 'cuda' asked but torch sees no CUDA device"):
            RoundTraining({}, device="cuda")
        assert (RoundTraining({}, device="auto").device, RoundTraining({}).batched) == ("cpu", False)


def test_data_kept_on_the_device_for_the_run_trains_the_same_bits_and_follows_new_data(digits12):
    workers = {c.cid: LocalWorker(c.cid, c.x_train, c.y_train, architecture=ARCH, seed=i)
               for i, c in enumerate(digits12[:4])}
    w0 = initial_weights(ARCH, 3)
    settings = TrainSettings(epochs=1, lr=0.01, batch_size=16)
    copied = RoundTraining(workers, device="cpu", batched=True, resident=False)
    kept = RoundTraining(workers, device="cpu", batched=True, resident=True)
    assert copied._resident is None and kept._resident is not None
    for rnd in (1, 2):
        tasks = [Task(cid, rnd, {"c0": w0}, settings) for cid in sorted(workers)]
        a, b = copied.train(tasks), kept.train(tasks)
        assert all(x.weights[k].tobytes() == y.weights[k].tobytes() for x, y in zip(a, b) for k in x.weights)
        if rnd == 1:  # a device's data replaced between rounds: its new samples are what trains
            w = workers[sorted(workers)[0]]
            w.replace_data(w.x[:20], w.y[:20])
    assert b[0].n_samples == 20


def test_ifca_choices_and_first_evaluations_made_on_one_device_are_each_devices_own(digits12):
    """The GPU path's plans (each model once over every device's rows), run here on the CPU."""
    from server_kit.drivers.sim_eval import DeviceEvaluation

    def workers():
        return {c.cid: LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
                for i, c in enumerate(digits12)}

    w0 = initial_weights(ARCH, 0)
    groups = {c.cid: i % 4 for i, c in enumerate(digits12)}  # rotation 90 * (i mod 4)
    models = {f"r{g}": train_local(ARCH, w0, np.concatenate([c.x_train for c in digits12 if groups[c.cid] == g]),
                                   np.concatenate([c.y_train for c in digits12 if groups[c.cid] == g]),
                                   epochs=4, lr=0.01, batch_size=16, seed=g).weights for g in range(4)}
    settings = TrainSettings(epochs=1, lr=0.01, batch_size=16)
    updates = {}
    for how in ("alone", "one device"):
        ws = workers()
        evaluation = DeviceEvaluation(ws, "cpu", batch_size=40) if how == "one device" else None
        training = RoundTraining(ws, device="cpu", batched=True, chunk=5, resident=True, evaluation=evaluation)
        for rnd in (1, 2):  # the second round draws other rows (each device's call count)
            tasks = [Task(cid, rnd, models, settings, evaluate_first=rnd == 1) for cid in sorted(ws)]
            updates[how, rnd] = training.train(tasks)
    for rnd in (1, 2):
        alone, together = updates["alone", rnd], updates["one device", rnd]
        assert [u.model_key for u in together] == [u.model_key for u in alone]
        assert [u.model_key for u in alone] == [f"r{groups[u.cid]}" for u in alone]  # every device its rotation's
        assert _max_diff(alone, together) <= 2e-4
        assert ("acc_before" in alone[0].metrics) == (rnd == 1)
        for a, b in zip(alone, together):
            assert {k: v for k, v in a.metrics.items() if k != "train_seconds"}.keys() == \
                {k: v for k, v in b.metrics.items() if k != "train_seconds"}.keys()
            if rnd == 1:
                assert b.metrics["acc_before"] == a.metrics["acc_before"]
                assert b.metrics["loss_before"] == pytest.approx(a.metrics["loss_before"], rel=1e-6)
    assert len({u.metrics["acc_before"] for u in updates["alone", 1]}) > 3  # the comparison is of different figures


def test_a_compiled_step_trains_the_models_of_the_eager_steps(jobs):
    """``torch.compile`` of the whole step (forward, gradient, Adam), idle clients masked: the eager models."""
    kw = dict(epochs=2, lr=0.01, batch_size=16, optimizer="adam")
    eager = train_local_batched(ARCH, jobs, **kw)
    compiled = train_local_batched(ARCH, jobs, step="compile", **kw)
    assert _max_diff(eager, compiled) <= 2e-4
    assert np.allclose([r.loss for r in compiled], [r.loss for r in eager], rtol=1e-5, atol=1e-6)
    assert all(float(np.abs(r.weights["fc2.weight"] - jobs[0].weights["fc2.weight"]).max()) > 1e-3 for r in compiled)
    with pytest.raises(ValueError, match="step must be one of eager, compile, graphs, got 'jit'"):
        train_local_batched(ARCH, jobs, step="jit", **kw)
    with pytest.raises(ValueError, match="step must be one of eager, compile, graphs, got 'fast'"):
        RoundTraining({}, device="cpu", step="fast")
