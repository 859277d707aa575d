"""FedSketch on a three-node NATS cluster (NATS speaks MQTT 3.1.1), and devices failing over across its nodes.

First every MQTT feature FedSketch uses, checked against NATS's MQTT with
the nodes of one cluster on either side: chunked messages above NATS's
``max_payload``, a last will, a persistent session's QoS 1 messages,
retained messages, ids NATS can and cannot carry in a topic, MQTT 5,
shared subscriptions. Then the shipped configuration (``deploy/nats/``) with
the users of ``deploy/nats/make_users.py``: the ACL's rights, a credentials
refusal. Then whole federations: 12 devices spread over the three nodes, and
the same with the node of a third of them killed in the middle of a round.

What the installed NATS does is asserted as it is, by version where NATS
changed it (``nats_server_version``): this machine has 2.9, so the tests
that rely on NATS's subscribe permissions over MQTT (the ACL tests) hold
for what is checked here only; a published advisory says that before NATS
2.12.12 and 2.14.3 retained messages and QoS 1 replays could reach an MQTT
subscriber past its subscribe-deny rules (``deploy/README.md``).
"""

from __future__ import annotations

import itertools
import logging
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from edge_sdk.protocol import Kind, Message, Topics, partition_of, tensors_body
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import (
    NatsCluster,
    ShippedNatsCluster,
    find_nats_server,
    free_ports,
    nats_server_version,
)
from server_kit.broker import nats as nats_module
from server_kit.partials import IngestWorkers

from helpers import ARCH, Collector, ari_against, prove_subscribed

