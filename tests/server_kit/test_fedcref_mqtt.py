"""FedCRef over MQTT: the same communities and refined labels as the in-process driver.

The small digits federation of ``test_fedcref.py`` (six clients sharing 0, 1, 4 and 6, a seventh
alone with 3 and 7), with fewer epochs and rounds so that a run takes seconds; ``threads=1`` keeps
torch from fighting the other runs for the two cores (and makes no difference to the numbers).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.fedcref import FedCRefClient
from edge_sdk.fedcref.mqtt import FedCRefEdge
from edge_sdk.protocol import Kind, Message, decode_message, encode_message
from edge_sdk.transport import BrokerConfig, MemoryBroker, MemoryTransport, MqttTransport
from server_kit.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto
from server_kit.fedcref import FedCRefServer, run_fedcref
from server_kit.fedcref.mqtt import FedCRefCoordinator

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
FED = "fedcref"
CLASS_SETS = [(0, 1), (0, 4), (1, 6), (0, 4, 6), (1, 4), (0, 1, 6), (3, 7)]
SERVER_KW = {"theta": 0.3, "community_rounds": 3, "max_iterations": 3}


@pytest.fixture(scope="module")
def data(digits_by_class_sets):
    x, y, parts = digits_by_class_sets(CLASS_SETS)
    return [(x[idx], y[idx]) for idx in parts]


def make_clients(parts, epochs=20):
    return [
        FedCRefClient(f"c{i}", xi, n_clusters=len(CLASS_SETS[i]), init="kmeans" if i == len(parts) - 1 else "dirty",
                      true_labels=yi, dirtiness=0.3, epochs=epochs, batch_size=16, community_epochs=2, seed=i, threads=1)
        for i, (xi, yi) in enumerate(parts)
    ]


@pytest.fixture(scope="module")
def reference(data):
    clients = make_clients(data)
    result = run_fedcref(clients, true_labels=[yi for _, yi in data], seed=0, **SERVER_KW)
    # the run is worth comparing with: final_acc measured 0.982-0.986 over seeds 0-3, default and alt FP path
    assert len(result.communities) == 4 and result.final_acc > 0.95
    return result, clients


def start_edges(clients, transport_for):
    edges, threads = [], []
    for c in clients:
        edge = FedCRefEdge(c, transport_for(c.cid))
        th = threading.Thread(target=edge.run, kwargs={"max_idle_s": 60}, daemon=True)
        th.start()
        edges.append(edge)
        threads.append(th)
    return edges, threads


def check_same_as_in_process(got, clients, reference):
    ref, ref_clients = reference
    assert got.graph_communities == ref.graph_communities
    assert got.communities == ref.communities
    assert got.iterations == ref.iterations and got.stopped == ref.stopped
    keys = ("communities", "isolated", "clusters", "edges", "community_links", "active", "stability")
    assert [{k: h[k] for k in keys} for h in got.history] == [{k: h[k] for k in keys} for h in ref.history]
    for c, rc in zip(clients, ref_clients):  # bit-identical: same seeds, same float order (FedAvg by client id)
        np.testing.assert_array_equal(c.labels_, rc.labels_)
        mapped = np.asarray(got.global_maps[c.cid])[c.labels_]
        np.testing.assert_array_equal(mapped, ref.global_labels[c.cid])
    assert got.gone == {}


def test_memory_broker_run_matches_in_process_and_rejects_hostile_messages(data, reference, caplog, server_transport):
    broker = MemoryBroker()
    clients = make_clients(data)
    edges, threads = start_edges(clients, lambda cid: MemoryTransport(broker, cid, federation=FED))
    evil = MemoryTransport(broker, "intruder", federation=FED)  # no ACL on the memory broker: it writes as c0
    server_t = server_transport(broker, federation=FED)

    def hostile(record):
        if record["iteration"] == 1:  # garbage bytes, then a well-formed but stale object, on c0's topics
            evil.publish_raw(server_t.topics.update("c0"), b"\x00garbage\xff" * 10)
            evil.publish_raw(server_t.topics.metrics("c0"), encode_message(Message(Kind.METRICS, FED, "c0", 1, {
                "type": "refined", "cid": "c0", "iteration": 1, "stability": 1.0, "n_clusters": 2, "selected": []})))
            # and at the device: garbage on its command topic, a "stop" that is not from the server
            evil.publish_raw(server_t.topics.cmd("c0"), b"\x00garbage\xff" * 10)
            evil.publish_raw(server_t.topics.cmd("c0"), encode_message(Message(Kind.CMD, FED, "intruder", 1,
                                                                               {"type": "stop"})))

    coordinator = FedCRefCoordinator(FedCRefServer(**SERVER_KW), server_t, min_clients=len(clients), timeout_s=60,
                                     callback=hostile)
    with caplog.at_level(logging.WARNING):
        got = coordinator.run()
    for th in threads:
        th.join(timeout=10)
    assert not any(th.is_alive() for th in threads)  # every edge got "stop"
    check_same_as_in_process(got, clients, reference)
    assert got.transport["rejected"] == {"magic": 1}
    assert "rejected (magic) from fedsketch/fedcref/clients/c0/update" in caplog.text
    assert got.rejected == {"stale": 1}
    assert "rejected (stale): refined from c0 for iteration 1 (current 2)" in caplog.text
    assert edges[0].transport.rejected == {"magic": 1}
    assert edges[0].errors_ == ["ignored CMD from 'intruder' on fedsketch/fedcref/clients/c0/cmd"]
    assert all(e.errors_ == [] for e in edges[1:])
    # community models went to members only, each naming that member alone; nothing on a shared topic
    assert not [t for t, _ in broker.log if "/clusters/" in t]
    community = [(t, decode_message(p)) for t, p in broker.log if t.endswith("/cmd") and p[:2] == b"FS"]
    community = [(t, m) for t, m in community if m.kind == Kind.MODEL and m.meta.get("type") == "community_model"]
    assert community and all(list(m.meta["members"]) == [t.split("/")[-2]] for t, m in community)
    # the community check: every community model to each member, naming only that member's own clusters
    checks = [(t, decode_message(p)) for t, p in broker.log if t.endswith("/cmd") and p[:2] == b"FS"]
    checks = [(t, m) for t, m in checks if m.kind == Kind.MODEL and m.meta.get("type") == "community_check"]
    assert checks and all(k.startswith(t.split("/")[-2] + ":") for t, m in checks
                          for keys in m.meta["members"].values() for k in keys)
    assert edges[0].handled_.get("community_check", 0) >= 1


@pytest.mark.broker
def test_real_broker_run_matches_in_process(data, reference, caplog, shipped_acl):
    """Mosquitto with the shipped ACL and per-client passwords when installed, else amqtt."""
    clients = make_clients(data)
    mosquitto = find_mosquitto() is not None
    passwords = {c.cid: f"pw-{c.cid}" for c in clients} | {"server": "pw-server"} if mosquitto else None
    broker = (MosquittoBroker(acl=shipped_acl(FED), passwords=passwords) if mosquitto
              else EmbeddedBroker())
    protocol = "5" if mosquitto else "3.1.1"

    def config(user):
        return BrokerConfig.from_url(broker.url, username=user if passwords else None,
                                     password=(passwords or {}).get(user), reconnect_min_s=0.1, protocol=protocol)

    with broker:
        edges, threads = start_edges(clients, lambda cid: MqttTransport(config(cid), cid, federation=FED))
        evil = MqttTransport(config("c0"), "c0-evil", federation=FED)  # c0's credentials, its own session
        evil.connect(timeout=10)
        server_t = MqttTransport(config("server"), "server", federation=FED)
        server_t.connect(timeout=10)

        def hostile(record):
            if record["iteration"] == 1:  # raw garbage where c0 may write (the ACL lets it through)
                evil._client.publish(server_t.topics.update("c0"), b"\x00garbage\xff" * 10, qos=1).wait_for_publish(5)

        try:
            with caplog.at_level(logging.WARNING):
                got = FedCRefCoordinator(FedCRefServer(**SERVER_KW), server_t, min_clients=len(clients),
                                         timeout_s=60, register_timeout_s=30, callback=hostile).run()
        finally:
            evil.close()
            server_t.close()
        for th in threads:
            th.join(timeout=15)
    check_same_as_in_process(got, clients, reference)
    assert got.transport["rejected"] == {"magic": 1}
    assert "rejected (magic) from fedsketch/fedcref/clients/c0/update" in caplog.text


def test_a_client_that_vanishes_is_logged_and_left_behind(data, caplog, server_transport):
    broker = MemoryBroker()
    clients = make_clients(data[:2], epochs=2)
    _, threads = start_edges(clients, lambda cid: MemoryTransport(broker, cid, federation=FED))
    ghost = MemoryTransport(broker, "c9", federation=FED)  # answers "register" with a hello, then nothing
    hello = {"type": "hello", "cid": "c9", "n_samples": 50, "n_features": 64, "n_clusters": 2,
             "architecture": clients[0].architecture, "init": "kmeans"}
    ghost.subscribe(ghost.topics.broadcast(), lambda topic, msg: ghost.publish(
        ghost.topics.hello("c9"), Message(Kind.HELLO, FED, "c9", 0, hello)))
    ghost.connect()
    # c8 says hello too, then its connection drops at its first command: the broker publishes its last will
    offline = Message(Kind.STATUS, FED, "c8", 0, {"state": "offline"})
    dying = MemoryTransport(broker, "c8", federation=FED, will_topic=ghost.topics.status("c8"), will_payload=offline)
    dying.subscribe(dying.topics.broadcast(), lambda topic, msg: dying.publish(
        dying.topics.hello("c8"), Message(Kind.HELLO, FED, "c8", 0, dict(hello, cid="c8"))))
    dying.subscribe(dying.topics.cmd("c8"), lambda topic, msg: dying.kill())
    dying.connect()
    server_t = server_transport(broker, federation=FED)
    with caplog.at_level(logging.WARNING):
        got = FedCRefCoordinator(FedCRefServer(theta=0.3, community_rounds=1, max_iterations=2), server_t,
                                 min_clients=4, timeout_s=4).run()
    for th in threads:
        th.join(timeout=10)
    assert got.clients == ["c0", "c1", "c8", "c9"]
    assert got.gone == {"c8": "offline in models, iteration 1", "c9": "models timeout, iteration 1"}
    assert "client c8 went offline (last will); treated as gone" in caplog.text
    assert "client c9 did not answer models within 4 s (iteration 1); treated as gone" in caplog.text
    assert got.iterations >= 1 and all(h["gone"] == ["c8", "c9"] for h in got.history)
    assert not any(n.startswith(("c8:", "c9:")) for comm in got.communities for n in comm)
    assert set(got.history[0]["stability"]) == {"c0", "c1"}  # the others went on and refined
    assert not any(th.is_alive() for th in threads)


def test_invalid_arguments_are_refused():
    t = MemoryTransport(MemoryBroker(), "server", federation=FED)
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds, got 0"):
        FedCRefCoordinator(FedCRefServer(), t, timeout_s=0)
    with pytest.raises(ValueError, match="min_clients must be an integer >= 1, got 0"):
        FedCRefCoordinator(FedCRefServer(), t, min_clients=0)
    x = np.random.default_rng(0).random((20, 64))
    with pytest.raises(ValueError, match="transport client_id 'c1' must be the client's id 'c0'"):
        FedCRefEdge(FedCRefClient("c0", x), MemoryTransport(MemoryBroker(), "c1", federation=FED))

