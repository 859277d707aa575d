"""Devices that come and go, slow devices, devices that cannot train (issue 12, point 4)."""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from edge_sdk.client import EdgeClient
from edge_sdk.health import DeviceHealth
from edge_sdk.install import install_hint
from edge_sdk.protocol import Kind, Message
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MemoryBroker, MemoryTransport, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.strategies.fedavg import FedAvg
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH


@pytest.fixture(scope="module")
def clients():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 8, groups=4, seed=0)


def start(clients, make_transport, **kw):
    threads, edges = [], []
    for i, c in enumerate(clients):
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, seed=i)  # no architecture: the server's
        ec = EdgeClient(make_transport(c.cid), w, federation="fleet", seed=i, model_timeout_s=30, **kw)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 90}, daemon=True)
        th.start()
        threads.append(th)
        edges.append(ec)
    return threads, edges


def config(n, **kw):
    base = dict(federation="fleet", rounds=4, min_clients=n, register_timeout_s=30, sketch_timeout_s=30,
                round_timeout_s=30, eval_timeout_s=30, seed=0)
    return ServerConfig(**{**base, **kw})


def strategy():
    return SketchClustered(settings=TrainSettings(epochs=2, lr=1e-2, batch_size=16), min_cluster_size=1, seed=0)


@pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")
def test_devices_come_back_after_the_broker_restarts_and_a_late_device_joins(clients):
    early, late = clients[:7], clients[7]
    with MosquittoBroker() as broker:
        def make(cid):
            return MqttTransport(BrokerConfig.from_url(broker.url, reconnect_min_s=0.1, reconnect_max_s=1),
                                 cid, federation="fleet")

        threads, edges = start(early, make)
        server = make("server")
        server.connect(timeout=10)

        def disrupt(rec):
            if rec["round"] == 1:
                broker.restart()  # every connection is cut, the server's too
                assert server.wait_connected(15)
                time.sleep(1.0)  # the devices reconnect (back-off up to 1 s) and say hello again
                t2, e2 = start([late], make)  # and a device that missed registration asks to join
                threads.extend(t2)
                edges.extend(e2)

        try:
            result = Orchestrator(strategy(), server, config(len(early)), on_round=disrupt).run()
        finally:
            server.close()
        for th in threads:
            th.join(timeout=30)
    hist = result.history
    assert hist[0]["updates"] == 7
    assert [h["updates"] for h in hist[2:]] == [8, 8]  # everybody trains again, the late device too
    truth = [c.group for c in clients]
    assert adjusted_rand_score(truth, [result.assignment[c.cid] for c in clients]) == 1.0
    assert result.final["accuracy"] > 0.5  # measured 0.886 (default FP path), 0.892 (alt)
    assert all(e.exit_code == 0 and e.handled.get("stop") == 1 for e in edges)  # told the server finished


def test_slow_devices_reporting_progress_keep_their_round_open(clients, server_transport):
    """Rounds whose deadline (0.5 s) is far shorter than the training: nothing is lost, nothing is late."""
    broker = MemoryBroker()
    few = clients[:4]
    threads, edges = start(few, lambda cid: MemoryTransport(broker, cid, federation="fleet"), progress_interval_s=0.2)
    server = server_transport(broker, federation="fleet")
    server.connect()
    # 16 epochs: about 2.5 s a round here, five times the deadline
    slow = SketchClustered(settings=TrainSettings(epochs=16, lr=1e-2, batch_size=8), min_cluster_size=1, seed=0)
    t0 = time.monotonic()
    result = Orchestrator(slow, server, config(4, rounds=2, round_timeout_s=0.5, first_round_timeout_s=0.5,
                                                 progress_grace_s=2.0, max_round_s=60)).run()
    for th in threads:
        th.join(timeout=30)
    assert [h["updates"] for h in result.history] == [4, 4]
    assert min(h["seconds"] for h in result.history) > 0.5  # every round outlived its first deadline
    # ... and closed when every device had answered: not at a deadline nor at max_round_s (60 s), no stragglers
    assert [(h["close"], h["stragglers"]) for h in result.history] == [("all-answered", [])] * 2
    assert "late-update" not in result.rejected and "stale-update" not in result.rejected
    print(f"rounds took {[round(h['seconds'], 1) for h in result.history]} s, the run {time.monotonic() - t0:.1f} s")