pytestmark = [
    pytest.mark.broker,
    pytest.mark.alone,  # three JetStream nodes on a CPU shared with other tests delay messages past the deadlines
    pytest.mark.skipif(find_nats_server() is None, reason="nats-server is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "nats"
FED = "nats"
T = Topics("fedsketch", FED)
VERSION = nats_server_version() if find_nats_server() is not None else (0, 0, 0)
ids = itertools.count()


def fresh(prefix: str = "d") -> str:
    """A client id no other test of the module used (the cluster keeps every session)."""
    return f"{prefix}{next(ids)}"


@pytest.fixture(scope="module")
def cluster():
    """Three anonymous nodes; NATS's max_payload 64 KiB, so that chunking is cheap to show."""
    with NatsCluster(3, max_payload=65536) as c:
        yield c


@pytest.fixture
def connect():
    made: list[MqttTransport] = []

    def make(url: str, cid: str | None = None, *, subscribe=(), start: bool = True, **kw) -> MqttTransport:
        t = MqttTransport(BrokerConfig.from_url(url, reconnect_min_s=0.1, reconnect_max_s=1.0, **kw),
                          cid or fresh(), federation=FED)
        for topic_filter, handler in subscribe:
            t.subscribe(topic_filter, handler)
        if start:
            t.connect(timeout=10)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=1)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- the MQTT features FedSketch uses ---------------------------------------------------------


def test_chunked_message_above_nats_max_payload_crosses_nodes(cluster, connect):
    """A 300 kB update goes in 60 kB chunks from node 2 to a server on node 3, whole."""
    got = Collector()
    server = connect(cluster.urls_from(2), fresh("server"), subscribe=[(T.all_clients("update"), got)])
    cid = fresh()
    device = connect(cluster.urls_from(1), cid, max_payload=60_000)
    prove_subscribed(device, T.update(cid), got)
    body = tensors_body({"w": np.random.default_rng(0).normal(size=(75_000,)).astype(np.float32)})
    sent = device.publish(T.update(cid), Message(Kind.UPDATE, FED, cid, 1, {"n_samples": 3}, body), wait=True)
    assert got.wait(1, timeout=20)
    assert got.messages[0].body == body
    assert server.stats()["received"]["UPDATE"] == {"messages": 1, "bytes": sent, "chunks": 6}
    assert device.broker_url == cluster.urls[1] and server.broker_url == cluster.urls[2]


def test_what_nats_max_payload_means_for_an_mqtt_publish(cluster, connect):
    """NATS's max_payload bounds the NATS message an MQTT PUBLISH becomes (payload + 25 bytes of header),
    from NATS 2.14 on; before, an MQTT PUBLISH above it is routed all the same (here: 2.9)."""
    got = Collector()
    connect(cluster.urls_from(0), fresh("server"), subscribe=[(T.all_clients("update"), got)])
    cid = fresh()
    big = connect(cluster.urls_from(1), cid, max_payload=200_000)  # no chunking below 200 kB
    prove_subscribed(big, T.update(cid), got)
    msg = Message(Kind.UPDATE, FED, cid, 0, {}, bytes(100_000))  # above the cluster's 65,536
    big.publish(T.update(cid), msg, qos=0)
    if VERSION >= (2, 14, 0):
        assert wait_for(lambda: big.stats()["errors"].get("connection-lost", 0) >= 1, 10)
    else:
        assert got.wait(1, timeout=10) and got.messages == [msg]
        assert big.stats()["errors"].get("connection-lost", 0) == 0


def test_last_will_is_delivered_on_another_node(cluster, connect):
    status = Collector()
    server = connect(cluster.urls_from(0), fresh("server"), subscribe=[(T.all_clients("status"), status)])
    cid = fresh()
    offline = Message(Kind.STATUS, FED, cid, 0, {"state": "offline"})
    device = MqttTransport(BrokerConfig.from_url(cluster.urls_from(2), keepalive=5), cid, federation=FED,
                           will_topic=T.status(cid), will_payload=offline)
    device.connect()
    prove_subscribed(device, T.status(cid), status)  # the server hears the will when it comes
    device._client.loop_stop()  # a crash: no DISCONNECT packet...
    device._client.socket().close()  # ...and the socket just goes away
    assert status.wait(1, timeout=10)
    assert status.messages == [offline] and server.broker_url == cluster.urls[0]
    device._closing = True  # nothing left to close cleanly


def test_persistent_session_gets_its_qos1_messages_on_another_node(cluster, connect):
    """Commands sent (through node 3) while a device is away wait in JetStream; it gets them on node 2."""
    cid = fresh()
    first = Collector()
    device = connect(cluster.urls_from(0), cid, subscribe=[(T.cmd(cid), first)])
    server = connect(cluster.urls_from(2), fresh("server"))
    prove_subscribed(server, T.cmd(cid), first)  # the session holds the subscription when it closes
    device.close()
    for op in ("hello", "sketch", "train"):
        server.publish(T.cmd(cid), Message(Kind.CMD, FED, server.client_id, 0, {"op": op}), wait=True)
    again = Collector()
    back = connect(cluster.urls_from(1), cid, subscribe=[(T.cmd(cid), again)])
    assert again.wait(3, timeout=10)
    assert [m.meta["op"] for m in again.messages] == ["hello", "sketch", "train"]
    assert first.messages == [] and back.broker_url == cluster.urls[1]


def test_retained_messages_are_stored_and_refused_by_fedsketch(cluster, connect):
    """NATS has no switch that refuses retained messages (Mosquitto's retain_available false): it keeps a
    device's retained hello in JetStream and replays it to every later subscriber, which refuses it."""
    cid = fresh()
    connect(cluster.urls_from(0), fresh("server"))
    device = connect(cluster.urls_from(1), cid)
    device.publish(T.hello(cid), Message(Kind.HELLO, FED, cid, 0, {"n_samples": 10}), retain=True, wait=True)
    assert device.stats()["errors"].get("connection-lost", 0) == 0  # kept, where Mosquitto disconnects
    late = Collector()
    later = connect(cluster.urls_from(2), fresh("server"), subscribe=[(T.all_clients("hello"), late)])
    assert wait_for(lambda: later.rejected.get("retained", 0) == 1, 10)
    prove_subscribed(device, T.hello(cid), late)  # the replay comes before anything published later
    assert late.items == []
    # the server's status is the one topic FedSketch accepts a retained message on
    status = Collector()
    sid = fresh("server")
    owner = connect(cluster.urls_from(0), sid)
    owner.publish(T.server_status(), Message(Kind.STATUS, FED, "server", 0, {"state": "online", "probe": 0}),
                  retain=True, wait=True)
    connect(cluster.urls_from(1), subscribe=[(T.server_status(), status)])
    assert status.wait_probe(T.server_status(), 10)


def test_ids_nats_cannot_carry_in_a_topic(cluster, connect):
    """NATS 2.9 refuses an MQTT topic with a '.' (2.10 maps it to '//'): a device whose id holds one gets a
    failure SUBACK for its commands and is disconnected by its first message. Spaces cannot occur: an id
    holds none (FedSketch refuses it before any broker sees it)."""
    got = Collector()
    connect(cluster.urls_from(0), fresh("server"), subscribe=[(T.all_clients("status"), got)])
    cid = f"{fresh()}.lab"
    device = connect(cluster.urls_from(1), cid, subscribe=[(T.cmd(cid), Collector())])
    device.publish(T.status(cid), Message(Kind.STATUS, FED, cid, 0, {"state": "ok"}))
    if VERSION >= (2, 10, 0):
        assert got.wait(1, timeout=10) and got.topics() == [T.status(cid)]
    else:
        assert wait_for(lambda: device.stats()["errors"].get("connection-lost", 0) >= 1, 10)
        assert wait_for(lambda: device.stats()["errors"].get("subscribe", 0) >= 1, 10)
        assert got.items == []
    with pytest.raises(ValueError, match="client id 'c 1' contains forbidden characters"):
        T.status("c 1")


def test_a_star_id_is_a_nats_wildcard(cluster, connect):
    """NATS passes '*' through into the subject: the broker hands a device whose id is '*' everybody's
    commands. FedSketch's transport matches topics as MQTT does ('*' is a plain level), so no handler gets
    them, but the bytes reached the device: deploy/nats/make_users.py refuses such ids (and '>', '.')."""
    spy = Collector()
    star = connect(cluster.urls_from(1), "*", subscribe=[(T.cmd("*"), spy)])
    server = connect(cluster.urls_from(0), fresh("server"))
    prove_subscribed(server, T.cmd("*"), spy)
    server.publish(T.cmd(fresh()), Message(Kind.CMD, FED, "server", 0, {"op": "secret"}), wait=True)
    # counted as received (the probe before it was a STATUS), handed to nobody
    assert wait_for(lambda: star.stats()["received"].get("CMD", {}).get("messages") == 1, 10)
    assert spy.items == []


def test_mqtt5_is_refused_in_one_line(cluster, caplog):
    t = MqttTransport(BrokerConfig.from_url(cluster.urls_from(0), protocol="5"), fresh(), federation=FED)
    with caplog.at_level(logging.INFO, logger="edge_sdk.transport.mqtt"), pytest.raises(
            ConnectionError, match=re.escape(f"broker {cluster.urls[0]} refused {t.client_id}: Unsupported protocol "
                                             "version (it does not speak MQTT 5: use protocol 3.1.1)")):
        t.connect(timeout=5)
    t.close()
    assert [r.levelname for r in caplog.records] == ["ERROR"]


def test_shared_subscriptions_are_granted_and_get_nothing(cluster):
    """NATS's MQTT has no shared subscriptions: '$share/g/<filter>' is taken as a topic of its own, granted,
    and never matched (a plain subscription to the same filter gets the message). Checked with paho itself:
    FedSketch's single-server programs do not use them."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    port = cluster.nodes[0].mqtt_port
    clients, got, granted = [], {"share": [], "plain": []}, []
    for name, filt in (("share", "$share/g/fedsketch/nats/probe/#"), ("plain", "fedsketch/nats/probe/#")):
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=fresh(name), clean_session=True)
        c.on_message = lambda cl, u, m, name=name: got[name].append(m.topic)
        c.on_subscribe = lambda cl, u, mid, rcs, p: granted.extend(str(r) for r in rcs)
        c.connect("127.0.0.1", port)
        c.loop_start()
        c.subscribe(filt, 1)
        clients.append(c)
    try:
        assert wait_for(lambda: len(granted) == 2, 10) and granted == ["Granted QoS 1"] * 2
        pub = clients[1]
        assert wait_for(lambda: (pub.publish("fedsketch/nats/probe/x", b"m", qos=1), got["plain"])[1], 10)
        time.sleep(0.3)  # the same node routes both: anything for the shared one would be here by now
        assert got["share"] == []
    finally:
        for c in clients:
            c.disconnect()
            c.loop_stop()


# -- the shipped configuration and users (deploy/nats/) -----------------------------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """The shipped three-node configuration with the users of make_users.py for c1, c2 (and the server)."""
    out = tmp_path_factory.mktemp("users") / "fedsketch-users.conf"
    run = subprocess.run([sys.executable, str(DEPLOY / "make_users.py"), "--ids", "c1,c2", "--federation", FED,
                          "--out", str(out), "--cost", "4", "--plain"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    passwords = dict(line.split() for line in run.stdout.splitlines())
    assert sorted(passwords) == ["c1", "c2", "server"]
    with ShippedNatsCluster(out.read_text(), login=("server", passwords["server"])) as c:
        c.passwords = passwords
        yield c


@pytest.fixture
def login(secured):
    made: list[MqttTransport] = []

    def make(user: str, password: str | None = None, *, node: int = 0, subscribe=(), cid: str | None = None):
        pw = secured.passwords.get(user) if password is None else password
        cfg = BrokerConfig.from_url(secured.urls_from(node), username=user, password=pw, reconnect_min_s=0.1)
        t = MqttTransport(cfg, cid or user, federation=FED)
        made.append(t)
        for topic_filter, handler in subscribe:
            t.subscribe(topic_filter, handler)
        t.connect(timeout=10)
        return t

    yield make
    for t in made:
        t.close(timeout=1)


def msg(kind: Kind, sender: str, **meta) -> Message:
    return Message(kind, FED, sender, 0, meta)


def test_make_users_refuses_ids_nats_cannot_carry(tmp_path):
    for bad, why in [("a.b", "holds '.'"), ("*", "holds '*'"), ("a>", "holds '>'"), ("$x", "starts with '$'")]:
        run = subprocess.run([sys.executable, str(DEPLOY / "make_users.py"), "--ids", bad, "--out",
                              str(tmp_path / "u.conf"), "--plain"], capture_output=True, text=True, timeout=30)
        assert run.returncode == 1 and run.stdout == ""
        assert run.stderr.strip() == (f"device id {bad!r} {why}: NATS cannot carry it in an MQTT topic or a "
                                      "permission (use letters, digits, '-' and '_')")


def test_client_cannot_publish_under_another_client(login):
    """NATS drops a denied PUBLISH (and acknowledges it: MQTT 3.1.1 cannot say no), the connection stays."""
    seen = Collector(timeout=5.0)
    server = login("server", subscribe=[(T.all_clients("#"), seen)])
    c1 = login("c1", node=1)
    prove_subscribed(c1, T.status("c1"), seen)
    c1.publish(T.sketch("c2"), msg(Kind.SKETCH, "c2"), wait=True)
    c1.publish(T.cmd("c1"), msg(Kind.CMD, "c1", op="self"), wait=True)  # not even its own commands
    # positive control, the same publisher after the forbidden two, one NATS route between the nodes: in order
    c1.publish(T.sketch("c1"), msg(Kind.SKETCH, "c1"), wait=True)
    assert seen.wait(1)
    assert seen.topics() == [T.sketch("c1")] and server.rejected == {}
    assert c1.is_connected and c1.stats()["errors"].get("connection-lost", 0) == 0


def test_client_reads_only_its_commands_cluster_models_and_broadcasts(login):
    """Relies on NATS's subscribe permissions over MQTT (an allow list; NATS 2.9 here: see the module
    docstring for the advisory on subscribe-deny rules before 2.12.12 and 2.14.3). Unlike Mosquitto,
    NATS refuses a subscription it does not allow (a failure SUBACK) instead of granting it."""
    c1_got, c2_got = Collector(timeout=5.0), Collector(timeout=5.0)
    c1 = login("c1", node=1, subscribe=[(T.cmd("c1"), c1_got), (T.cmd("c2"), c1_got), (T.model("+"), c1_got),
                                        (T.broadcast(), c1_got), (T.server_status(), c1_got)])
    login("c2", node=2, subscribe=[(T.cmd("c2"), c2_got)])
    server = login("server")
    for topic, got in [(T.cmd("c1"), c1_got), (T.model("k0"), c1_got), (T.broadcast(), c1_got),
                       (T.server_status(), c1_got), (T.cmd("c2"), c2_got)]:
        prove_subscribed(server, topic, got)
    server.publish(T.cmd("c2"), msg(Kind.CMD, "server", op="secret"), wait=True)
    server.publish(T.cmd("c1"), msg(Kind.CMD, "server", op="sketch"), wait=True)
    server.publish(T.model("k0"), msg(Kind.MODEL, "server", key="k0"), wait=True)
    server.publish(T.broadcast(), msg(Kind.CMD, "server", op="hello"), wait=True)
    assert c1_got.wait(3) and c2_got.wait(1)
    assert c1_got.topics() == [T.cmd("c1"), T.model("k0"), T.broadcast()]
    assert c2_got.topics() == [T.cmd("c2")]
    assert c1.stats()["errors"]["subscribe"] == 1  # c2's commands: refused at SUBSCRIBE


def test_client_cannot_snoop_with_wildcards(login):
    c1 = login("c1", subscribe=[("fedsketch/#", Collector()), ("$MQTT/#", Collector())])
    assert wait_for(lambda: c1.stats()["errors"].get("subscribe", 0) == 2, 10)


def test_another_devices_client_id_gets_nothing_of_its_messages(login, secured):
    """NATS has no use_username_as_clientid: c1 may take c2's client id (and its session, disconnecting c2),
    but the session's subscriptions are checked against c1's own permissions, so c2's commands stay put."""
    c2_got = Collector(timeout=5.0)
    c2 = login("c2", node=1, subscribe=[(T.cmd("c2"), c2_got)])
    server = login("server")
    prove_subscribed(server, T.cmd("c2"), c2_got)
    c2.close()
    server.publish(T.cmd("c2"), msg(Kind.CMD, "server", op="for-c2"), wait=True)
    stolen = Collector(timeout=5.0)
    thief = login("c1", node=2, cid="c2", subscribe=[(T.cmd("c2"), stolen)])
    assert wait_for(lambda: thief.stats()["errors"].get("subscribe", 0) == 1, 10)
    time.sleep(0.5)
    assert stolen.items == []


