"""Transports: the in-memory twin, then real brokers (Mosquitto and amqtt) on free ports, then broker lists."""

from __future__ import annotations

import itertools
import logging
import re
import time

import numpy as np
import pytest

from edge_sdk.protocol import (
    Kind,
    Message,
    encode_message,
    parse_sketch,
    parse_tensors,
    sketch_body,
    tensors_body,
)
from edge_sdk.sketch import Sketch
from edge_sdk.transport import (
    BrokerConfig,
    MemoryBroker,
    MemoryTransport,
    MqttTransport,
    topic_matches,
)
from server_kit.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto, free_port

from helpers import Collector, prove_subscribed

FED = "demo"
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def sketch(seed: int = 0) -> Sketch:
    bits = np.random.default_rng(seed).integers(0, 2, 200, dtype=np.uint8)
    return Sketch(np.packbits(bits).tobytes(), 10, 20)


def sketch_msg(cid: str, seed: int = 0) -> Message:
    return Message(Kind.SKETCH, FED, cid, 0, {}, sketch_body(sketch(seed)))


# -- pure helpers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("filt", "topic", "expected"),
    [
        ("a/b", "a/b", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("a/#", "a/b/c", True),
        ("a/#", "a", True),
        ("#", "a/b", True),
        ("+/+", "a/b", True),
        ("+", "a/b", False),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a/x/d", False),
        ("fedsketch/demo/clients/+/sketch", "fedsketch/demo/clients/c1/sketch", True),
        ("#", "$SYS/broker", False),
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS/broker", True),
    ],
)
def test_topic_matches(filt, topic, expected):
    assert topic_matches(filt, topic) is expected


def test_broker_config_from_url():
    c = BrokerConfig.from_url("mqtts://broker.example.org", username="c07", password="s3cret", ca_certs="ca.crt")
    assert (c.host, c.port, c.tls) == ("broker.example.org", 8883, True)
    assert "s3cret" not in repr(c)
    c = BrokerConfig.from_url("mqtt://u1:pw@10.0.0.2:1884", protocol=5, username=None)
    assert (c.host, c.port, c.tls, c.username, c.password, c.protocol) == ("10.0.0.2", 1884, False, "u1", "pw", "5")
    assert c.url == "mqtt://10.0.0.2:1884"
    assert BrokerConfig().port == 1883


@pytest.mark.parametrize(
    ("url", "kw", "match"),
    [
        ("http://h:1883", {}, "url scheme must be 'mqtt' or 'mqtts', got 'http'"),
        ("mqtt://h:99999", {}, "port in url 'mqtt://h:99999' must be an integer"),
        ("mqtt://h:abc", {}, "port in url 'mqtt://h:abc' must be an integer"),
        ("mqtt://h:0", {}, "port in url 'mqtt://h:0' must be an integer"),
        ("mqtt://:1883", {}, "has no host"),
        ("mqtt://h/path", {}, "nothing after the port"),
        ("mqtt://h", {"protocol": "4"}, r"protocol must be one of \('3.1.1', '5'\), got '4'"),
        ("mqtt://h", {"ca_certs": "ca.crt"}, "need mqtts://"),
        ("mqtt://h", {"keepalive": 0}, "keepalive must be in"),
        ("mqtt://h", {"max_payload": 100}, "max_payload must be at least 1024"),
        ("mqtt://h", {"max_payload": 10_000, "max_message": 5000}, "max_message .* must be at least max_payload"),
        ("mqtt://h", {"reconnect_min_s": 5, "reconnect_max_s": 1}, "reconnect_min_s must be positive"),
        ("mqtt://h", {"password": "x"}, "password given without a username"),
    ],
)
def test_broker_config_rejects(url, kw, match):
    with pytest.raises(ValueError, match=match):
        BrokerConfig.from_url(url, **kw)


def test_broker_config_unknown_field():
    with pytest.raises(TypeError, match=r"unknown BrokerConfig fields \['hostname'\]"):
        BrokerConfig.from_url("mqtt://h", hostname="x")


