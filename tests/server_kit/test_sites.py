"""Site brokers bridged to a core broker, with a site aggregator: real Mosquittos and a real ``fedsketch-aggregator``.

A core Mosquitto and two site Mosquittos bridged to it exactly as ``deploy/site-broker.conf`` says (its bridge
section, on free ports, plain TCP). Site A runs ``fedsketch-aggregator`` (its bridge carries no updates), site B
none (its bridge carries the updates). The server on the core takes site A's receipts and partial sums and site
B's updates, and gets the models of a flat run (every device on the core). Then a site broker killed mid-round,
and hostile aggregator messages against :class:`~server_kit.drivers.remote.RemoteRound` over a real broker.
"""

from __future__ import annotations

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
from edge_sdk.compress import Compression
from edge_sdk.compress.update_codec import update_codec
from edge_sdk.protocol import Kind, Message, Topics, tensors_body
from edge_sdk.signing import load_signer, load_verifier, write_keypair
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.downstream import ModelVersions
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.drivers.link import ServerLink
from server_kit.drivers.remote import RemoteRound
from server_kit.partials.scale_out import load_aggregator_keys
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, assert_same_models

pytestmark = [pytest.mark.broker,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]

FED = "sites"
SETTINGS = TrainSettings(epochs=2, lr=1e-2, batch_size=16)
MAX_PAYLOAD = 64_000
ROOT = Path(__file__).resolve().parents[2]
SITE_CONF = ROOT / "deploy" / "site-broker.conf"
#: Lines of the shipped bridge section a plain-TCP test bridge leaves out (TLS, the core's credentials).
_DROPPED = ("bridge_cafile", "bridge_tls_version", "bridge_insecure", "remote_username", "remote_password")


def bridge_conf(core_port: int, site: str, *, updates: bool) -> str:
    """deploy/site-broker.conf's bridge section (from ``connection`` on) for ``site``, to the core on ``core_port``."""
    text = SITE_CONF.read_text()
    section = text[text.index("\nconnection ") + 1:]
    out = []
    for line in section.splitlines():
        word = line.split(" ", 1)[0]
        if word in _DROPPED:
            continue
        if word == "address":
            line = f"address 127.0.0.1:{core_port}"
        if updates and line.startswith("#topic ") and "/update " in line:
            line = line[1:]
        out.append(line.replace("fedsketch/default/", f"fedsketch/{FED}/").replace("bridge-site-a", f"bridge-{site}"))
    conf = "\n".join(out)
    assert f"topic fedsketch/{FED}/aggregators/# out 1" in conf and "cleansession false" in conf
    assert (f"\ntopic fedsketch/{FED}/clients/+/update out 1" in conf) == updates
    return conf