@pytest.mark.parametrize(("user", "password"), [("c1", "wrong"), ("nobody", "pw"), ("server", "c1-pw")])
def test_bad_credentials_are_one_line(login, caplog, user, password):
    with caplog.at_level(logging.INFO, logger="edge_sdk.transport.mqtt"), pytest.raises(
            ConnectionError, match=rf"refused {user}: Not authorized$"):
        login(user, password, node=1)
    assert [r.levelname for r in caplog.records] == ["ERROR"]


# -- whole federations ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    pytest.importorskip("torch")
    from server_kit.data.partition import load_digits_images, rotation_partition

    images, labels = load_digits_images()
    return rotation_partition(images, labels, 12, groups=4, seed=0)


def run_federation(cluster, clients, *, rounds: int = 2, on_publish=None, subscribe_qos: int = 1):
    """``test_mqtt_e2e.run_federation`` over a cluster: client ``i`` on node ``i % 3`` (its list starts there),
    the server on node 1. ``on_publish(topic, msg)`` sees each of the server's messages after it went.
    ``subscribe_qos``: every subscription's QoS (0: plain NATS subscriptions, no JetStream consumer)."""
    from edge_sdk.client import EdgeClient
    from edge_sdk.tasks import TrainSettings
    from edge_sdk.worker import LocalWorker
    from server_kit.drivers import Orchestrator, ServerConfig
    from server_kit.strategies.fedsketch import SketchClustered

    fed = f"run{next(ids)}"  # each run its own federation: the cluster keeps sessions
    threads, edge = [], []
    for i, c in enumerate(clients):
        cfg = BrokerConfig.from_url(cluster.urls_from(i % cluster.n), reconnect_min_s=0.2, reconnect_max_s=2.0,
                                    subscribe_qos=subscribe_qos)
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        ec = EdgeClient(MqttTransport(cfg, c.cid, federation=fed), w, federation=fed, seed=i, model_timeout_s=60)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 90}, daemon=True)
        th.start()
        threads.append(th)
        edge.append(ec)
    server = MqttTransport(BrokerConfig.from_url(cluster.urls_from(0), reconnect_min_s=0.2, reconnect_max_s=2.0,
                                                 subscribe_qos=subscribe_qos), "server", federation=fed)
    server.connect(timeout=10)
    if on_publish is not None:
        publish = server.publish

        def watched(topic, msg, **kw):
            n = publish(topic, msg, **kw)
            on_publish(topic, msg)
            return n

        server.publish = watched
    try:
        settings = TrainSettings(epochs=3, lr=1e-2, batch_size=16)
        strategy = SketchClustered(settings=settings, min_cluster_size=3, seed=0)
        config = ServerConfig(federation=fed, rounds=rounds, min_clients=len(clients), register_timeout_s=30,
                              sketch_timeout_s=30, round_timeout_s=60, eval_timeout_s=60,
                              encoder="digits_encoder", architecture=ARCH, seed=0)
        result = Orchestrator(strategy, server, config).run()
    finally:
        server.close()
    for ec in edge:  # a device that missed the end of the run would idle 90 s: the run's outcome is in
        ec.stop()
    for th in threads:
        th.join(timeout=30)
    return SimpleNamespace(**result.to_dict(), server_errors=server.stats()["errors"],
                           edge_errors={e.transport.client_id: e.transport.stats()["errors"] for e in edge},
                           edge_brokers={e.transport.client_id: e.transport.broker_url for e in edge})


