"""Per-round byte accounting of the simulator: bytes until a round, before training, early stop."""

from __future__ import annotations

import pytest

from edge_sdk.protocol import Kind, sketch_body, tensors_body
from edge_sdk.tasks import TrainSettings
from server_kit.data.partition import load_digits_images, rotation_groups
from server_kit.drivers.simulate import RoundRecord, SimulationResult, Simulator
from server_kit.metrics import message_bytes, weights_message_bytes
from server_kit.rounds.training import RoundReport
from server_kit.strategies.fedavg import FedAvg
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH

pytest.importorskip("torch")

SETTINGS = TrainSettings(epochs=1, lr=1e-2, batch_size=32)


@pytest.fixture(scope="module")
def clients():
    images, labels = load_digits_images()
    return rotation_groups(images[:480], labels[:480], 6, groups=2, seed=0)


def test_fedavg_rounds_accumulate_exact_wire_bytes(clients):
    from edge_sdk.training.trainer import initial_weights

    res = Simulator(FedAvg(settings=SETTINGS), clients, architecture=ARCH, seed=0).run(3)
    n = len(clients)
    model = weights_message_bytes(Kind.MODEL, initial_weights(ARCH, 0), {"key": "global"})
    cmd = message_bytes(Kind.CMD, meta={"op": "train", "round": 1, "models": ["global"], **SETTINGS.to_dict()})
    up = res.ledger.as_dict()["up"]["UPDATE"]
    assert up["messages"] == 3 * n
    assert res.bytes_before_training == res.bytes_until(0) == 0  # FedAvg sends nothing before training
    totals = [r.bytes_total for r in res.rounds]
    assert totals[-1] == 3 * n * (cmd + model) + up["bytes"]
    # each update counted as the bytes a device sends: the same tensors, only its meta's loss and count differ
    body = len(tensors_body(initial_weights(ARCH, 0)))
    for done, total in zip([0, *totals], totals):
        updates = total - done - n * (cmd + model)
        assert n * body < updates < n * (body + 400), updates
    assert [res.bytes_until(k) for k in (1, 2, 3)] == [r.bytes_total for r in res.rounds]
    assert res.bytes_until(3) == res.total_bytes()


def test_sketches_are_round_zero_and_cost_far_less_than_a_round(clients):
    from edge_sdk import OnnxEncoder

    sim = Simulator(SketchClustered(settings=SETTINGS, min_cluster_size=2), clients, architecture=ARCH,
                    encoder=OnnxEncoder("digits_encoder"), flip_prob=0.1, seed=0)
    res = sim.run(1)
    sketches = sim._summaries(sim.strategy)  # same seeds: the very sketches the run sent
    ask = message_bytes(Kind.CMD, meta={"op": "sketch", "num_classes": 10, "flip_prob": 0.1, "summary": "sketch"})
    expected = sum(message_bytes(Kind.SKETCH, sketch_body(s)) + ask for s in sketches.values())
    assert res.bytes_until(0) == res.bytes_before_training == expected
    assert res.ari == 1.0  # two rotation groups, clustered before round 1
    one_round = res.bytes_until(1) - res.bytes_until(0)
    assert res.bytes_until(0) * 100 < one_round  # a round moves two models per client
    with pytest.raises(ValueError, match="round 2 was not run: this run has rounds 1 to 1"):
        res.bytes_until(2)


def test_zero_rounds_and_early_stop(clients):
    res = Simulator(FedAvg(settings=SETTINGS), clients, architecture=ARCH).run(0)
    assert res.rounds == [] and res.bytes_until(0) == 0
    with pytest.raises(ValueError, match="round 1 was not run: this run has no rounds"):
        res.bytes_until(1)
    seen = []

    def stop(strategy, record):
        seen.append((strategy.name, record.round))
        return record.round == 2

    res = Simulator(FedAvg(settings=SETTINGS), clients, architecture=ARCH).run(5, stop=stop)
    assert [r.round for r in res.rounds] == [1, 2] and seen == [("fedavg", 1), ("fedavg", 2)]
    assert res.bytes_until(2) == res.total_bytes() and abs(res.total_bytes() - 2 * res.bytes_until(1)) < 100


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bytes_until_refuses_bad_rounds(bad):
    report = RoundReport(round=1, tasked=1, updates=1, missing=(), acc_before=None, acc_before_per_model={},
                         loss=None, model_bytes_delivered=0, deliveries={}, clipped=0, refused_norm=0, summary={},
                         seconds=0.1)
    res = SimulationResult("x", rounds=[RoundRecord(report, 0.5, {}, 0.1, bytes_total=7)])
    assert res.bytes_until(1) == 7
    with pytest.raises(ValueError, match="rnd must be a round number >= 0"):
        res.bytes_until(bad)
