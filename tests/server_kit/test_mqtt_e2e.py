"""End to end over real brokers and real sockets: amqtt in-process, Mosquitto with the ACL.

Also the failure cases with real processes: a client killed in the middle of
a round, a server killed after a round and resumed from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from edge_sdk.client import EdgeClient
from edge_sdk.models.keeping import ModelKeeper
from edge_sdk.models.model_folder import read_model_folder
from edge_sdk.protocol import Topics
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
from server_kit.data.partition import load_digits_images, rotation_partition, save_client
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.drivers.phase import Phase
from server_kit.drivers.simulate import Simulator
from server_kit.strategies.fedavg import FedAvg
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, count_publishes

pytest.importorskip("torch")
pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parents[2]
FED = "e2e"
SETTINGS = TrainSettings(epochs=3, lr=1e-2, batch_size=16)
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 12, groups=4, seed=0)


def start_devices(url, clients, passwords=None, protocol="3.1.1", model_root=None, first_seed=0, **kw):
    """One EdgeClient thread per client (its model kept in ``model_root/ID`` when given); (threads, clients)."""
    threads, edge = [], []
    for i, c in enumerate(clients, start=first_seed):
        cfg = BrokerConfig.from_url(url, username=c.cid if passwords else None,
                                    password=(passwords or {}).get(c.cid), reconnect_min_s=0.1, protocol=protocol)
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        t = MqttTransport(cfg, c.cid, federation=FED)
        keeper = None if model_root is None else ModelKeeper(model_root / c.cid)
        ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=30, keeper=keeper, **kw)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 60}, daemon=True)
        th.start()
        threads.append(th)
        edge.append(ec)
    return threads, edge


def run_federation(url, clients, passwords=None, rounds=3, protocol="3.1.1", fraction=1.0, eval_fraction=1.0,
                   model_root=None, newcomers=()):
    """The clustered run; with ``model_root``, the devices keep their models there, the server exports its own
    (``model_root/export``) and then serves them to ``newcomers`` (each with --get-model's behaviour)."""
    threads, edge = start_devices(url, clients, passwords, protocol, model_root)
    cfg = BrokerConfig.from_url(url, username="server" if passwords else None,
                                password=(passwords or {}).get("server"), protocol=protocol)
    server = MqttTransport(cfg, "server", federation=FED)
    server.connect(timeout=10)
    published = count_publishes(server)  # (topic, what): a command's op, or the message kind
    try:
        strategy = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0, fraction=fraction)
        config = ServerConfig(federation=FED, rounds=rounds, min_clients=len(clients), register_timeout_s=30,
                              sketch_timeout_s=30, round_timeout_s=60, eval_timeout_s=30,
                              encoder="digits_encoder", architecture=ARCH, seed=0, eval_fraction=eval_fraction)
        orch = Orchestrator(strategy, server, config)
        result = orch.run()
        published = list(published)  # the run's; what serving sends is checked apart
        if model_root is not None:
            exported = orch.export_models(model_root / "export")
            late: list = []
            got: dict = {}
            serving = threading.Thread(target=lambda: got.update(orch.serve(
                60, until=lambda: len(late) == len(newcomers) and all(e.kept is not None for e in late))))
            serving.start()
            while orch.intake.phase is not Phase.SERVE:  # new devices come once the server serves
                time.sleep(0.05)
            late_threads, started = start_devices(url, newcomers, passwords, protocol, model_root,
                                                  first_seed=100, get_model=True)
            late.extend(started)
            serving.join(timeout=60)
            for th in late_threads:
                th.join(timeout=30)
            served = got
    finally:
        server.close()
    for th in threads:
        th.join(timeout=30)
    if model_root is not None:
        return SimpleNamespace(**result.to_dict(), exported=exported, served=served, late=late, edge=edge,
                               published=published)
    # the run's result, and what the devices counted on their side
    return SimpleNamespace(**result.to_dict(),
                           edge_models=[e.transport.stats()["received"]["MODEL"] for e in edge],
                           edge_trained=[e.handled.get("train", 0) for e in edge],
                           edge_metrics=[e.transport.stats()["sent"].get("METRICS", {}).get("messages", 0)
                                         for e in edge],
                           published=published)