def check_accounted(result, clients, rounds: int) -> None:
    """Every device's update of every round accepted, or its fate recorded with a reason; the run finished."""
    cids = {c.cid for c in clients}
    assert ari_against({c.cid: c.group for c in clients}, result.assignment) == 1.0
    assert len(result.history) == rounds
    for h in result.history:
        accounted = h["reported"] + len(h["refused"]) + len(h["stragglers"]) + len(h["offline"])
        assert h["selected"] == len(clients) == accounted, h
        assert h["updates"] == h["reported"]
    final = result.final  # like a round's stragglers, a device whose model or command the cluster delayed past
    # the deadline is named (a loaded machine: NATS's JetStream fell behind); every cluster is still evaluated
    assert set(final["per_client"]) | set(final["unanswered"]) | set(result.dropped) == cids, (final, result.dropped)
    assert set(final["per_model"]) == {f"c{k}" for k in set(result.assignment.values())}, final


def test_federation_over_three_nats_nodes(digits, caplog):
    """12 devices, 4 on each node, the server on node 1, every subscription at QoS 0 (the layout a NATS cluster
    carries a fleet with: no JetStream consumer): the run ends with ARI 1.0, every update in. QoS 1 sessions over
    the cluster: the node-kill test below."""
    with NatsCluster(3, ack_wait_s=5) as cluster:
        urls = cluster.urls
        with caplog.at_level(logging.INFO, logger="edge_sdk.transport.mqtt"):
            result = run_federation(cluster, digits, subscribe_qos=0)
    check_accounted(result, digits, 2)
    assert [h["updates"] for h in result.history] == [12, 12]
    assert result.final["evaluated"] == 12 and result.final["accuracy"] > 0.5
    # each device came in through its own node (a node busy setting up sessions in JetStream may still drop a
    # connection now and then: NATS closes a client whose JetStream request timed out, and it fails over)
    first = {}
    for r in caplog.records:
        m = re.match(r"connected to (\S+) as (c\d+) ", r.getMessage())
        if m:
            first.setdefault(m.group(2), m.group(1))
    assert first == {c.cid: urls[i % 3] for i, c in enumerate(digits)}


