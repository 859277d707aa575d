"""Ours with federated autoencoder pre-training ("fedsketch-fedae") in both drivers.

Over the in-memory broker: every client trains the autoencoder each
pre-training round, receives the exported ONNX encoder (checked against its
sha256), sketches with it, and the federation clusters and trains. The same
option in the simulator.
"""

from __future__ import annotations

import hashlib
import logging

import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.protocol import Kind, Message, Topics
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.pretrain.settings import pretrain_config
from server_kit.strategies import make_strategy
from server_kit.strategies.fedsketch import FedAESketchClustered

from helpers import ARCH, ari_against

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

AE = "fc_ae_64_48_20"
FED = "fae"
PRETRAIN = {"architecture": AE, "rounds": 2, "epochs": 2}


@pytest.fixture(autouse=True)
def one_torch_thread():
    # tiny models: one intra-op thread is fastest, and immune to a busy machine
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def digits8():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 8, groups=2, seed=0)


def test_strategy_option_and_defaults():
    s = make_strategy("fedsketch-fedae", settings=TrainSettings(), architecture=ARCH)
    assert isinstance(s, FedAESketchClustered) and s.capabilities.needs_sketches
    assert s.capabilities.pretrain["rounds"] == 3 and s.capabilities.pretrain["architecture"] is None
    # the architecture defaults to that of the server's encoder
    assert pretrain_config(s.capabilities.pretrain, "digits_encoder")["architecture"] == AE
    assert make_strategy("fedsketch").capabilities.pretrain is None
    with pytest.raises(ValueError, match="unknown keys"):
        make_strategy("fedsketch-fedae", pretrain={"round": 2})
    with pytest.raises(ValueError, match="rounds must be a positive integer"):
        make_strategy("fedsketch-fedae", pretrain={"rounds": 0})


def test_fedae_federation_over_the_memory_broker(digits8, tmp_path, start_edge_clients, server_transport):
    broker = MemoryBroker()
    threads, edge = start_edge_clients(broker, digits8, FED, architecture=ARCH)
    server = server_transport(broker, federation=FED)
    server.connect()
    strategy = make_strategy("fedsketch-fedae", pretrain=PRETRAIN, min_cluster_size=2,
                             settings=TrainSettings(epochs=1, lr=1e-2, batch_size=16))
    config = ServerConfig(federation=FED, rounds=2, min_clients=8, register_timeout_s=20, sketch_timeout_s=30,
                          round_timeout_s=30, eval_timeout_s=20, encoder="digits_encoder", architecture=ARCH,
                          seed=0, checkpoint_dir=str(tmp_path / "ckpt"))
    orch = Orchestrator(strategy, server, config)
    result = orch.run()
    for th in threads:
        th.join(timeout=20)

    # pre-training: 2 rounds, every client trains the AE in each
    assert [h["updates"] for h in result.pretrain] == [8, 8]
    assert all(h["loss"] is not None and h["loss"] > 0 for h in result.pretrain)
    assert all(ec.handled.get("train_ae") == 2 for ec in edge)
    assert result.timings["pretrain_s"] > 0
    # the encoder reached every client, and they sketched with it
    name = f"fedae_{FED}"
    assert result.encoder == name
    assert all(name in ec.encoder_dirs and not ec.rejected_encoders for ec in edge)
    assert all(ec.state.encoders.loaded[name].latent_dim == 20 for ec in edge)
    assert (tmp_path / "ckpt" / "encoder" / f"{name}.onnx").is_file()
    enc_bytes = (tmp_path / "ckpt" / "encoder" / f"{name}.onnx").stat().st_size
    delivered = result.delivered
    assert delivered["ENCODER"] >= 8 * enc_bytes
    assert delivered["AE_MODEL"] > 0
    stats = result.transport
    # 2 AE rounds x 8 updates + 2 training rounds x 8 updates
    assert stats["received"]["UPDATE"]["messages"] == 2 * 8 + 2 * 8
    assert stats["received"]["SKETCH"]["messages"] == 8
    assert all(sk.latent_dim == 20 for sk in orch.intake.sketches.values())
    # clustering covers every client; training rounds ran
    assert set(result.assignment) == {c.cid for c in digits8}
    assert [h["updates"] for h in result.history] == [8, 8]
    # the two rotation groups found exactly, and the clusters' models learnt (chance: 0.1). In the simulator's same
    # run, measured over seeds 0-3 on this machine's floating-point path and another (ATEN_CPU_CAPABILITY=avx2, 2 BLAS threads):
    # ARI 1.0 always, accuracy 0.311-0.444 after 2 rounds (0.511 on an earlier machine)
    assert ari_against({c.cid: c.group for c in digits8}, result.assignment) == 1.0
    assert result.final["accuracy"] > 0.2
    assert not result.rejected