def _wait_log(broker: MosquittoBroker, needle: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while needle not in broker.log_text():
        if time.monotonic() > deadline:
            raise AssertionError(f"{needle!r} not in the log of {broker}:\n{broker.log_text()[-3000:]}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 8, groups=2, seed=0)


@pytest.fixture(scope="module")
def site_key(tmp_path_factory):
    d = tmp_path_factory.mktemp("site-keys")
    write_keypair(d / "site-a.key", d / "site-a.pub")
    return d / "site-a.key", d / "site-a.pub"


class Sites:
    """A core broker, site A (with an aggregator subprocess) and site B (without), bridged as shipped."""

    def __init__(self, key: Path) -> None:
        self.key = key
        self.core = MosquittoBroker()
        self.site_a = self.site_b = None
        self.agg: subprocess.Popen | None = None

    def __enter__(self) -> Sites:
        self.core.start()
        self.site_a = MosquittoBroker(extra_conf=bridge_conf(self.core.port, "site-a", updates=False))
        self.site_b = MosquittoBroker(extra_conf=bridge_conf(self.core.port, "site-b", updates=True))
        self.site_a.start()
        self.site_b.start()
        _wait_log(self.core, "as bridge-site-a")
        _wait_log(self.core, "as bridge-site-b")
        self.agg = subprocess.Popen(
            [sys.executable, "-m", "server_kit.partials.cli", "--broker", self.site_a.url, "--id", "site-a",
             "--key", str(self.key), "--federation", FED],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_log(self.site_a, " as site-a ")
        time.sleep(0.5)  # its SUBSCRIBE follows the CONNACK
        return self

    def __exit__(self, *exc: object) -> None:
        if self.agg is not None:
            if self.agg.poll() is None:
                self.agg.send_signal(signal.SIGTERM)
                try:
                    self.agg.wait(10)
                except subprocess.TimeoutExpired:
                    self.agg.kill()
                    self.agg.wait(10)
            self.agg.stderr.close()
        for b in (self.site_a, self.site_b, self.core):
            if b is not None:
                b.cleanup()


def federate(urls, clients, *, verifier=None, rounds=2, round_timeout_s=60, first_round_timeout_s=None, during=None,
             compression=None):
    """One run: each device on ``urls[cid]``, the server on ``urls["core"]``; site A accepted when ``verifier``."""
    core = urls["core"]
    edge, threads, transports = [], [], []
    for i, c in enumerate(clients):
        cfg = BrokerConfig.from_url(urls[c.cid], reconnect_min_s=0.1, max_payload=MAX_PAYLOAD)
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        t = MqttTransport(cfg, c.cid, federation=FED)
        ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=30)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 90}, daemon=True)
        th.start()
        threads.append(th)
        edge.append(ec)
        transports.append(t)
    server = MqttTransport(BrokerConfig.from_url(core, max_payload=MAX_PAYLOAD), "server", federation=FED)
    server.connect(timeout=10)
    updates_from: list[tuple[int, str]] = []
    server.subscribe(server.topics.all_clients("update"), lambda topic, msg: updates_from.append((msg.round,
                                                                                                   msg.sender)))
    kw = {"aggregators": {"site-a": verifier}} if verifier is not None else {}
    strategy = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0, compression=compression)
    config = ServerConfig(federation=FED, rounds=rounds, min_clients=len(clients), register_timeout_s=30,
                          sketch_timeout_s=30, round_timeout_s=round_timeout_s,
                          first_round_timeout_s=first_round_timeout_s or round_timeout_s,
                          eval_timeout_s=30, encoder="digits_encoder", architecture=ARCH, seed=0,
                          partial_timeout_s=20)
    orch = Orchestrator(strategy, server, config, **kw)
    if during is not None:
        during(orch)
    try:
        result = orch.run()
    finally:
        server.close()
    for th in threads:
        th.join(timeout=30)
    return SimpleNamespace(result=result, strategy=strategy, updates_from=updates_from,
                           sent={c.cid: t.stats()["sent"] for c, t in zip(clients, transports)})


@pytest.fixture(scope="module")
def flat(digits):
    pytest.importorskip("torch")
    with MosquittoBroker() as broker:
        return federate({"core": broker.url, **{c.cid: broker.url for c in digits}}, digits)


def _site_urls(sites, digits):
    a = {c.cid for c in digits[:4]}
    return a, {"core": sites.core.url, **{c.cid: (sites.site_a.url if c.cid in a else sites.site_b.url)
                                          for c in digits}}


def test_two_sites_one_aggregator_give_the_models_of_a_flat_run(digits, flat, site_key):
    key, pub = site_key
    with Sites(key) as sites:
        site_a, urls = _site_urls(sites, digits)
        run = federate(urls, digits, verifier=load_verifier(pub))
        assert sites.agg.poll() is None, sites.agg.stderr.read().decode(errors="replace")
    result = run.result
    truth = [c.group for c in digits]
    assert adjusted_rand_score(truth, [result.assignment[c.cid] for c in digits]) == 1.0
    assert result.assignment == flat.result.assignment
    assert [h["updates"] for h in result.history] == [len(digits)] * 2
    assert [h["summary"]["summed_remote"] for h in result.history] == [4, 4]
    # the server got updates only from site B's devices, each round; site A's came as receipts and partial sums
    site_b = {c.cid for c in digits} - site_a
    for rnd in (1, 2):
        assert sorted(s for r, s in run.updates_from if r == rnd) == sorted(site_b)
    received = result.transport["received"]
    assert received["UPDATE"]["messages"] == 4 * 2
    assert received["RECEIPT"]["messages"] == 4 * 2
    clusters_a = len({result.assignment[c] for c in site_a})
    assert received["PARTIAL"]["messages"] == 2 * clusters_a
    assert_same_models(flat.strategy, run.strategy)
    assert result.final["accuracy"] == pytest.approx(flat.result.final["accuracy"], abs=0.02)
    # what site A's devices published vs what crossed its bridge to the core in their place
    published = sum(run.sent[c]["UPDATE"]["bytes"] for c in site_a)
    crossed = received["RECEIPT"]["bytes"] + received["PARTIAL"]["bytes"]
    assert published / crossed > 1.5, (published, crossed)