def test_killing_the_node_of_a_third_of_the_devices_mid_round(digits, caplog):
    """SIGKILL of node 3 (devices 2, 5, 8, 11) as the server tasks round 2: those devices fail over to node 1,
    take their round-2 task from their session there, and every update of every round is accounted for."""
    victims = {c.cid for i, c in enumerate(digits) if i % 3 == 2}
    killed = {}

    with NatsCluster(3, ack_wait_s=3) as cluster:  # the round-2 task lost with the node comes again after 3 s
        urls = cluster.urls

        def kill_at_round_2(topic, msg):
            if not killed and msg.meta.get("op") == "train" and msg.round == 2:
                cluster.kill(2)
                killed["at"] = time.monotonic()

        with caplog.at_level(logging.INFO, logger="edge_sdk.transport.mqtt"):
            result = run_federation(cluster, digits, on_publish=kill_at_round_2)
        logs = cluster.log_text()
    assert killed, "round 2 never began"
    for h in result.history:  # reported, not asserted: how the round took the loss
        print(f"round {h['round']}: {h['reported']} reported, refused {h['refused']}, stragglers "
              f"{h['stragglers']}, offline {h['offline']}, closed by {h['close']}")
    print(f"server errors {result.server_errors}; rejected {result.rejected}")
    check_accounted(result, digits, 2)
    for cid in victims:
        assert result.edge_errors[cid].get("failover", 0) >= 1, (cid, result.edge_errors[cid])
        assert result.edge_brokers[cid] != urls[2]
        moved = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{cid}: lost")]
        assert f"{cid}: lost {urls[2]}; failing over to broker {urls[0]} (2 of 3)" in moved, moved
    refused = {c: r for h in result.history for c, r in h["refused"].items()}
    assert set(refused) <= victims and all(refused.values()), refused  # if any: with its reason
    assert result.final["evaluated"] + len(result.dropped) == 12, logs[-3000:]