def test_a_fleet_that_cannot_train_stops_at_registration(clients, monkeypatch, server_transport):
    import edge_sdk.training.trainer

    monkeypatch.setattr(edge_sdk.training.trainer, "torch_available", lambda: False)  # every device says: no torch
    broker = MemoryBroker()
    threads, edges = start(clients[:3], lambda cid: MemoryTransport(broker, cid, federation="fleet"))
    server = server_transport(broker, federation="fleet")
    server.connect()
    orch = Orchestrator(strategy(), server, config(3))
    hint = re.escape(install_hint("train"))
    with pytest.raises(RuntimeError, match=rf"none of the 3 admitted clients can train \(c00: no torch on the "
                                           rf"device \({hint}\); c01: .*\): install torch on the devices"):
        orch.run()
    assert orch.history == []
    for th in threads:  # told why, the devices leave
        th.join(timeout=10)
    assert all(e.handled.get("welcome") == 1 and e.handled.get("stop") == 1 for e in edges)


def test_refused_and_not_training_devices(clients, server_transport):
    """A device whose labels do not fit is refused (it exits 4); one without torch is admitted, never tasked."""
    from edge_sdk.worker import LocalWorker as Worker

    broker = MemoryBroker()
    fleet = clients[:4]
    threads, edges = start(fleet, lambda cid: MemoryTransport(broker, cid, federation="fleet"))
    bad = clients[4]
    w = Worker("c99", bad.x_train, np.full(len(bad.y_train), 12), seed=0)  # labels beyond 10 classes
    odd = EdgeClient(MemoryTransport(broker, "c99", federation="fleet"), w, federation="fleet", model_timeout_s=30)
    class NoTorch(Worker):  # what a device without torch says (the process test hides torch for real)
        def hello(self):
            h = super().hello()
            h["capabilities"] = [c for c in h["capabilities"] if "torch" not in c]
            return h

    c = clients[5]
    nt = EdgeClient(MemoryTransport(broker, c.cid, federation="fleet"),
                    NoTorch(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, seed=5), federation="fleet",
                    model_timeout_s=30)
    more = [threading.Thread(target=e.run, kwargs={"max_idle_s": 60}, daemon=True) for e in (odd, nt)]
    for th in more:
        th.start()
    server = server_transport(broker, federation="fleet")
    server.connect()
    result = Orchestrator(strategy(), server, config(6, rounds=2)).run()
    for th in threads + more:
        th.join(timeout=30)
    assert result.refused == {"c99": "its labels go up to 12; this federation has 10 classes (0 to 9)"}
    assert odd.exit_code == 4 and odd.refused_reason == result.refused["c99"]
    assert result.not_training == {c.cid: f"no torch on the device ({install_hint('train')})"}
    assert [h["tasked"] for h in result.history] == [4, 4] and [h["updates"] for h in result.history] == [4, 4]
    assert c.cid in result.assignment and c.cid in result.final["per_client"]  # sketched and evaluated
    assert nt.handled.get("train", 0) == 0 and nt.exit_code == 0


def test_the_server_keeps_each_devices_latest_health(server_transport):
    """The hello's health, then each status's; a status without one keeps it; a bad one is refused and counted."""
    transport = server_transport(MemoryBroker(), federation="fh")
    transport.connect()
    orch = Orchestrator(FedAvg(seed=0), transport, ServerConfig(federation="fh", architecture=ARCH),
                        template={"w": np.zeros((2, 3), np.float32)})
    hello = {"n_samples": 10, "health": {"cpu_temp_c": 48.3, "throttled": 0x50005, "mem_total_mb": 3792.0}}
    orch.link.handle_safely("t", Message(Kind.HELLO, "fh", "c1", 0, hello))
    state = orch.fleet.clients["c1"]
    assert state.health == DeviceHealth(cpu_temp_c=48.3, throttled=0x50005, mem_total_mb=3792.0)
    assert state.health.throttling_now
    sent = {"state": "online", "sent": 2, "health": {"round_s": 12.5, "model_version": 2, "load1": 0.7}}
    orch.link.handle_safely("t", Message(Kind.STATUS, "fh", "c1", 2, sent))
    assert state.health == DeviceHealth(round_s=12.5, model_version=2, load1=0.7) and state.sent[0] == 2
    orch.link.handle_safely("t", Message(Kind.STATUS, "fh", "c1", 3, {"state": "online", "working": 3}))
    assert state.working[0] == 3 and state.health == DeviceHealth(round_s=12.5, model_version=2, load1=0.7)
    before = orch.rejected.get("meta-field", 0)
    bad = {"state": "online", "working": 4, "health": {"cpu_temp_c": float("nan")}}
    orch.link.handle_safely("t", Message(Kind.STATUS, "fh", "c1", 4, bad))
    assert orch.rejected["meta-field"] == before + 1 and state.working[0] == 3 and state.health.round_s == 12.5
    orch.link.handle_safely("t", Message(Kind.HELLO, "fh", "c1", 0, {"n_samples": 10}))  # a hello without: kept
    assert orch.fleet.clients["c1"].health == DeviceHealth(round_s=12.5, model_version=2, load1=0.7)