def test_a_site_sums_compressed_rounds_from_the_first(digits, site_key):
    """With int8 compression, round 1's COLLECT names the models' first version: site A's aggregator sums its
    devices' updates of every round, none refused."""
    key, pub = site_key
    with Sites(key) as sites:
        _, urls = _site_urls(sites, digits)
        run = federate(urls, digits, verifier=load_verifier(pub), compression="int8")
    history = run.result.history
    assert [h["updates"] for h in history] == [len(digits)] * 2
    assert [h["summary"]["summed_remote"] for h in history] == [4, 4]
    assert [h["refused"] for h in history] == [{}, {}]


def test_the_servers_own_key_in_the_folder_is_no_aggregator(tmp_path, caplog):
    """``fedsketch keygen keys`` and ``--name site-a`` in one folder: ``--aggregator-keys keys/`` takes site-a only."""
    write_keypair(tmp_path / "server.key", tmp_path / "server.pub")
    write_keypair(tmp_path / "site-a.key", tmp_path / "site-a.pub")
    with caplog.at_level(logging.INFO, logger="server_kit.partials.scale_out"):
        keys = load_aggregator_keys(tmp_path, own=tmp_path / "server.pub")
    assert sorted(keys) == ["site-a"]
    assert f"--aggregator-keys: {tmp_path / 'server.pub'} is the server's own public key, not an aggregator's" \
        in caplog.messages
    assert sorted(load_aggregator_keys(tmp_path)) == ["server", "site-a"]


def test_a_site_broker_killed_mid_round_loses_no_device_silently(digits, site_key):
    """Site A's broker is SIGKILLed once round 1 is open and restarted on its port with its persistence folder;
    every device of round 1 is summed, refused with a reason or missing by name, and the run finishes."""
    key, pub = site_key
    with Sites(key) as sites:
        site_a, urls = _site_urls(sites, digits)
        killed = threading.Event()

        def during(orch):
            def watch():
                while orch.remote.round != 1:
                    time.sleep(0.01)
                time.sleep(0.3)  # the COLLECT and the TRAIN commands are on their way
                os.kill(sites.site_a.pid, signal.SIGKILL)
                sites.site_a.stop()
                time.sleep(0.5)
                sites.site_a.start()
                killed.set()

            threading.Thread(target=watch, daemon=True).start()

        # round 1 (the one cut) closes all answered in about 4 s, or at its deadline with site A missing;
        # round 2 keeps a long deadline: the restarted broker, its bridge and the aggregator are back by then
        run = federate(urls, digits, verifier=load_verifier(pub), round_timeout_s=12, first_round_timeout_s=7,
                       during=during)
        assert killed.is_set()
    result = run.result
    first = result.history[0]
    site_b = {c.cid for c in digits} - site_a
    # site B is not touched: its updates come through its bridge, every round
    assert {s for r, s in run.updates_from if r == 1} == site_b
    # every device of site A in round 1: summed in a partial sum, refused with a reason, or missing by name
    refused, missing = first["refused"], first["missing"]
    assert set(refused) <= site_a and set(missing) <= site_a, first
    assert all(refused.values()), refused
    held_a = first["updates"] - len(site_b)
    assert (first["summary"].get("summed_remote") or 0) + len(refused) == held_a, first
    assert held_a + len(missing) == len(site_a), first
    assert first["updates"] + len(missing) == len(digits), first
    # the restarted broker's bridge and the aggregator came back: round 2 has every device, site A's summed there
    second = result.history[1]
    assert (second["updates"], second["missing"], second["summary"]["summed_remote"]) == (8, [], 4), second
    assert len(result.history) == 2
    assert result.final["evaluated"] == len(digits)


# -- hostile aggregator messages -------------------------------------------------------------------