def test_nats_server_is_the_one_on_path():
    """The version read is the binary the clusters run (a hint when a test above fails on another NATS)."""
    assert find_nats_server() in (shutil.which("nats-server"), "/usr/sbin/nats-server")
    assert VERSION >= (2, 9, 0)


def test_kill_and_restart_a_node(connect):
    """kill(i) is SIGKILL by PID; restart(i) brings the node back on its ports with its store, and it serves
    the sessions JetStream kept meanwhile."""
    with NatsCluster(3) as cluster:
        pid = cluster.nodes[1].pid
        cid = fresh()
        got = Collector()
        device = connect(cluster.urls_from(1), cid, subscribe=[(T.cmd(cid), got)])
        server = connect(cluster.urls_from(0), fresh("server"))
        prove_subscribed(server, T.cmd(cid), got)
        cluster.kill(1)
        assert not cluster.running and cluster.nodes[1].pid is None
        assert wait_for(lambda: device.is_connected and device.broker_url != cluster.urls[1], 30)
        device.close()
        server.publish(T.cmd(cid), Message(Kind.CMD, FED, "server", 0, {"op": "while-away"}), wait=True)
        assert cluster.restart(1) == cluster.urls[1]
        assert cluster.running and cluster.nodes[1].pid not in (None, pid)
        again = Collector()
        back = connect(cluster.urls_from(1), cid, subscribe=[(T.cmd(cid), again)])
        # a restarted node may serve a session before its replicated consumer is current: give it time
        assert again.wait(1, timeout=45) and again.messages[0].meta == {"op": "while-away"}
        assert back.broker_url == cluster.urls[1]


