"""``fedsketch-server --serve-models-from`` and ``fedsketch-client --get-model``: real processes, real Mosquitto.

The export is made without training (the clustering fitted on the devices' sketches, each cluster with its
own initial model), so the test measures the cold start alone: a device that never trained says hello, sends
one sketch, gets one model, keeps it (the export's bytes) and exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from edge_sdk import OnnxEncoder, Sketcher
from edge_sdk.models.model_folder import read_model_folder
from edge_sdk.training.trainer import initial_weights
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.data.partition import load_digits_images, rotation_partition, save_client
from server_kit.drivers import ServerConfig
from server_kit.drivers.checkpoint import write_checkpoint
from server_kit.serving.export import export_models
from server_kit.serving.offers import model_offers
from server_kit.strategies.base import ClientInfo
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH

pytest.importorskip("torch")
pytestmark = [pytest.mark.broker, pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]
FED = "serve"


def exported(tmp_path: Path):
    """An export of 12 digits devices in 4 rotation groups: clusters from their sketches, no training."""
    images, labels = load_digits_images()
    clients = rotation_partition(images, labels, 16, groups=4, seed=0)
    fleet, newcomers = clients[:12], clients[12:]
    enc = OnnxEncoder("digits_encoder")
    sketches = {c.cid: Sketcher(enc, 10, 0.1, seed=i).sketch(c.x_train, c.y_train) for i, c in enumerate(fleet)}
    strategy = SketchClustered(seed=0, min_cluster_size=2)
    infos = [ClientInfo(c.cid, len(c.y_train), 10, ("sketch",)) for c in fleet]
    strategy.setup(infos, initial_weights(ARCH, 0))
    strategy.on_sketches(sketches)
    for j, key in enumerate(sorted(strategy.models)):  # each cluster its own weights
        strategy.models[key] = initial_weights(ARCH, 10 + j)
    config = ServerConfig(federation=FED, rounds=1, min_clients=1, encoder="digits_encoder", architecture=ARCH)
    clients_info = {i.cid: i for i in infos}

    def state(folder: Path) -> None:
        write_checkpoint(folder, 1, strategy, history=[], timings={}, clients=clients_info, sketches=sketches,
                         config=config, encoder="digits_encoder", architecture=ARCH, latent_dim=None,
                         pretrain_history=[], run_id="run-x")

    offers = model_offers(strategy, rnd=1, clients=clients_info)
    run = export_models(tmp_path / "models", strategy, offers, run_id="run-x", architecture=ARCH, rnd=1,
                        final=False, write_state=state)
    group_key = {c.group: strategy.model_key_for(c.cid) for c in fleet}
    return run, newcomers, group_key


def test_a_device_that_never_trained_gets_its_groups_model_by_cold_start(tmp_path):
    run, newcomers, group_key = exported(tmp_path)
    new = newcomers[0]
    save_client(tmp_path / "new.npz", new)
    cmd = [sys.executable, "-m"]
    with MosquittoBroker() as broker:
        server = subprocess.Popen([*cmd, "server_kit.cli", "--serve-models-from", str(run.link), "--broker",
                                   broker.url, "--serve-for", "25"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)
        try:
            device = subprocess.run([*cmd, "edge_sdk.client.cli", "--broker", broker.url, "--federation", FED,
                                     "--client-id", "newcomer", "--data", str(tmp_path / "new.npz"), "--seed", "3",
                                     "--model-dir", str(tmp_path / "kept"), "--get-model", "--hello-jitter", "0",
                                     "--max-idle", "20"], capture_output=True, text=True, timeout=60)
        finally:
            server.terminate()
            out, err = server.communicate(timeout=30)
    assert device.returncode == 0, device.stderr[-2000:]
    entry, _ = read_model_folder(tmp_path / "kept" / "current")
    key = group_key[new.group]
    assert entry.key == key and entry.run == "run-x"
    assert entry.files["weights.safetensors"] == run.manifest["models"][int(key[1:])]["files"][f"{key}/weights.safetensors"]
    assert f"kept model {key} of run run-x" in device.stderr
    assert "serving 4 model(s) of run run-x" in err, err[-2000:]


def test_an_export_that_is_not_one_and_a_get_model_without_a_folder_are_one_line_and_exit_2(tmp_path, capsys):
    from edge_sdk.client.cli import main as client
    from server_kit.cli import main as server

    assert server(["--serve-models-from", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == \
        f"fedsketch-server: error: {tmp_path}: no models.json (not a FedSketch models export)"
    (tmp_path / "models.json").write_text(json.dumps({"format": "something else"}))
    assert server(["--serve-models-from", str(tmp_path)]) == 2
    assert "not a FedSketch models export (fedsketch-models/1)" in capsys.readouterr().err
    np.savez(tmp_path / "d.npz", x=np.zeros((4, 8, 8), np.float32), y=np.zeros(4, np.int64))
    assert client(["--client-id", "d", "--data", str(tmp_path / "d.npz"), "--get-model",
                   "--broker", "mqtt://127.0.0.1:1"]) == 2
    assert capsys.readouterr().err.strip() == ("fedsketch-client: error: --get-model needs --model-dir (or "
                                               "--state-dir): the folder the model is kept in")


@pytest.mark.parametrize("name", ["ifca", "fedavg"])
def test_ifca_devices_choose_their_model_and_fedavg_serves_its_one(tmp_path, name):
    """IFCA: the new device gets all K models and keeps the one of lowest loss on its data (here the one
    trained on its group); FedAvg: the global model."""
    import threading

    from edge_sdk.client import EdgeClient
    from edge_sdk.models.keeping import ModelKeeper
    from edge_sdk.training.trainer import train_local
    from edge_sdk.transport import BrokerConfig, MqttTransport
    from edge_sdk.worker import LocalWorker
    from server_kit.drivers import Orchestrator
    from server_kit.drivers.phase import Phase
    from server_kit.strategies import make_strategy

    images, labels = load_digits_images()
    clients = rotation_partition(images, labels, 8, groups=4, seed=0)
    fleet, new = clients[:4], next(c for c in clients[4:] if c.group == 0)
    infos = {c.cid: ClientInfo(c.cid, len(c.y_train), 10, ("sketch",)) for c in fleet}
    params = {"k": 2} if name == "ifca" else {}
    strategy = make_strategy(name, seed=0, architecture=ARCH, **params)
    strategy.setup(list(infos.values()), initial_weights(ARCH, 0))
    trained = train_local(ARCH, initial_weights(ARCH, 0), images[:500], labels[:500], epochs=3,
                          lr=1e-2, batch_size=32, seed=0).weights  # upright digits: group 0's
    strategy.models[sorted(strategy.models)[-1]] = trained
    config = ServerConfig(federation=FED, rounds=1, min_clients=1, architecture=ARCH,
                          checkpoint_dir=str(tmp_path / "models" / "server-state"))

    def state(folder: Path) -> None:
        write_checkpoint(folder, 1, strategy, history=[], timings={}, clients=infos, sketches={}, config=config,
                         encoder=None, architecture=ARCH, latent_dim=None, pretrain_history=[], run_id="run-y")

    run = export_models(tmp_path / "models", strategy, model_offers(strategy, rnd=1, clients=infos), run_id="run-y",
                        architecture=ARCH, rnd=1, final=False, write_state=state)
    with MosquittoBroker() as broker:
        server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED)
        server.connect(timeout=10)
        device: list = []
        orch = Orchestrator(make_strategy(name, seed=0, architecture=ARCH, **params), server, config)
        got: dict = {}
        serving = threading.Thread(target=lambda: got.update(orch.serve(30, from_export=True, until=lambda: bool(
            device) and device[0].kept is not None)))
        serving.start()
        while orch.intake.phase is not Phase.SERVE:
            time.sleep(0.05)
        w = LocalWorker("newcomer", new.x_train, new.y_train, new.x_test, new.y_test, architecture=ARCH, seed=0)
        ec = EdgeClient(MqttTransport(BrokerConfig.from_url(broker.url), "newcomer", federation=FED), w,
                        federation=FED, keeper=ModelKeeper(tmp_path / "kept"), get_model=True, model_timeout_s=20)
        device.append(ec)
        ec.run(max_idle_s=20)
        serving.join(timeout=30)
        server.close()
    entry, _ = read_model_folder(tmp_path / "kept" / "current")
    keys = sorted(strategy.models)
    assert got == {"newcomer": keys} and ec.exit_code == 0
    assert entry.key == keys[-1] and entry.run == "run-y" and entry.strategy == name
    assert entry.files["weights.safetensors"] == next(
        m for m in run.manifest["models"] if m["key"] == keys[-1])["files"][f"{keys[-1]}/weights.safetensors"]
    assert ec.transport.stats()["received"]["MODEL"]["messages"] == len(keys)
