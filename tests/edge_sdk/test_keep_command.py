"""The ``keep`` command on a device: the model kept only if it is the server's, by the keep policy; cold start."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.models.held_models import HeldModel
from edge_sdk.models.keep_offer import KeepOffer
from edge_sdk.models.keeping import ModelKeeper
from edge_sdk.models.local_model import LocalModel
from edge_sdk.models.model_folder import read_model_folder, weights_sha256
from edge_sdk.protocol import Kind, Message, decode_message, encode_message
from edge_sdk.protocol.commands import Op, build
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker
from server_kit.data.partition import load_digits_images

from helpers import ARCH

pytest.importorskip("torch")
FED = "keep"


@pytest.fixture(scope="module")
def data():
    from edge_sdk.training.trainer import initial_weights, train_local

    x, y = load_digits_images()
    x = x.reshape(-1, 8, 8).astype(np.float32)
    good = train_local(ARCH, initial_weights(ARCH, 0), x[:600], y[:600], epochs=3, lr=1e-2, batch_size=32,
                       seed=0).weights
    bad = initial_weights(ARCH, 1)
    return x, y, good, bad


def device(tmp_path, data, **kw):
    x, y, _, _ = data
    w = LocalWorker("d1", x[600:800], y[600:800], x[800:900], y[800:900], architecture=ARCH, seed=0)
    t = MemoryTransport(MemoryBroker(), "d1", federation=FED)
    return EdgeClient(t, w, federation=FED, keeper=ModelKeeper(tmp_path / "model", **kw), model_timeout_s=2)


def keep(client, offers, rnd=3, **fields):
    fields = {"run": "run-a", "strategy": "fedsketch", "architecture": ARCH, **fields}
    meta = build(Op.KEEP, round=rnd, models={o.key: o.to_wire() for o in offers}, **fields)
    client.handle(decode_message(encode_message(Message(Kind.CMD, FED, "server", rnd, meta))))


def test_the_assigned_model_is_kept_bit_for_bit_and_runs_without_torch_code(tmp_path, data):
    x, y, good, _ = data
    c = device(tmp_path, data)
    c.model_key = "c1"
    c.store.put("c1", HeldModel(3, good))
    keep(c, [KeepOffer("c1", weights_sha256(good), round=2, accuracy=0.9, evaluated=4, members=5)])
    entry, weights = read_model_folder(tmp_path / "model" / "current")
    assert entry.key == "c1" and entry.run == "run-a" and entry.server_accuracy == 0.9 and entry.members == 5
    assert entry.files["weights.safetensors"] == weights_sha256(good)
    # the trained model, not an untrained one (chance 0.1): measured over seeds 0-3 on this machine's floating-point path and another (ATEN_CPU_CAPABILITY=avx2, 2 BLAS threads), 0.79-0.85
    assert entry.device_test_n == 100 and entry.device_accuracy >= 0.5
    assert np.mean(LocalModel.load(tmp_path / "model").predict(x[800:900]) == y[800:900]) == entry.device_accuracy
    assert c.kept.has_model and c.kept.decision.kept_new


def test_weights_other_than_the_servers_are_refused_and_counted(tmp_path, data):
    _, _, good, bad = data
    c = device(tmp_path, data)
    c.model_key = "c0"
    c.store.put("c0", HeldModel(3, bad))
    keep(c, [KeepOffer("c0", weights_sha256(good), round=3)])
    assert c.rejected == {"model-sha": 1}
    assert not (tmp_path / "model" / "current").exists()
    keep(c, [KeepOffer("c0", "not-a-sha", round=3)])
    assert c.rejected == {"model-sha": 1, "meta-field": 1}


def test_a_worse_model_does_not_replace_the_kept_one_unless_the_policy_says_latest(tmp_path, data, caplog):
    _, _, good, bad = data
    c = device(tmp_path, data)
    c.model_key = "c0"
    c.store.put("c0", HeldModel(3, good))
    keep(c, [KeepOffer("c0", weights_sha256(good), round=3)])
    before = (tmp_path / "model" / "current").resolve()
    c.store.put("c0", HeldModel(4, bad))
    with caplog.at_level(logging.INFO, logger="edge_sdk.client"):
        keep(c, [KeepOffer("c0", weights_sha256(bad), round=4)], rnd=4, run="run-b")
    assert (tmp_path / "model" / "current").resolve() == before
    assert not c.kept.decision.kept_new and c.kept.decision.old_accuracy > c.kept.decision.new_accuracy + 0.5
    assert "kept the previous model (c0 of run run-a" in caplog.text
    latest = device(tmp_path, data, policy="latest")
    latest.model_key = "c0"
    latest.store.put("c0", HeldModel(4, bad))
    keep(latest, [KeepOffer("c0", weights_sha256(bad), round=4)], rnd=4, run="run-b")
    assert read_model_folder(tmp_path / "model" / "current")[0].run == "run-b"
    assert (tmp_path / "model" / "previous").resolve() == before


def test_cold_start_chooses_the_lowest_loss_model_keeps_it_and_leaves(tmp_path, data):
    _, _, good, bad = data
    c = device(tmp_path, data)
    c.get_model = True
    c.store.put("m0", HeldModel(5, bad))
    c.store.put("m1", HeldModel(5, good))
    keep(c, [KeepOffer("m0", weights_sha256(bad)), KeepOffer("m1", weights_sha256(good))], rnd=5, choose=True)
    assert read_model_folder(tmp_path / "model" / "current")[0].key == "m1"
    assert c._stop.is_set() and c.exit_code == 0
    refused = device(tmp_path / "other", data)
    refused.get_model = True
    refused.store.put("c0", HeldModel(5, bad))
    keep(refused, [KeepOffer("c0", weights_sha256(good))], rnd=5, model_key="c0")
    assert refused.exit_code == 6 and refused._stop.is_set()


def test_an_unsigned_model_keep_or_serving_announcement_is_ignored_and_counted(tmp_path, data):
    from edge_sdk.protocol import Topics, tensors_body
    from edge_sdk.signing import Signer, Verifier, generate_key

    _, _, good, _ = data
    key = generate_key()
    c = device(tmp_path, data)
    c.transport.verify_with(Verifier(key.public_key()))
    c.model_key = "c0"
    c.start()
    topics = Topics("fedsketch", FED)
    server = MemoryTransport(c.transport.broker, "server", federation=FED)
    server.connect()
    forged = [  # what an intruder sends in the server's name, unsigned
        (topics.cmd("d1"), Message(Kind.MODEL, FED, "server", 3, {"key": "c0"}, tensors_body(good))),
        (topics.cmd("d1"), Message(Kind.CMD, FED, "server", 3, build(
            Op.KEEP, round=3, model_key="c0", models={"c0": KeepOffer("c0", weights_sha256(good)).to_wire()}))),
        (topics.server_status(), Message(Kind.STATUS, FED, "server", 0, {"state": "online", "run": "evil",
                                                                         "serving": True})),
    ]
    for topic, msg in forged:
        server.publish(topic, msg)
    while c.step():
        if c.link.commands.empty():
            break
    assert c.transport.rejected == {"unsigned": 3}
    assert c.store.get("c0") is None and c.kept is None and c.run_id is None
    assert not (tmp_path / "model" / "current").exists()
    signed = MemoryTransport(c.transport.broker, "server", federation=FED)
    signed.sign_with(Signer(key))
    signed.connect()
    for topic, msg in forged[:2]:  # the same, signed by the server: kept
        signed.publish(topic, msg)
    while c.step() and not c.link.commands.empty():
        pass
    assert read_model_folder(tmp_path / "model" / "current")[0].key == "c0"


def test_a_device_in_no_run_goes_on_past_the_end_of_another_run(tmp_path, data):
    """A device that arrived as a run ended (its stop still on its way) waits for its own run, or its model."""
    c = device(tmp_path, data)
    c.get_model = True
    stop = {"reason": "finished", "run": "run-a"}
    assert c.handle(decode_message(encode_message(Message(Kind.CMD, FED, "server", 3, build(Op.STOP, **stop)))))
    c.run_id = "run-a"  # in that run (welcomed, or told by its announcement): its stop
    assert not c.handle(decode_message(encode_message(Message(Kind.CMD, FED, "server", 3, build(Op.STOP, **stop)))))