@pytest.mark.parametrize(("kw", "message"), [
    ({"nodes": 0}, "nodes must be a positive integer, got 0"),
    ({"max_payload": 0}, "max_payload must be a positive integer, got 0"),
    ({"ack_wait_s": 0}, "ack_wait_s must be a positive number of seconds, got 0"),
    ({"users": {"a": "pw"}, "permissions": {"b": {"publish": ["x"]}}}, "permissions name users without a password: "
                                                                        "['b']"),
    ({"users": {"a": "pw"}, "permissions": {"a": {"pub": ["x"]}}}, "permissions of 'a' may name 'publish' and "
                                                                   "'subscribe', got ['pub']"),
])
def test_nats_cluster_refuses_bad_settings(kw, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        NatsCluster(**kw)


def test_ingest_workers_take_their_partitions_whole_on_nats(cluster, connect):
    """No shared subscription needed: ingest worker p subscribes to partition p of the update topics, and a
    chunked update (above NATS's 64 KiB here) published on another node reaches it whole."""
    pool = IngestWorkers(2, BrokerConfig.from_url(cluster.urls_from(1), reconnect_min_s=0.1), FED)
    receipts = Collector(timeout=30)
    try:
        server = connect(cluster.urls[0], "server-ingest", start=False,
                         subscribe=[(T.aggregator("+", "receipt"), receipts)])
        server.accept_aggregators(pool.start())
        server.connect(timeout=10)
        model = {"w": np.zeros(40_000, np.float32)}  # 160 kB: every update goes in chunks
        server.publish(T.aggregation(), Message(Kind.COLLECT, FED, "server-ingest", 1,
                                                {"round": 1, "model_key": "c0"}, tensors_body(model)), wait=True)
        time.sleep(1.0)
        by_partition: dict[int, list[str]] = {0: [], 1: []}
        while min(map(len, by_partition.values())) < 2:
            cid = fresh("ing")
            by_partition[partition_of(cid, 2)].append(cid)
        cids = by_partition[0][:2] + by_partition[1][:2]
        for i, cid in enumerate(cids):
            d = connect(cluster.urls[i % 3], cid)
            d.publish(T.update(cid, partition_of(cid, 2)), Message(
                Kind.UPDATE, FED, cid, 1, {"round": 1, "model_key": "c0", "n_samples": 10, "metrics": {}},
                tensors_body({"w": np.full(40_000, i + 1, np.float32)})), wait=True)
        assert receipts.wait(4), receipts.messages
        got = {m.meta["client"]: (m.sender, m.meta.get("refused")) for m in receipts.messages}
        assert got == {cid: (f"ingest-{partition_of(cid, 2)}", None) for cid in cids}
    finally:
        pool.stop()


def test_free_ports_are_distinct():
    ports = free_ports(64)
    assert len(set(ports)) == 64


def test_a_port_taken_before_its_node_binds_it_is_chosen_again(monkeypatch, caplog):
    """Another process takes a chosen port before the node listens: the cluster chooses its ports again."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        real, asked = nats_module.free_ports, []

        def first_try_taken(n: int, host: str) -> list[int]:
            asked.append(n)
            ports = real(n, host)
            return [port, *ports[1:]] if len(asked) == 1 else ports

        monkeypatch.setattr(nats_module, "free_ports", first_try_taken)
        with caplog.at_level(logging.WARNING, logger=nats_module.__name__), NatsCluster(1) as c:
            assert c.running and c.nodes[0].client_port != port
    assert asked == [4, 4]
    assert "NATS cluster start 1 of 3:" in caplog.text and "choosing other ports" in caplog.text