def check_result(result, clients, rounds=3):
    truth = [c.group for c in clients]
    labels = [result.assignment[c.cid] for c in clients]
    assert adjusted_rand_score(truth, labels) == 1.0, labels
    assert [h["updates"] for h in result.history] == [len(clients)] * rounds
    fed = Simulator(FedAvg(settings=SETTINGS, seed=0), clients, architecture=ARCH, seed=0).run(rounds)
    assert result.final["accuracy"] > fed.accuracies[-1] + 0.05, (result.final, fed.accuracies)
    sketches = result.transport["received"]["SKETCH"]
    assert sketches["messages"] == len(clients) and sketches["bytes"] <= 64 * len(clients)
    # through the broker each device got only its cluster's model: one per round and one to evaluate
    assert [m["messages"] for m in result.edge_models] == [rounds + 1] * len(clients)
    assert sum(m["bytes"] for m in result.edge_models) == result.delivered["MODEL"]
    # each device follows its cluster's topic: the final evaluation's models went once per cluster, and so did
    # the rounds' (every device trains every round), once the devices confirmed what they follow
    k = len(set(labels))
    topics = Topics("fedsketch", FED)
    on_clusters = [t for t, what in result.published if what == "MODEL" and "/clusters/" in t]
    assert sorted(on_clusters) == sorted([topics.model(f"c{j}") for j in range(k)] * (rounds + 1))
    assert result.final["deliveries"] == {"cluster_topic": k, "per_device": 0}
    # one evaluate command for the fleet, one sketch request
    for op in ("evaluate", "sketch"):
        assert [t for t, what in result.published if what == op] == [topics.broadcast()], op
    assert result.final["asked"] == result.final["evaluated"] == len(clients) and result.final["unanswered"] == []


def test_federation_over_embedded_amqtt_broker_keeps_exports_and_serves_its_models(digits, tmp_path, caplog):
    """amqtt speaks MQTT 3.1.1 only. Every device keeps its cluster's model, the same bytes as the server's
    export; a new device of each group, never trained, gets its group's model from its sketch alone."""
    caplog.set_level(logging.INFO)  # what the devices and the server said, if it fails
    images, labels = load_digits_images()
    newcomers = []
    for c in rotation_partition(images, labels, 8, groups=4, seed=5):
        if c.group not in {n.group for n in newcomers}:
            newcomers.append(dataclasses.replace(c, cid=f"new{c.group}"))
    with EmbeddedBroker() as broker:
        result = run_federation(broker.url, digits, model_root=tmp_path, newcomers=newcomers)
    result.edge_models = [e.transport.stats()["received"]["MODEL"] for e in result.edge]
    check_result(result, digits)
    exported = {m["key"]: m for m in result.exported.manifest["models"]}
    for c in digits:  # every device keeps the model it was assigned, bit for bit the export
        entry, _ = read_model_folder(tmp_path / c.cid / "current")
        key = f"c{result.assignment[c.cid]}"
        assert entry.key == key and entry.run == result.run_id, (c.cid, entry)
        assert entry.files["weights.safetensors"] == exported[key]["files"][f"{key}/weights.safetensors"]
        assert entry.server_accuracy == pytest.approx(result.final["per_model"][key])
    group_key = {c.group: f"c{result.assignment[c.cid]}" for c in digits}
    for n, e in zip(newcomers, result.late):  # cold start: one sketch up, one model down, kept; exit 0
        assert (tmp_path / n.cid / "current").exists(), (n.cid, e.handled, e.rejected, e.kept, e.exit_code)
        entry, _ = read_model_folder(tmp_path / n.cid / "current")
        assert [entry.key] == [group_key[n.group]] == result.served[n.cid], (n.cid, entry)
        assert entry.files["weights.safetensors"] == exported[entry.key]["files"][f"{entry.key}/weights.safetensors"]
        assert e.exit_code == 0 and e.transport.stats()["received"]["MODEL"]["messages"] == 1
        sent = e.transport.stats()["sent"]
        assert sent["SKETCH"]["messages"] == 1 and "UPDATE" not in sent, (sent, e.handled)
    # the export runs alone in ONNX Runtime, as the torch model does
    onnx_path = result.exported.link / "c0" / "model.onnx"
    import onnxruntime as ort

    from edge_sdk.models.model_folder import read_model_folder as read
    from edge_sdk.training.evaluation import torch_logits

    _, weights = read(result.exported.link / "c0")
    x = digits[0].x_test.reshape(-1, 1, 8, 8).astype(np.float32)
    got = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(["logits"], {"x": x})[0]
    want, _ = torch_logits(ARCH, weights, x, digits[0].y_test, 64, "cpu", 1)
    assert np.abs(got - want).max() < 1e-5