def test_transport_refuses_bad_ids_and_topics():
    broker = MemoryBroker()
    with pytest.raises(ValueError, match="client_id 'c/1' contains forbidden characters"):
        MemoryTransport(broker, "c/1", federation=FED)
    t = MemoryTransport(broker, "c1", federation=FED)
    t.connect()
    with pytest.raises(ValueError, match="without wildcards"):
        t.publish("fedsketch/demo/clients/+/sketch", sketch_msg("c1"))
    with pytest.raises(ValueError, match="'#' must be a whole last level"):
        t.subscribe("a/#/b", Collector())


# -- in-memory twin -------------------------------------------------------------


@pytest.fixture
def memory(server_transport):
    broker = MemoryBroker()
    server = server_transport(broker, federation=FED)
    client = MemoryTransport(broker, "c1", federation=FED, max_payload=4096)
    return broker, server, client


def test_memory_pub_sub_and_stats(memory):
    broker, server, client = memory
    got = Collector()
    server.subscribe(server.topics.all_clients("sketch"), got)
    server.connect()
    client.connect()
    sent = client.publish(client.topics.sketch("c1"), sketch_msg("c1"))
    assert sent == 52  # 53 for a 3-character id such as "c07"
    assert got.wait(1, timeout=0)
    topic, msg = got.items[0]
    assert topic == "fedsketch/demo/clients/c1/sketch"
    assert parse_sketch(msg.body, num_classes=10, latent_dim=20) == sketch()
    assert client.stats()["sent"] == {"SKETCH": {"messages": 1, "bytes": 52, "chunks": 0}}
    assert server.stats()["received"] == {"SKETCH": {"messages": 1, "bytes": 52, "chunks": 0}}


def test_memory_rejections_are_counted_and_do_not_stop_delivery(memory):
    broker, server, client = memory
    got = Collector()
    server.subscribe(server.topics.all_clients("#"), got)
    server.connect()
    client.connect()
    t = client.topics.sketch("c1")
    client.publish(t, sketch_msg("c2"))  # claims to be c2 on c1's topic
    client.publish_raw(t, b"not an envelope")
    client.publish_raw(t, encode_message(sketch_msg("c1"))[:-1])
    client.publish_raw(t, encode_message(Message(Kind.SKETCH, "prod", "c1")))
    client.publish(t, sketch_msg("c1", seed=5))
    assert [m.sender for m in got.messages] == ["c1"]
    assert server.rejected == {"sender": 1, "magic": 1, "truncated": 1, "federation": 1}
    assert server.stats()["received"]["SKETCH"]["messages"] == 1


def test_memory_handler_errors_are_logged_and_counted(memory, caplog):
    broker, server, client = memory

    def boom(topic, msg):
        raise RuntimeError("handler bug")

    got = Collector()
    server.subscribe(server.topics.all_clients("sketch"), boom)
    server.subscribe(server.topics.all_clients("+"), got)
    server.connect()
    client.connect()
    client.publish(client.topics.sketch("c1"), sketch_msg("c1"))
    assert got.wait(1, timeout=0)
    assert server.stats()["errors"] == {"handler": 1}
    assert "handler bug" in caplog.text


def test_memory_chunking_round_trip(memory):
    broker, server, client = memory
    got = Collector()
    server.subscribe(server.topics.all_clients("update"), got)
    server.connect()
    client.connect()
    w = {"w": np.random.default_rng(0).normal(size=(100, 50)).astype(np.float32)}
    sent = client.publish(client.topics.update("c1"), Message(Kind.UPDATE, FED, "c1", 2, {"n": 3}, tensors_body(w)))
    frames = [p for t, p in broker.log if t == client.topics.update("c1")]
    assert len(frames) > 1 and all(len(f) + len(client.topics.update("c1")) + 16 <= 4096 for f in frames)
    assert sent == sum(map(len, frames))
    (msg,) = got.messages
    assert msg.kind == Kind.UPDATE and msg.round == 2 and msg.meta == {"n": 3}
    np.testing.assert_array_equal(parse_tensors(msg.body)["w"], w["w"])
    rec = server.stats()["received"]["UPDATE"]
    assert rec == {"messages": 1, "bytes": sent, "chunks": len(frames)}