def test_client_rejects_a_tampered_encoder(digits8, caplog):
    c = digits8[0]
    w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=0)
    ec = EdgeClient(MemoryTransport(MemoryBroker(), c.cid, federation=FED), w, federation=FED)
    body = b"not really an onnx model"
    good = hashlib.sha256(body).hexdigest()
    entry = {"file": "evil.onnx", "sha256": good, "role": "encoder", "input_shape": [64], "latent_dim": 20}
    topic = Topics("fedsketch", FED).model("encoder")
    wrong = Message(Kind.MODEL, FED, "server", 0, {"key": "encoder", "name": "evil", "sha256": "0" * 64,
                                                    "entry": entry}, body)
    with caplog.at_level(logging.ERROR, logger="edge_sdk.client"):
        ec.link.on_model(topic, wrong)
    assert "evil" not in ec.encoder_dirs
    assert ec.rejected_encoders and "sha256" in ec.rejected_encoders[0]
    assert "rejected encoder" in caplog.text and "sha256" in caplog.text
    # the same bytes with their true hash are kept (and an entry disagreeing with them is not)
    ec.link.on_model(topic, Message(Kind.MODEL, FED, "server", 0, {"key": "encoder", "name": "evil", "sha256": good,
                                                                "entry": {**entry, "sha256": "1" * 64}}, body))
    assert "evil" not in ec.encoder_dirs and len(ec.rejected_encoders) == 2
    ec.link.on_model(topic, Message(Kind.MODEL, FED, "server", 0, {"key": "encoder", "name": "evil", "sha256": good,
                                                                "entry": entry}, body))
    assert (ec.encoder_dirs["evil"] / "evil.onnx").read_bytes() == body
    assert (ec.encoder_dirs["evil"] / "manifest.json").is_file()


def test_simulator_runs_the_same_option(digits8):
    from server_kit.drivers.simulate import Simulator

    strategy = make_strategy("fedsketch-fedae", pretrain=PRETRAIN, min_cluster_size=2,
                             settings=TrainSettings(epochs=1, lr=1e-2, batch_size=16))
    sim = Simulator(strategy, digits8, architecture=ARCH, encoder=None, seed=0)
    res = sim.run(2)
    assert sim.exported_encoder is not None and sim.encoder.latent_dim == 20
    assert set(res.assignment) == {c.cid for c in digits8}
    assert len(res.rounds) == 2
    ledger = res.ledger.as_dict()
    assert ledger["down"]["AE_MODEL"]["messages"] == 2 * 8
    assert ledger["up"]["AE_UPDATE"]["messages"] == 2 * 8
    assert ledger["down"]["ENCODER"]["messages"] == 8
    # as over MQTT: both groups found, measured over seeds 0-3 on this machine's floating-point path and another (ATEN_CPU_CAPABILITY=avx2, 2 BLAS threads): ARI 1.0 always,
    # accuracy 0.311-0.444 after 2 rounds (chance: 0.1)
    assert res.ari == 1.0 and res.accuracies[-1] > 0.2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "fedsketch", "--ae-rounds", "2"], "apply to --strategy fedsketch-fedae"),
        (["--strategy", "fedsketch-fedae", "--ae-rounds", "0"], "pretrain rounds must be a positive integer"),
        (["--strategy", "fedsketch-fedae", "--ae-epochs", "-1"], "pretrain epochs must be a positive integer"),
        (["--strategy", "fedsketch-fedae", "--encoder", "nope"], "unknown encoder 'nope'; known: ['conv_ae_encoder', "),
    ],
)
def test_cli_ae_options_are_validated(argv, message, capsys):
    from server_kit.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "fedsketch-server: error:" in err and message in err, err