@needs_mosquitto
def test_federation_over_mosquitto_with_acl(digits, shipped_acl):
    """Per-client passwords, the shipped ACL, MQTT 5."""
    passwords = {c.cid: f"pw-{c.cid}" for c in digits} | {"server": "pw-server"}
    acl = shipped_acl(FED)
    with MosquittoBroker(acl=acl, passwords=passwords) as broker:
        result = run_federation(broker.url, digits, passwords=passwords, protocol="5")
    check_result(result, digits)


@needs_mosquitto
def test_sampled_rounds_and_evaluation_over_mosquitto_with_acl(digits, shipped_acl):
    """Rounds of 2 of each cluster's 3 devices go per device, the evaluation of a seeded half of the
    fleet is one broadcast, and each device downloads exactly what it needs (the ACL lets it follow its
    cluster's topic and confirm it)."""
    from edge_sdk.training.sampling import in_sample, sample_point

    passwords = {c.cid: f"pw-{c.cid}" for c in digits} | {"server": "pw-server"}
    with MosquittoBroker(acl=shipped_acl(FED), passwords=passwords) as broker:
        result = run_federation(broker.url, digits, passwords=passwords, protocol="5", rounds=2, fraction=0.5,
                                eval_fraction=0.5)
    assignment = result.assignment
    assert adjusted_rand_score([c.group for c in digits], [assignment[c.cid] for c in digits]) == 1.0
    assert [h["deliveries"] for h in result.history] == [{"cluster_topic": 0, "per_device": 8}] * 2
    sampled = {c for c in assignment if in_sample(c, 0.5, 0)}
    expected = set(sampled)
    for j in set(assignment.values()):
        members = [c for c in assignment if assignment[c] == j]
        if not sampled & set(members):
            expected.add(min(members, key=lambda c: sample_point(c, 0)))
    final = result.final
    assert set(final["per_client"]) == expected and final["asked"] == final["evaluated"] == len(expected)
    for c, models, trained, metrics in zip(digits, result.edge_models, result.edge_trained,
                                           result.edge_metrics):
        asked = c.cid in expected
        assert (models["messages"], metrics) == (trained + int(asked), int(asked)), c.cid
    assert sum(m["bytes"] for m in result.edge_models) == result.delivered["MODEL"]
    assert [t for t, what in result.published if what == "evaluate"].count(Topics("fedsketch", FED).broadcast()) == 1
    assert not result.rejected


# ---------------------------------------------------------------- processes


def spawn_client(url, path, cid, seed):
    cmd = [sys.executable, "-m", "edge_sdk.client.cli", "--broker", url, "--federation", FED, "--client-id", cid,
           "--data", str(path), "--architecture", ARCH, "--seed", str(seed), "--max-idle", "90"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))


def write_clients(tmp_path, clients):
    paths = []
    for c in clients:
        p = tmp_path / f"{c.cid}.npz"
        save_client(p, c)
        paths.append(p)
    return paths