def test_memory_retained_persistent_session_and_will(server_transport):
    broker = MemoryBroker()
    server = server_transport(broker, federation=FED)
    server.connect()
    model = Message(Kind.MODEL, FED, "server", 1, {"key": "k0"}, tensors_body({"w": np.ones(3, np.float32)}))
    server.publish(server.topics.model("k0"), model, retain=True)
    up = Message(Kind.STATUS, FED, "server", 0, {"state": "online"})
    server.publish(server.topics.server_status(), up, retain=True)
    offline = Message(Kind.STATUS, FED, "c1", 0, {"state": "offline"})
    c1 = MemoryTransport(broker, "c1", federation=FED, will_topic=server.topics.status("c1"), will_payload=offline)
    models, cmds, server_status = Collector(), Collector(), Collector()
    c1.subscribe(c1.topics.model("+"), models)
    c1.subscribe(c1.topics.cmd("c1"), cmds)
    c1.subscribe(c1.topics.server_status(), server_status)
    c1.connect()
    assert server_status.messages == [up]  # retained, delivered on subscribe
    # FedSketch retains nothing else: a retained model (or hello, or command) is somebody's replay
    assert models.messages == [] and c1.rejected == {"retained": 1}
    c1.close()
    server.publish(server.topics.cmd("c1"), Message(Kind.CMD, FED, "server", 0, {"op": "sketch"}))
    assert cmds.messages == []
    c1.connect()  # persistent session: the queued command arrives
    assert [m.meta["op"] for m in cmds.messages] == ["sketch"]
    status = Collector()
    server.subscribe(server.topics.all_clients("status"), status)
    c1.kill()
    assert status.messages == [offline]
    with pytest.raises(ConnectionError, match="c1 is not connected"):
        c1.publish(c1.topics.hello("c1"), Message(Kind.HELLO, FED, "c1"))


def test_memory_session_takeover(memory, caplog):
    broker, server, client = memory
    first, second = Collector(), Collector()
    client.subscribe(client.topics.cmd("c1"), first)
    client.connect()
    twin = MemoryTransport(broker, "c1", federation=FED)
    twin.subscribe(twin.topics.cmd("c1"), second)
    twin.connect()
    server.connect()
    server.publish(server.topics.cmd("c1"), Message(Kind.CMD, FED, "server", 0, {"op": "hello"}))
    assert (first.messages, len(second.messages)) == ([], 1)
    assert not client.is_connected and twin.is_connected
    assert "client id c1 connected again" in caplog.text


def test_memory_refuses_to_retain_a_chunked_message(memory):
    broker, server, client = memory
    client.connect()
    with pytest.raises(ValueError, match="cannot retain a .*-byte message: it needs"):
        client.publish(client.topics.status("c1"), Message(Kind.STATUS, FED, "c1", body=bytes(10_000)), retain=True)


# -- real brokers ------------------------------------------------------------------

ids = itertools.count()


def fast_config(url: str, **kw) -> BrokerConfig:
    return BrokerConfig.from_url(url, reconnect_min_s=0.1, reconnect_max_s=1.0, **kw)


@pytest.fixture(scope="module")
def mosquitto():
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed")
    with MosquittoBroker(message_size_limit=1_000_000, max_packet_size=1_000_000) as broker:
        yield broker


@pytest.fixture(scope="module")
def amqtt_broker():
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture(params=["mosquitto", "amqtt"])
def broker_url(request):
    return request.getfixturevalue("mosquitto" if request.param == "mosquitto" else "amqtt_broker").url


