"""Hundreds of real devices over Mosquitto with the shipped deploy settings (issue 13).

The devices are :class:`server_kit.emulate.EmulatedFleet`'s: real EdgeClients
and MQTT connections, on shared network loops in this process. The broker
runs ``deploy/mosquitto.conf`` as shipped (adapted to a free port, plain
listener), with the shipped ACL and a password per device.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from sklearn.metrics import adjusted_rand_score

from edge_sdk.protocol import Kind, Message, Topics
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.transport.netloop import NetworkLoop
from edge_sdk.worker import LocalWorker
from server_kit.broker import DEPLOY_CONF, MosquittoBroker, adapt_deploy_conf, find_mosquitto
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.emulate import EmulatedFleet, fleet_partition
from server_kit.strategies.fedsketch import SketchClustered

from helpers import Collector

FED = "fleet"
needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


def shipped_broker(shipped_acl, passwords, **kw) -> MosquittoBroker:
    return MosquittoBroker(deploy_conf=True, passwords={**passwords, "server": "server-pw"}, acl=shipped_acl(FED),
                           **kw)


def server_transport(url: str, **kw) -> MqttTransport:
    return MqttTransport(BrokerConfig.from_url(url, username="server", password="server-pw", **kw), "server",
                         federation=FED)


def test_the_adapted_deploy_config_keeps_every_limit(tmp_path):
    shipped = DEPLOY_CONF.read_text()
    conf = adapt_deploy_conf(shipped, port=18830, directory=tmp_path, password_file="/x/pw", acl_file="/x/acl")
    lines = [line for line in conf.splitlines() if line and not line.startswith("#")]
    assert [line for line in lines if line.startswith("listener")] == ["listener 18830 127.0.0.1"]
    for key in ("cafile", "certfile", "keyfile", "tls_version"):
        assert not any(line.startswith(key) for line in lines), key
    for key in ("max_queued_messages", "max_inflight_messages", "max_queued_bytes", "max_connections",
                "max_packet_size", "retain_available", "use_username_as_clientid", "persistence "):
        kept = [line for line in lines if line.startswith(key)]
        assert kept and kept == [line for line in shipped.splitlines() if line.startswith(key)], key
    assert int(next(line for line in lines if line.startswith("max_queued_messages")).split()[1]) >= 40_000
    assert "password_file /x/pw" in lines and "acl_file /x/acl" in lines and "allow_anonymous false" in lines


@needs_mosquitto
def test_300_devices_all_register_and_cluster_right(shipped_acl):
    clients = fleet_partition(300, min_samples=60, max_samples=100, groups=4, seed=1)
    passwords = {c.cid: f"pw-{c.cid}" for c in clients}
    with shipped_broker(shipped_acl, passwords) as broker:
        # connected is not subscribed: a device says hello once its subscriptions are sent, so its own hello
        # proves the broker holds them (MQTT keeps one client's packets in order) before the server's hello;
        # the server listens for them from before the first device connects
        server = server_transport(broker.url)
        server.connect()
        hellos = Collector(timeout=60)
        server.subscribe(Topics("fedsketch", FED).all_clients("hello"), hellos)
        fleet = EmulatedFleet(broker.url, clients, passwords=passwords, federation=FED, loops=2, seed=1)
        fleet.start()
        try:
            assert fleet.wait_connected(30)
            deadline = time.monotonic() + 60
            while len({m.sender for m in hellos.messages}) < 300 and time.monotonic() < deadline:
                hellos.wait(len(hellos.items) + 1, timeout=1.0)
            assert len({m.sender for m in hellos.messages}) == 300
            config = ServerConfig(federation=FED, rounds=1, min_clients=300, register_timeout_s=60,
                                  sketch_timeout_s=60, round_timeout_s=60, eval_timeout_s=60, seed=0,
                                  architecture="digits_cnn_1x8x8_10", encoder="digits_encoder")
            strategy = SketchClustered(settings=TrainSettings(epochs=1, lr=1e-2, batch_size=16), fraction=0.05,
                                       seed=0)
            t0 = time.monotonic()
            try:
                result = Orchestrator(strategy, server, config).run()
            finally:
                server.close()
            took = time.monotonic() - t0
            assert fleet.wait_done(30)
        finally:
            final = fleet.close()
        log = broker.log_text()
    assert len(result.assignment) == 300 and not result.dropped  # every device registered and stayed
    assert final["done"] == 300 and final["exit_codes"] == {"0": 300}  # and was told the run finished
    assert final["handled"]["hello"] == 300 and final["handled"]["sketch"] == 300
    assert "dropped" not in log.lower(), [line for line in log.splitlines() if "dropped" in line.lower()][:3]
    truth = [c.group for c in clients]
    assert adjusted_rand_score(truth, [result.assignment[c.cid] for c in clients]) == 1.0
    assert not result.rejected.get("inbox-full")
    # no phase ran into its deadline: all 300 registered and sketched (above), and the round closed when every
    # device tasked had answered, not at its deadline nor at its cap
    (rec,) = result.history
    assert (rec["close"], rec["updates"], rec["stragglers"]) == ("all-answered", rec["tasked"], [])
    print(f"300 devices: the run took {took:.1f} s, phases {result.timings}")  # reported, not asserted


def _burst(url: str, cids: list[str], passwords: dict[str, str], per_device: int) -> int:
    """Every device sends ``per_device`` hellos at once while the server is away; returns how many it gets back."""
    got: set[tuple[str, int]] = set()
    cv = threading.Condition()

    def seen(topic: str, msg: Message) -> None:
        with cv:
            got.add((msg.sender, msg.round))
            cv.notify_all()

    server = server_transport(url)
    server.subscribe(server.topics.all_clients("hello"), seen)
    server.connect()
    server.close()  # gone, its persistent session (QoS 1 subscription) stays on the broker
    hello = LocalWorker("x", [[[0.0] * 8] * 8] * 40, list(range(10)) * 4).hello()  # a hello's real size
    with NetworkLoop(workers=2) as loop:
        devices = [MqttTransport(BrokerConfig.from_url(url, username=cid, password=passwords[cid]), cid,
                                 federation=FED, loop=loop) for cid in cids]
        for t in devices:
            t.connect(wait=False)
        assert all(t.wait_connected(20) for t in devices)
        for r in range(per_device):
            for t in devices:
                t.publish(t.topics.hello(t.client_id), Message(Kind.HELLO, FED, t.client_id, r, hello))
        for t in devices:
            t.close(timeout=10)  # every message acknowledged by the broker
    server = server_transport(url)
    server.subscribe(server.topics.all_clients("hello"), seen)
    server.connect()  # the session resumes: what the broker kept comes now
    deadline, last = time.monotonic() + 20, -1
    with cv:  # until all came, or nothing more came for a second
        while len(got) < len(cids) * per_device and len(got) != last and time.monotonic() < deadline:
            last = len(got)
            cv.wait(1.0)
    time.sleep(0.3)  # anything late
    server.close()
    return len(got)


@needs_mosquitto
def test_a_burst_of_hellos_beyond_the_old_queue_limit_is_kept(shipped_acl):
    """1,200 hellos (300 devices x 4) wait for a server that is away: the shipped queue keeps them all.

    With the old ``max_queued_messages 1000`` the same burst loses some: the
    test is able to tell the two apart.
    """
    cids = [f"d{i:05d}" for i in range(300)]
    passwords = {cid: f"pw-{cid}" for cid in cids}
    with shipped_broker(shipped_acl, passwords) as broker:
        kept = _burst(broker.url, cids, passwords, 4)
        log = broker.log_text()
    assert kept == 1200
    assert "dropped" not in log.lower()
    with shipped_broker(shipped_acl, passwords, extra_conf="max_queued_messages 1000") as old:
        kept_old = _burst(old.url, cids, passwords, 4)
        log_old = old.log_text()
    assert kept_old < 1200, kept_old
    assert "Outgoing messages are being dropped for client server" in log_old


def test_fleet_partition_draws_30_to_60_digits_per_device_in_rotation_groups():
    clients = fleet_partition(40, seed=3)
    assert [c.group for c in clients[:5]] == [0, 1, 2, 3, 0]
    assert all(30 <= len(c.y_train) <= 60 and len(c.y_test) >= 1 for c in clients)
    assert clients[0].cid == "d00000" and clients[0].x_train.dtype.name == "float32"
    with pytest.raises(ValueError, match=r"groups must be between 1 and 4 rotations, got 5"):
        fleet_partition(4, groups=5)


def test_an_emulated_fleet_refuses_unknown_settings():
    with pytest.raises(TypeError, match=r"unknown settings \['loop'\]"):
        EmulatedFleet("mqtt://127.0.0.1:1", fleet_partition(1), loop=3)


def test_deploy_files_exist():
    deploy = Path(DEPLOY_CONF).parent
    assert "LimitNOFILE=65536" in (deploy / "mosquitto.service.d" / "limits.conf").read_text()
    sysctl = (deploy / "sysctl.d" / "90-fedsketch-fleet.conf").read_text()
    for key in ("net.core.somaxconn", "net.ipv4.tcp_max_syn_backlog", "net.ipv4.ip_local_port_range", "fs.file-max"):
        assert f"\n{key} = " in sysctl, key