@needs_mosquitto
def test_client_killed_mid_round_does_not_stop_the_round(tmp_path, digits):
    clients = digits[:4]
    paths = write_clients(tmp_path, clients)
    with MosquittoBroker() as broker:
        procs = {c.cid: spawn_client(broker.url, p, c.cid, i) for i, (c, p) in enumerate(zip(clients, paths))}
        victim = clients[2].cid
        server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED)
        server.connect()
        publish = server.publish
        killed = {}

        def publish_and_kill(topic, msg, **kw):
            n = publish(topic, msg, **kw)
            if topic == Topics("fedsketch", FED).cmd(victim) and msg.meta.get("op") == "train" and msg.meta.get("round") == 2:
                procs[victim].send_signal(signal.SIGKILL)  # dies holding its round-2 task
                killed["at"] = time.monotonic()
            return n

        server.publish = publish_and_kill
        config = ServerConfig(federation=FED, rounds=3, min_clients=4, round_timeout_s=90, register_timeout_s=60,
                              eval_timeout_s=30, architecture=ARCH, seed=0)
        t0 = time.monotonic()
        result = Orchestrator(FedAvg(settings=SETTINGS, seed=0), server, config).run()
        server.close()
        for p in procs.values():
            p.wait(timeout=30)
    h = result.history
    assert [r["updates"] for r in h] == [4, 3, 3]
    assert h[1]["missing"] == [victim]
    # the round closed on the victim's last will (it went offline: nobody left to wait for), not at its 90 s deadline
    assert (h[1]["close"], h[1]["offline"]) == ("all-answered", [victim])
    print(f"round 2 took {h[1]['seconds']:.1f} s, the whole run {time.monotonic() - t0:.1f} s")  # reported only
    assert result.final["accuracy"] is not None


@needs_mosquitto
def test_server_killed_and_resumed_keeps_assignment_and_continues(tmp_path, digits):
    images, labels = load_digits_images()
    clients = rotation_partition(images, labels, 4, groups=2, seed=1)  # 2 device processes per group
    paths = write_clients(tmp_path, clients)
    ckpt, report = tmp_path / "ckpt", tmp_path / "report"

    def server_cmd(*extra):
        return [sys.executable, "-m", "server_kit.cli", "--broker", broker.url, "--federation", FED,
                "--strategy", "fedsketch", "--rounds", "4", "--min-clients", "4", "--epochs", "1", "--lr", "0.01",
                "--batch-size", "16", "--min-cluster-size", "2", "--checkpoint-dir", str(ckpt),
                "--architecture", ARCH, "--encoder", "digits_encoder", "--report-dir", str(report), *extra]

    with MosquittoBroker() as broker:
        procs = [spawn_client(broker.url, p, c.cid, i) for i, (c, p) in enumerate(zip(clients, paths))]
        first = subprocess.Popen(server_cmd(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        state = None
        while time.monotonic() < deadline:
            try:
                state = json.loads((ckpt / "state.json").read_text())
            except (OSError, ValueError):
                state = None
            if state and state["round"] >= 2:
                break
            time.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
        assert state is not None and state["round"] >= 2, "the first server never checkpointed round 2"
        saved_round = json.loads((ckpt / "state.json").read_text())["round"]
        saved_assignment = json.loads((ckpt / "state.json").read_text())["strategy"]["assignment"]
        second = subprocess.run(server_cmd("--resume"), cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        for p in procs:
            p.wait(timeout=30)
    result = json.loads((report / "results.json").read_text())
    assert result["assignment"] == saved_assignment
    assert [h["round"] for h in result["history"]] == [1, 2, 3, 4]
    resumed = [h for h in result["history"] if h["round"] > saved_round]
    assert resumed and all(h["updates"] == 4 for h in resumed)
    truth = {c.cid: c.group for c in clients}
    assert adjusted_rand_score([truth[c] for c in sorted(truth)], [saved_assignment[c] for c in sorted(truth)]) == 1.0
    assert "resumed from" in second.stderr
    np.testing.assert_array_less(0, [h["updates"] for h in result["history"]])