@pytest.fixture
def connect():
    made: list[MqttTransport] = []

    def make(url: str, cid: str | None = None, *, subscribe=(), start: bool = True, **kw) -> MqttTransport:
        t = MqttTransport(fast_config(url, **kw), cid or f"t{next(ids)}", federation=FED)
        for topic_filter, handler in subscribe:
            t.subscribe(topic_filter, handler)
        if start:
            t.connect(timeout=10)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close(timeout=1)


def server_and_client(connect, url: str, leaf: str, **kw):
    """A server subscribed to every client's ``leaf`` (proven live by a probe from the client) and a client."""
    got = Collector()
    cid = f"c{next(ids)}"
    server = connect(url, f"server{next(ids)}", **kw)
    server.subscribe(server.topics.all_clients(leaf), got)
    client = connect(url, cid, **kw)
    prove_subscribed(client, getattr(client.topics, leaf)(cid), got)
    return server, client, cid, got


@pytest.mark.broker
def test_sketch_over_broker(connect, broker_url):
    server, client, cid, got = server_and_client(connect, broker_url, "sketch")
    n = client.publish(client.topics.sketch(cid), sketch_msg(cid, 3), wait=True)
    assert n == len(encode_message(sketch_msg(cid, 3))) <= 64
    assert got.wait(1)
    topic, msg = got.items[0]
    assert topic == client.topics.sketch(cid) and msg.sender == cid
    assert parse_sketch(msg.body, num_classes=10, latent_dim=20) == sketch(3)
    assert client.stats()["sent"]["SKETCH"] == {"messages": 1, "bytes": n, "chunks": 0}
    assert server.stats()["received"]["SKETCH"] == {"messages": 1, "bytes": n, "chunks": 0}


@pytest.mark.broker
def test_5mb_tensors_cross_a_1mb_limit(connect, broker_url):
    server, client, cid, got = server_and_client(connect, broker_url, "update")
    w = {"conv": np.random.default_rng(1).normal(size=(1250, 1000)).astype(np.float32), "b": np.zeros(10, np.float32)}
    body = tensors_body(w)
    assert len(body) > 5_000_000
    sent = client.publish(client.topics.update(cid), Message(Kind.UPDATE, FED, cid, 4, {"n_samples": 9}, body), wait=True)
    assert got.wait(1, timeout=20)
    (msg,) = got.messages
    out = parse_tensors(msg.body, spec={"conv": ((1250, 1000), "float32"), "b": ((10,), "float32")})
    np.testing.assert_array_equal(out["conv"], w["conv"])
    stats = client.stats()["sent"]["UPDATE"]
    assert stats["chunks"] == 6 and stats["bytes"] == sent
    assert server.stats()["received"]["UPDATE"] == {"messages": 1, "bytes": sent, "chunks": 6}


@pytest.mark.broker
def test_sender_mismatch_is_rejected_then_good_message_delivered(connect, broker_url):
    server, client, cid, got = server_and_client(connect, broker_url, "sketch")
    client.publish(client.topics.sketch(cid), sketch_msg("someone-else"))
    client.publish(client.topics.sketch(cid), sketch_msg(cid, 8))
    # one publisher, one topic: the broker delivers in order, and the network thread validates (and counts
    # the refusal of) the first before the second reaches the handler; so the good one arriving is enough
    assert got.wait(1)
    assert [m.sender for m in got.messages] == [cid]
    assert server.rejected == {"sender": 1}


@pytest.mark.broker
@needs_mosquitto
def test_45mb_payload_crosses_a_1mb_broker(connect, mosquitto):
    server, client, cid, got = server_and_client(connect, mosquitto.url, "update")
    body = np.random.default_rng(2).integers(0, 256, 45_000_000, dtype=np.uint8).tobytes()
    t0 = time.monotonic()
    client.publish(client.topics.update(cid), Message(Kind.UPDATE, FED, cid, 1, {}, body), wait=True, timeout=60)
    assert got.wait(1, timeout=60)
    assert got.messages[0].body == body
    assert server.stats()["received"]["UPDATE"]["chunks"] == 46
    print(f"45 MB in 46 chunks through Mosquitto: {time.monotonic() - t0:.1f} s")  # reported, not asserted


