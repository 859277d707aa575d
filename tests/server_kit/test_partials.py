"""Partial aggregation over a real Mosquitto and real processes: ingest workers, each on a partition of the updates.

The same federation (digits, 4 rotation groups, fixed seeds) runs with the server taking the updates itself,
with one ingest worker and with two; the clusters are the same (ARI 1.0) and so are the models, within float
summation order. Chunked updates (a small max_payload) reach the worker of their sender's partition whole.
A worker killed in a round is started again and the updates it held are asked for again.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
from sklearn.metrics import adjusted_rand_score

from edge_sdk.client import EdgeClient
from edge_sdk.protocol import Kind, partition_of
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.drivers.remote import Ingest
from server_kit.partials import IngestWorkers
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, assert_same_models

pytest.importorskip("torch")
pytestmark = [pytest.mark.broker,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]

FED = "parts"
SETTINGS = TrainSettings(epochs=2, lr=1e-2, batch_size=16)
#: Small packets: every update (LeNet-5, ~250 kB) goes in chunks, which the workers route to their owner.
MAX_PAYLOAD = 64_000


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 8, groups=2, seed=0)


def federate(url, clients, *, workers=0, rounds=2, kill_worker_in_round=None, compress=None, round_timeout_s=60,
             metrics=None, drop_first_update_of=None, reask_lost_s=10.0, restart_broker=None):
    """The run; with ``metrics`` (a dict), the workers export their metrics from a free port on, scraped after the
    run into ``metrics`` (worker id -> {series name: value summed over labels})."""
    edge, threads = [], []
    for i, c in enumerate(clients):
        cfg = BrokerConfig.from_url(url, reconnect_min_s=0.1, max_payload=MAX_PAYLOAD)
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        t = MqttTransport(cfg, c.cid, federation=FED)
        if c.cid == drop_first_update_of:
            _lose_first_update(t)
        ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=30)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 90}, daemon=True)
        th.start()
        threads.append(th)
        edge.append(ec)
    bcfg = BrokerConfig.from_url(url, max_payload=MAX_PAYLOAD)
    server = MqttTransport(bcfg, "server", federation=FED)
    server.connect(timeout=10)
    base = _free_ports(workers + 1) if metrics is not None else None
    pool = IngestWorkers(workers, bcfg, FED, metrics_port=base) if workers else None
    kw = {}
    if pool is not None:
        kw = {"aggregators": pool.start(), "ingest": Ingest(pool.ids, alive=pool.alive, revive=pool.revive)}
    rounds_seen = []

    def on_round(rec):
        rounds_seen.append(rec)

    strategy = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0, **({"compression": compress}
                                                                                  if compress else {}))
    config = ServerConfig(federation=FED, rounds=rounds, min_clients=len(clients), register_timeout_s=30,
                          sketch_timeout_s=30, round_timeout_s=round_timeout_s, first_round_timeout_s=round_timeout_s,
                          eval_timeout_s=30, encoder="digits_encoder",
                          architecture=ARCH, seed=0, partial_timeout_s=20, reask_lost_s=reask_lost_s)
    orch = Orchestrator(strategy, server, config, on_round=on_round, **kw)
    if kill_worker_in_round is not None:
        _kill_when_training(orch, pool, kill_worker_in_round)
    if restart_broker is not None:
        _restart_when_half_held(orch, restart_broker, len(clients))
    try:
        result = orch.run()
        if metrics is not None:
            metrics.update({wid: _scrape(base + 1 + i) for i, wid in enumerate(pool.ids)})
    finally:
        server.close()
        if pool is not None:
            pool.stop()
    for th in threads:
        th.join(timeout=30)
    return result, strategy


def _lose_first_update(t):
    """``t``'s first update never reaches the broker (the device believes it sent it)."""
    publish, dropped = t.publish, []

    def lossy(topic, msg, **kw):
        if msg.kind == Kind.UPDATE and not dropped:
            dropped.append(topic)
            return 0
        return publish(topic, msg, **kw)

    t.publish = lossy


def _free_ports(n):
    """A port P with P+1..P+n-1 free too (bound and released)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            socks = [socket.socket() for _ in range(n)]
            for i, sock in enumerate(socks):
                sock.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no run of free ports")


def _scrape(port):
    """An ingest worker's /metrics: {sample name: value summed over its labels}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for sample in fam.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _restart_when_half_held(orch, broker, n):
    """Restart the broker (every connection cut, what was in flight lost) once round 1 holds a receipt but not
    half of them."""
    remote = orch.remote

    def watch():
        while True:
            if remote.round == 1 and 1 <= len(remote.held_by) < n // 2:
                broker.restart()
                return
            time.sleep(0.005)

    threading.Thread(target=watch, daemon=True).start()


def _kill_when_training(orch, pool, rnd):
    """SIGKILL ingest worker 0 once round ``rnd``'s first receipt names it."""
    remote = orch.remote

    def watch():
        while True:
            if remote.round == rnd and "ingest-0" in remote.held_by.values():
                os.kill(pool.pid("ingest-0"), signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=watch, daemon=True).start()


