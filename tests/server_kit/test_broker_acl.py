"""The shipped broker security (deploy/acl, deploy/mosquitto.conf) on a real Mosquitto."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from edge_sdk.protocol import Kind, Message, Topics
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import MosquittoBroker, find_mosquitto, free_ports

from helpers import Collector, prove_subscribed

pytestmark = [
    pytest.mark.broker,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed"),
]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
FED = "demo"
PASSWORDS = {"server": "server-pw", "c1": "c1-pw", "c2": "c2-pw"}
T = Topics("fedsketch", FED)


@pytest.fixture(scope="module")
def broker(shipped_acl):
    with MosquittoBroker(acl=shipped_acl(FED), passwords=PASSWORDS) as b:
        yield b


@pytest.fixture
def login(broker):
    made: list[MqttTransport] = []

    def make(user: str, password: str | None = None, *, subscribe=(), url: str | None = None,
             **kw) -> MqttTransport:
        pw = PASSWORDS.get(user) if password is None else password
        cfg = BrokerConfig.from_url(url or broker.url, username=user, password=pw, reconnect_min_s=0.1, **kw)
        t = MqttTransport(cfg, user, federation=FED)
        made.append(t)
        for topic_filter, handler in subscribe:
            t.subscribe(topic_filter, handler)
        t.connect(timeout=5)
        return t

    yield make
    for t in made:
        t.close(timeout=1)


def msg(kind: Kind, sender: str, **meta) -> Message:
    return Message(kind, FED, sender, 0, meta)


def test_client_cannot_publish_under_another_client(login):
    seen = Collector(timeout=5.0)
    server = login("server", subscribe=[(T.all_clients("#"), seen)])
    c1 = login("c1")
    prove_subscribed(c1, T.status("c1"), seen)
    # c1 speaks as c2 on c2's topics: the message passes our own sender check, only the ACL stops it
    c1.publish(T.sketch("c2"), msg(Kind.SKETCH, "c2"), wait=True)
    c1.publish(T.status("c2"), msg(Kind.STATUS, "c2", state="offline"), wait=True)
    # positive control, from the same publisher after the forbidden two: Mosquitto routes one client's
    # messages in the order it reads them into each subscriber's one FIFO queue, so anything of the two
    # that got through would arrive before this one
    c1.publish(T.sketch("c1"), msg(Kind.SKETCH, "c1"), wait=True)
    assert seen.wait(1)
    assert seen.topics() == [T.sketch("c1")]
    assert server.rejected == {}


def test_client_reads_only_its_commands_cluster_models_and_broadcasts(login):
    c1_got, c2_got = Collector(timeout=5.0), Collector(timeout=5.0)
    c1 = login("c1", subscribe=[(T.cmd("c1"), c1_got), (T.cmd("c2"), c1_got), (T.model("+"), c1_got),
                                (T.broadcast(), c1_got), (T.server_status(), c1_got)])
    login("c2", subscribe=[(T.cmd("c2"), c2_got)])
    server = login("server")
    for topic, got in [(T.cmd("c1"), c1_got), (T.model("k0"), c1_got), (T.broadcast(), c1_got),
                       (T.server_status(), c1_got), (T.cmd("c2"), c2_got)]:
        prove_subscribed(server, topic, got)  # the server's status (its run announcements) included
    # the forbidden one first: one publisher's messages reach each subscriber in order (Mosquitto routes them
    # as it reads them into the subscriber's one FIFO queue), so c1 would have it before the three it may read
    server.publish(T.cmd("c2"), msg(Kind.CMD, "server", op="secret"), wait=True)
    server.publish(T.cmd("c1"), msg(Kind.CMD, "server", op="sketch"), wait=True)
    server.publish(T.model("k0"), msg(Kind.MODEL, "server", key="k0"), wait=True)
    server.publish(T.broadcast(), msg(Kind.CMD, "server", op="hello"), wait=True)
    assert c1_got.wait(3) and c2_got.wait(1)
    assert c1_got.topics() == [T.cmd("c1"), T.model("k0"), T.broadcast()]
    assert c2_got.topics() == [T.cmd("c2")]
    # Mosquitto 2.0 grants the subscription to c2's commands and filters every delivery by the ACL
    assert c1.stats()["errors"].get("subscribe", 0) <= 1


def test_client_cannot_snoop_with_wildcards(login):
    snoop, seen = Collector(timeout=5.0), Collector(timeout=5.0)
    login("c1", subscribe=[("fedsketch/#", snoop)])
    server = login("server", subscribe=[(T.all_clients("update"), seen)])
    c2 = login("c2")
    prove_subscribed(server, T.broadcast(), snoop)  # c1's wildcard subscription is live (it may read this)
    prove_subscribed(c2, T.update("c2"), seen)
    c2.publish(T.update("c2"), msg(Kind.UPDATE, "c2"), wait=True)
    assert seen.wait(1)
    # positive control: c2 may write nothing c1 may read, so the marker comes from the server, sent after
    # c2's update was acknowledged. Mosquitto routes (and filters by the ACL) a QoS 1 message into each
    # subscriber's one FIFO queue before it sends the PUBACK; had the update been let through to c1, it
    # would sit in c1's queue ahead of the marker
    server.publish(T.broadcast(), msg(Kind.CMD, "server", op="marker"), wait=True)
    assert snoop.wait(1)
    assert snoop.topics() == [T.broadcast()]


@pytest.mark.parametrize(("user", "password"), [("c1", "wrong"), ("nobody", "pw"), ("server", "c1-pw")])
def test_bad_credentials_are_refused(login, user, password):
    with pytest.raises(ConnectionError, match=rf"refused {user}: Not authorized"):
        login(user, password)


def test_anonymous_clients_are_refused(broker):
    t = MqttTransport(BrokerConfig(broker.url), "anon", federation=FED)
    with pytest.raises(ConnectionError, match="refused anon: Not authorized"):
        t.connect(timeout=5)
    t.close()


# -- the production configuration, with TLS ------------------------------------------


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def production_broker(tmp_path_factory, shipped_acl):
    """deploy/mosquitto.conf with its paths and ports pointed at a temporary folder."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    d = tmp_path_factory.mktemp("prod")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", "-new", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.crt",
             "-subj", "/CN=FedSketch test CA", cwd=d)
    _openssl("req", "-new", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-sha256", "-extfile", "server.ext", "-out", "server.crt", cwd=d)
    plain, tls = free_ports(2)
    conf = (DEPLOY / "mosquitto.conf").read_text()
    for pattern, repl in [
        (r"^listener 1883 127\.0\.0\.1$", f"listener {plain} 127.0.0.1"),
        (r"^listener 8883$", f"listener {tls} 127.0.0.1"),
        (r"/etc/mosquitto/certs/", f"{d}/"),
        (r"/etc/mosquitto/fedsketch\.passwd", f"{d}/passwd"),
        (r"/etc/mosquitto/fedsketch\.acl", str(d / "acl")),
        (r"^persistence_location .*$", f"persistence_location {d}/"),
        (r"^log_dest syslog$", f"log_dest file {d}/mosquitto.log"),
    ]:
        conf, n = re.subn(pattern, repl, conf, flags=re.M)
        assert n >= 1, f"deploy/mosquitto.conf no longer has {pattern!r}"
    if os.geteuid() == 0:
        conf += "user root\n"
    (d / "acl").write_text(shipped_acl(FED))
    (d / "mosquitto.conf").write_text(conf)
    (d / "passwd").write_text("".join(f"{u}:{p}\n" for u, p in PASSWORDS.items()))
    subprocess.run(["mosquitto_passwd", "-U", str(d / "passwd")], check=True, capture_output=True, timeout=30)
    proc = subprocess.Popen([find_mosquitto(), "-c", str(d / "mosquitto.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", tls), timeout=0.2).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"deploy/mosquitto.conf did not start: {proc.stderr.read().decode()}"
                            f"{(d / 'mosquitto.log').read_text() if (d / 'mosquitto.log').exists() else ''}")
            time.sleep(0.05)
    yield {"plain": f"mqtt://127.0.0.1:{plain}", "tls": f"mqtts://localhost:{tls}", "ca": str(d / "ca.crt")}
    proc.terminate()
    proc.wait(10)
    proc.stderr.close()


def test_production_config_over_tls(login, production_broker):
    seen = Collector(timeout=5.0)
    login("server", url=production_broker["plain"], subscribe=[(T.all_clients("hello"), seen)])
    c1 = login("c1", url=production_broker["tls"], ca_certs=production_broker["ca"])
    prove_subscribed(c1, T.hello("c1"), seen)
    c1.publish(T.hello("c2"), msg(Kind.HELLO, "c2", n_samples=10), wait=True)  # dropped by the ACL
    # positive control, the same publisher after the forbidden one: delivered in order, had it passed,
    # the forbidden hello would arrive first
    c1.publish(T.hello("c1"), msg(Kind.HELLO, "c1", n_samples=10), wait=True)
    assert seen.wait(1)
    assert seen.topics() == [T.hello("c1")]
    with pytest.raises(ConnectionError, match="refused c2: Not authorized"):
        login("c2", "wrong", url=production_broker["tls"], ca_certs=production_broker["ca"])


def test_production_config_refuses_retained_messages(login, production_broker):
    """retain_available false: a device that tries to retain a message is disconnected, nothing is stored."""
    seen = Collector(timeout=5.0)
    server = login("server", url=production_broker["plain"], subscribe=[(T.all_clients("hello"), seen)])
    c1 = login("c1", url=production_broker["tls"], ca_certs=production_broker["ca"])
    c2 = login("c2", url=production_broker["tls"], ca_certs=production_broker["ca"])
    prove_subscribed(c2, T.hello("c2"), seen)
    c1.publish(T.hello("c1"), msg(Kind.HELLO, "c1", n_samples=10), retain=True)
    deadline = time.monotonic() + 5
    while not c1.stats()["errors"].get("connection-lost") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c1.stats()["errors"]["connection-lost"] >= 1
    # positive control: c1 keeps resending its retained hello (and is cut off again), so the marker comes
    # from c2, sent after the broker closed c1's connection (seen above). Mosquitto deals with a PUBLISH
    # when it reads it (routes it into each subscriber's FIFO queue, or refuses it and closes the
    # connection): had it passed the hello on, that was before the close, and the server would get it
    # ahead of the marker
    c2.publish(T.hello("c2"), msg(Kind.HELLO, "c2", n_samples=10), wait=True)
    assert seen.wait(1)
    assert seen.topics() == [T.hello("c2")] and server.rejected == {}
    server.close()  # the later server takes the same client id
    late = Collector(timeout=5.0)  # a server started later finds nothing retained
    later = login("server", url=production_broker["plain"], subscribe=[(T.all_clients("hello"), late)])
    # a retained message comes right after the SUBACK, before anything published later (the probe), and
    # the transport refuses it on a client topic (reason "retained") instead of handing it over
    prove_subscribed(c2, T.hello("c2"), late)
    assert late.items == [] and later.rejected == {}