@pytest.mark.broker
@needs_mosquitto
def test_unchunked_message_above_the_limit_never_arrives(connect, mosquitto):
    server, client, cid, got = server_and_client(connect, mosquitto.url, "update")
    big = connect(mosquitto.url, max_payload=3_000_000)  # no chunking below 3 MB
    big.publish(big.topics.update(big.client_id), Message(Kind.UPDATE, FED, big.client_id, 0, {}, bytes(2_000_000)),
                qos=0)
    # Mosquitto answers a packet above max_packet_size by closing the connection
    deadline = time.monotonic() + 10
    while not big.stats()["errors"].get("connection-lost") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert big.stats()["errors"].get("connection-lost", 0) >= 1
    # positive control: Mosquitto routes a message into each subscriber's queue (first in, first out) when it
    # reads it, so had it routed the big one, that happened before it closed big's connection (seen above),
    # hence before the client's marker below was even sent: the marker arriving alone proves nothing came
    marker = Message(Kind.UPDATE, FED, cid, 0, {}, b"marker")
    client.publish(client.topics.update(cid), marker, wait=True)
    assert got.wait(1)
    assert got.messages == [marker]
    assert server.rejected == {}


@pytest.mark.broker
@needs_mosquitto
@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
def test_persistent_session_gets_messages_sent_while_offline(connect, mosquitto, protocol):
    cid = f"c{next(ids)}"
    first = Collector()
    client = connect(mosquitto.url, cid, protocol=protocol)
    client.subscribe(client.topics.cmd(cid), first)
    server = connect(mosquitto.url, f"server{next(ids)}", protocol=protocol)
    prove_subscribed(server, client.topics.cmd(cid), first)  # the session holds the subscription when it closes
    client.close()
    for op in ("hello", "sketch", "train"):
        server.publish(server.topics.cmd(cid), Message(Kind.CMD, FED, server.client_id, 0, {"op": op}), wait=True)
    again = Collector()
    connect(mosquitto.url, cid, protocol=protocol, subscribe=[(client.topics.cmd(cid), again)])
    assert again.wait(3)
    assert [m.meta["op"] for m in again.messages] == ["hello", "sketch", "train"]
    assert first.messages == []


@pytest.mark.broker
@needs_mosquitto
def test_reconnect_after_broker_restart(connect):
    with MosquittoBroker(persistence=True) as broker:
        cid, offline_cid = f"c{next(ids)}", f"c{next(ids)}"
        got, later = Collector(), Collector()
        server = connect(broker.url, "server")
        client = connect(broker.url, cid)
        client.subscribe(client.topics.cmd(cid), got)
        away = connect(broker.url, offline_cid)
        away.subscribe(away.topics.cmd(offline_cid), later)
        prove_subscribed(server, client.topics.cmd(cid), got)  # both sessions hold their subscription
        prove_subscribed(server, away.topics.cmd(offline_cid), later)
        away.close()
        server.publish(server.topics.cmd(offline_cid), Message(Kind.CMD, FED, "server", 0, {"op": "queued"}), wait=True)

        broker.restart()
        deadline = time.monotonic() + 10
        while client.is_connected and time.monotonic() < deadline:
            time.sleep(0.02)  # the loss is noticed first...
        assert client.wait_connected(10) and server.wait_connected(10)  # ...then the back-off reconnects
        server.publish(server.topics.cmd(cid), Message(Kind.CMD, FED, "server", 1, {"op": "after"}), wait=True)
        assert got.wait(1)
        assert got.messages[0].meta == {"op": "after"}

        # the message queued for the offline client survived the restart (persistence)
        connect(broker.url, offline_cid, subscribe=[(away.topics.cmd(offline_cid), later)])
        assert later.wait(1)
        assert later.messages[0].meta == {"op": "queued"}