def test_hostile_aggregator_messages_are_refused_with_their_reasons(tmp_path):
    write_keypair(tmp_path / "a.key", tmp_path / "a.pub")
    write_keypair(tmp_path / "x.key", tmp_path / "x.key.pub")
    topics = Topics("fedsketch", FED)
    weights = {"w": np.arange(4, dtype=np.float32).reshape(2, 2)}
    with MosquittoBroker() as broker:
        server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED)
        server.accept_aggregators({"site-a": load_verifier(tmp_path / "a.pub")})
        refusals: dict[str, int] = {}
        remote: RemoteRound | None = None

        def handler(topic, msg):
            remote.on_message(msg.sender, msg)

        def count(reason, sender, detail):
            refusals[reason] = refusals.get(reason, 0) + 1

        link = ServerLink(server, topics, FED, handler=handler, rejections=count, round_of=lambda: 1)
        for leaf in ("receipt", "partial"):
            server.subscribe(topics.aggregator("+", leaf), link.enqueue)
        server.connect(timeout=10)
        intake = SimpleNamespace(round=1, held_elsewhere={"d0": SimpleNamespace(n_samples=10),
                                                          "d1": SimpleNamespace(n_samples=20)},
                                 codec=update_codec(None))
        strategy = SimpleNamespace(compression=Compression.parse("none"), models={"c0": weights},
                                   versions=ModelVersions(Compression.parse("none")))
        models = SimpleNamespace(spec={"w": ((2, 2), "float32")})
        remote = RemoteRound(link, intake, strategy, models, {"site-a": load_verifier(tmp_path / "a.pub")},
                             timeout_s=10)

        def transport(name, key=None):
            t = MqttTransport(BrokerConfig.from_url(broker.url), name, federation=FED)
            if key is not None:
                t.sign_with(load_signer(key))
            t.connect(timeout=10)
            return t

        agg, stranger, unsigned = transport("site-a", tmp_path / "a.key"), transport("site-x", tmp_path / "x.key"), \
            transport("nokey")
        flushed = threading.Event()
        agg.subscribe(topics.aggregation(), lambda topic, msg: msg.kind == Kind.FLUSH and flushed.set())
        time.sleep(0.3)

        def partial(rnd, key, n, members=("d0", "d1")):
            return Message(Kind.PARTIAL, FED, "site-a", rnd, {"round": rnd, "model_key": key, "n_samples": n,
                                                             "members": list(members)}, tensors_body(weights))

        receipt = {"round": 1, "client": "d0", "model_key": "c0", "n_samples": 10, "norm": 1.0}
        good_topic = topics.aggregator("site-a", "partial")
        replayed: list[bytes] = []

        def attack():
            assert flushed.wait(10)
            stranger.publish(topics.aggregator("site-x", "receipt"),
                             Message(Kind.RECEIPT, FED, "site-x", 1, receipt), wait=True)
            unsigned.publish(topics.aggregator("site-a", "receipt"),
                             Message(Kind.RECEIPT, FED, "site-a", 1, receipt), wait=True)
            agg.publish(good_topic, partial(2, "c0", 30), wait=True)      # another round
            agg.publish(good_topic, partial(1, "c9", 30), wait=True)      # a model not asked
            agg.publish(good_topic, partial(1, "c0", 31), wait=True)      # more samples than registered (30)
            good = agg._frames(good_topic, partial(1, "c0", 30), False)   # the one right partial sum, signed
            assert len(good) == 1
            replayed.append(good[0])
            for _ in range(2):                                             # sent, then replayed byte for byte
                agg._client.publish(good_topic, good[0], qos=1).wait_for_publish(10)

        threading.Thread(target=attack, daemon=True).start()
        remote.open(1, ["c0"])
        remote.round = 1
        remote.held_by = {"d0": "site-a", "d1": "site-a"}
        remote.keys = {"d0": "c0", "d1": "c0"}
        t0 = time.monotonic()
        out, capped = remote.collect({}, {"d0": 10, "d1": 20})
        assert time.monotonic() - t0 < 9, "the right partial sum was not taken"
        deadline = time.monotonic() + 5
        while server.rejected.get("replay", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        rejected = server.rejected
        for t in (agg, stranger, unsigned, server):
            t.close()
    assert [(u.aggregator, u.model_key, u.n_samples, u.members) for u in out] == [("site-a", "c0", 30, ("d0", "d1"))]
    assert capped == 0 and remote.refused_by == {}
    assert refusals == {"partial-round": 1, "partial-unasked": 1, "partial-samples": 1}
    assert {k: rejected.get(k, 0) for k in ("unknown-aggregator", "unsigned", "replay")} == \
        {"unknown-aggregator": 1, "unsigned": 1, "replay": 1}, rejected