@pytest.fixture(scope="module")
def flat(digits):
    with MosquittoBroker() as broker:
        return federate(broker.url, digits)


@pytest.mark.parametrize("workers", [1, 2])
def test_ingest_workers_give_the_models_of_one_server(digits, flat, workers):
    flat_result, flat_strategy = flat
    scraped = {}
    with MosquittoBroker() as broker:
        result, strategy = federate(broker.url, digits, workers=workers, metrics=scraped)
    truth = [c.group for c in digits]
    assert adjusted_rand_score(truth, [result.assignment[c.cid] for c in digits]) == 1.0
    assert result.assignment == flat_result.assignment
    assert [h["updates"] for h in result.history] == [len(digits)] * 2
    # the server received no update: receipts and one partial sum per cluster per worker that held one
    assert "UPDATE" not in result.transport["received"]
    assert result.transport["received"]["RECEIPT"]["messages"] == len(digits) * 2
    partials = result.transport["received"]["PARTIAL"]["messages"]
    assert 2 * 2 <= partials <= 2 * 2 * workers
    # each worker exported its own figures, and together they are what the server received
    assert sorted(scraped) == [f"ingest-{i}" for i in range(workers)]
    assert sum(m["fedsketch_aggregator_receipts_total"] for m in scraped.values()) == len(digits) * 2
    assert sum(m["fedsketch_aggregator_partials_total"] for m in scraped.values()) == partials
    assert all(m["fedsketch_aggregator_held_updates"] == 0 and m["process_resident_memory_bytes"] > 0
               for m in scraped.values())
    assert_same_models(flat_strategy, strategy)
    assert result.final["accuracy"] == pytest.approx(flat_result.final["accuracy"], abs=0.02)


def test_a_killed_worker_is_started_again_and_its_updates_asked_for_again(digits):
    """Worker 0 is killed in round 1 once it holds an update: it is started again, the devices whose updates it
    held (or that sent theirs to its partition meanwhile) are asked again, and round 1 closes with every update
    summed, before its deadline; nothing is refused as lost."""
    with MosquittoBroker() as broker:
        result, strategy = federate(broker.url, digits, workers=2, kill_worker_in_round=1, rounds=2,
                                    round_timeout_s=40)
    first = result.history[0]
    print(f"round 1: close {first['close']} at {first['close_s']} s, reasked {first['reasked']}")
    assert first["reasked"].get("lost", 0) >= 1, first
    assert first["close"] == "all-answered" and first["close_s"] < 40, first
    assert first["refused"] == {} and "aggregator-lost" not in result.rejected
    assert first["summary"]["summed_remote"] == first["updates"] == len(digits), first
    assert [h["updates"] for h in result.history] == [len(digits)] * 2
    assert result.final["evaluated"] == len(digits)


def test_an_update_its_worker_never_took_is_noticed_named_and_asked_for_again(digits, caplog):
    """c03's first update never reaches its worker: 3 s after c03 said it sent it, the round names the worker that
    never took it, asks c03 again, counts it in the round's record, and closes with every update summed."""
    worker = f"ingest-{partition_of('c03', 2)}"
    with MosquittoBroker() as broker, caplog.at_level(logging.WARNING, logger="server_kit.drivers.round_port"):
        result, _ = federate(broker.url, digits, workers=2, rounds=1, drop_first_update_of="c03",
                             reask_lost_s=3.0)
    r1 = result.history[0]
    assert r1["unreceipted"] == {worker: 1} and r1["reasked"] == {"lost": 1}, r1
    assert r1["close"] == "all-answered" and r1["summary"]["summed_remote"] == len(digits), r1
    said = [r.getMessage() for r in caplog.records if "never took" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(f"round 1: {worker} never took c03's update (said sent ")
    assert said[0].endswith(f" s ago on partition {partition_of('c03', 2)}): asking c03 again"), said


def test_a_broker_restart_mid_round_loses_no_update(digits, caplog):
    """The broker restarts, with no persistence, once round 1 holds a receipt: every connection is cut (the
    server's, each worker's, each device's) and what was in flight is gone. The server and each worker say they
    reconnected, the updates said sent and not taken are asked for again, and round 1 closes with every update
    summed, before its deadline."""
    with MosquittoBroker(persistence=False) as broker, \
            caplog.at_level(logging.WARNING, logger="server_kit.drivers.round_port"):
        result, _ = federate(broker.url, digits, workers=2, rounds=1, restart_broker=broker, round_timeout_s=60)
    r1 = result.history[0]
    print(f"round 1: {r1['close']} at {r1['close_s']} s, reasked {r1['reasked']}, unreceipted {r1['unreceipted']}")
    assert r1["close"] == "all-answered" and r1["close_s"] < 60, r1
    assert r1["summary"]["summed_remote"] == r1["updates"] == len(digits) and r1["refused"] == {}, r1
    said = [r.getMessage() for r in caplog.records if "reconnected to the broker" in r.getMessage()]
    assert any(m.startswith("round 1: the server reconnected to the broker; asking again in 2 s for the ")
               for m in said), said
    assert r1["reasked"].get("reconnect", 0) >= 1, r1
    assert result.final["evaluated"] == len(digits)