@pytest.mark.broker
@needs_mosquitto
def test_last_will_on_connection_loss(connect, mosquitto):
    status = Collector()
    cid = f"c{next(ids)}"
    server = connect(mosquitto.url, f"server{next(ids)}")
    server.subscribe(server.topics.all_clients("status"), status)
    offline = Message(Kind.STATUS, FED, cid, 0, {"state": "offline"})
    client = MqttTransport(fast_config(mosquitto.url, keepalive=5), cid, federation=FED,
                           will_topic=server.topics.status(cid), will_payload=offline)
    client.connect()
    prove_subscribed(client, server.topics.status(cid), status)  # the server hears the will when it comes
    client._client.loop_stop()  # simulate a crash: no DISCONNECT packet...
    client._client.socket().close()  # ...and the socket just goes away
    assert status.wait(1, timeout=5)
    assert status.messages == [offline]
    client._closing = True  # nothing left to close cleanly


@pytest.mark.broker
def test_connect_errors():
    port = free_port()
    t = MqttTransport(fast_config(f"mqtt://127.0.0.1:{port}"), "c1", federation=FED)
    with pytest.raises(ConnectionError, match=rf"no answer from broker mqtt://127.0.0.1:{port} within 0.5 s"):
        t.connect(timeout=0.5)
    t.close()


def test_paho_not_connected_is_no_error_while_the_transport_reconnects(caplog):
    """paho logs "Client is not connected" as an error on each loop pass while the connection is down;
    the transport says it reconnects, so that line is kept only when paho's logger is at DEBUG."""
    import edge_sdk.transport.paho_client as m

    paho = logging.getLogger(m._PAHO_LOGGER)
    with caplog.at_level(logging.INFO):
        paho.error("Client is not connected. Socket: None). Last known Connection State: MQTT_CS_CONNECTION_LOST")
        paho.error("Failed to publish")
    assert [r.getMessage() for r in caplog.records] == ["Failed to publish"]
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=m._PAHO_LOGGER):
        paho.error("Client is not connected. Socket: None).")
    assert [r.getMessage() for r in caplog.records] == ["Client is not connected. Socket: None)."]


def test_the_embedded_broker_starts_without_a_probe_connection(caplog):
    """Waiting for the listener binds the port instead of connecting: amqtt logs no 'No data' error."""
    from server_kit.broker import EmbeddedBroker

    pytest.importorskip("amqtt")
    with caplog.at_level(logging.INFO), EmbeddedBroker() as b:
        assert b.running
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- broker lists (a cluster's nodes) and failover ------------------------------


def test_broker_config_takes_a_list_of_brokers():
    c = BrokerConfig("mqtt://n1.example.org:1883, mqtt://10.0.0.2:1884,mqtt://n3.example.org")
    assert c.urls == ("mqtt://n1.example.org:1883", "mqtt://10.0.0.2:1884", "mqtt://n3.example.org")
    assert c.endpoints == (("n1.example.org", 1883), ("10.0.0.2", 1884), ("n3.example.org", 1883))
    assert (c.host, c.port, c.tls) == ("n1.example.org", 1883, False)  # the first broker's
    c = BrokerConfig.from_url("mqtts://c07:pw@a:8883,mqtts://c07:pw@b", ca_certs="ca.crt")
    assert (c.url, c.username, c.password, c.tls) == ("mqtts://a:8883,mqtts://b", "c07", "pw", True)
    assert c.endpoints == (("a", 8883), ("b", 8883))
    assert BrokerConfig("mqtt://h").urls == ("mqtt://h",) and BrokerConfig("mqtt://h").endpoints == (("h", 1883),)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("mqtt://a:1,", "url 'mqtt://a:1,' has an empty entry in its comma-separated list"),
        ("mqtt://a:1,,mqtt://b:2", "url 'mqtt://a:1,,mqtt://b:2' has an empty entry in its comma-separated list"),
        ("mqtt://a:1,mqtts://b:2", "url 'mqtt://a:1,mqtts://b:2' mixes mqtt:// and mqtts://: every broker of a "
                                   "list must use the same scheme (one set of TLS options serves them all)"),
        ("mqtt://a:1,mqtt://A:1", "url 'mqtt://a:1,mqtt://A:1' lists a:1 twice"),  # host names are case-blind
        ("mqtt://a,mqtt://a:1883", "url 'mqtt://a,mqtt://a:1883' lists a:1883 twice"),
        ("mqtt://a:1,http://b:2", "url scheme must be 'mqtt' or 'mqtts', got 'http' in 'http://b:2'"),
        ("mqtt://a:1,mqtt://b:0", "port in url 'mqtt://b:0' must be an integer in [1, 65535]"),
        ("mqtt://a:1,mqtt://b/x", "url 'mqtt://b/x' must be scheme://host:port with nothing after the port"),
        ("mqtt://a:1,mqtt://:2", "url 'mqtt://:2' has no host"),
    ],
)
def test_broker_config_rejects_bad_lists(url, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        BrokerConfig(url)


def test_broker_config_list_credentials():
    with pytest.raises(ValueError, match=re.escape("url 'mqtt://u:p@b:2' holds credentials: pass username and "
                                                   "password separately")):
        BrokerConfig("mqtt://a:1,mqtt://u:p@b:2")
    with pytest.raises(ValueError, match="^the urls of the list hold different credentials: give one username "
                                         "and password$"):
        BrokerConfig.from_url("mqtt://u:p@a:1,mqtt://v:p@b:2")
    c = BrokerConfig.from_url("mqtt://a:1,mqtt://u:p@b:2")  # one URL with them: they serve the whole list
    assert (c.url, c.username, c.password) == ("mqtt://a:1,mqtt://b:2", "u", "p")


@pytest.mark.broker
@needs_mosquitto
@pytest.mark.parametrize("with_loop", [False, True])
def test_a_dead_first_broker_is_passed_over(mosquitto, caplog, with_loop):
    """Nothing listens on the list's first address: the transport moves on to the second, says so once."""
    from edge_sdk.transport import NetworkLoop

    dead = f"mqtt://127.0.0.1:{free_port()}"
    loop = NetworkLoop() if with_loop else None
    t = MqttTransport(fast_config(f"{dead},{mosquitto.url}"), f"c{next(ids)}", federation=FED, loop=loop)
    try:
        with caplog.at_level(logging.INFO, logger="edge_sdk.transport.mqtt"):
            t.connect(timeout=10)
        assert t.broker_url == mosquitto.url and t.stats()["errors"]["failover"] == 1
        moves = [r.getMessage() for r in caplog.records if "failing over" in r.getMessage()]
        assert moves == [f"{t.client_id}: could not connect to {dead}; failing over to broker {mosquitto.url} "
                         "(2 of 2)"]
    finally:
        t.close(timeout=1)
        if loop is not None:
            loop.close()


def test_subscribe_qos_is_0_or_1_and_comes_from_the_command_line():
    import argparse

    for bad in (2, -1, True, "0"):
        with pytest.raises(ValueError, match=r"^subscribe_qos must be 0 or 1, got "):
            BrokerConfig(subscribe_qos=bad)
    p = argparse.ArgumentParser()
    BrokerConfig.add_arguments(p)
    assert BrokerConfig.from_args(p.parse_args([]), "mqtt://127.0.0.1:1883").subscribe_qos == 1
    assert BrokerConfig.from_args(p.parse_args(["--subscribe-qos", "0"]), "mqtt://127.0.0.1:1883").subscribe_qos == 0
    with pytest.raises(SystemExit):
        p.parse_args(["--subscribe-qos", "2"])
