"""Compressed rounds over a real Mosquitto with the shipped ACL: bit-identical models, hostile bodies refused.

Devices in threads (real sockets, real ONNX Runtime, real torch training),
the server's :class:`Orchestrator` in the test's thread.
"""

from __future__ import annotations

import logging
import struct
import threading

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from edge_sdk.client import EdgeClient
from edge_sdk.client.commands import HANDLERS
from edge_sdk.compress import Compression, encode_delta
from edge_sdk.protocol import Kind, Topics
from edge_sdk.protocol.commands import Op
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.metrics import weights_message_bytes
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, count_publishes, leb, model_digest

pytest.importorskip("torch")
pytestmark = [pytest.mark.broker,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]

FED = "squeeze"
#: One epoch: what is checked (bits, versions, bytes, refusals, clusters from sketches) does not depend on it.
SETTINGS = TrainSettings(epochs=1, lr=1e-2, batch_size=16)


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 12, groups=4, seed=0)


def start_device(c, i, url, passwords, train=None):
    cfg = BrokerConfig.from_url(url, username=c.cid, password=passwords[c.cid], reconnect_min_s=0.1, protocol="5")
    w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
    ec = EdgeClient(MqttTransport(cfg, c.cid, federation=FED), w, federation=FED, seed=i, model_timeout_s=30,
                    handlers=None if train is None else {**HANDLERS, Op.TRAIN: train})
    th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 60}, daemon=True)
    th.start()
    return ec, th


def serve(url, passwords, n, *, compress, rounds, fraction, on_round=None, min_clients=None, decode="auto"):
    cfg = BrokerConfig.from_url(url, username="server", password=passwords["server"], protocol="5")
    server = MqttTransport(cfg, "server", federation=FED)
    server.connect(timeout=10)
    published = count_publishes(server)
    strategy = SketchClustered(settings=SETTINGS, min_cluster_size=2, seed=0, fraction=fraction,
                               compression=compress)
    config = ServerConfig(federation=FED, rounds=rounds, min_clients=min_clients or n, register_timeout_s=30,
                          sketch_timeout_s=30, round_timeout_s=60, eval_timeout_s=30, encoder="digits_encoder",
                          architecture=ARCH, seed=0, decode_updates=decode)
    orch = Orchestrator(strategy, server, config, on_round=on_round)
    try:
        return orch, strategy, orch.run(), published
    finally:
        server.close()


def test_devices_that_skip_rounds_or_join_late_hold_the_servers_bits(digits, shipped_acl):
    """Half of each cluster trains per round; one device joins after round 1; after the final evaluation
    every device's copy of its cluster's model hashes like the server's, and the models went down as changes."""
    passwords = {c.cid: f"pw-{c.cid}" for c in digits} | {"server": "pw-server"}
    early, late = digits[:-1], digits[-1]
    with MosquittoBroker(acl=shipped_acl(FED), passwords=passwords) as broker:
        devices = [start_device(c, i, broker.url, passwords) for i, c in enumerate(early)]
        joined = []

        def on_round(rec):
            if rec["round"] == 1:
                joined.append(start_device(late, len(early), broker.url, passwords))

        orch, strategy, result, published = serve(broker.url, passwords, len(digits), compress="topk:0.05",
                                                   rounds=4, fraction=0.5, on_round=on_round,
                                                   min_clients=len(early))
        devices += joined
        for _, th in devices:
            th.join(timeout=30)
    assert adjusted_rand_score([c.group for c in early], [result.assignment[c.cid] for c in early]) == 1.0
    assert late.cid in result.assignment and result.final["evaluated"] == len(digits)
    for ec, _ in devices:
        key = strategy.model_key_for(ec.cid)
        held = ec.store.get(key)
        assert held.version == strategy.versions.version[key], ec.cid
        assert model_digest(held.weights) == model_digest(strategy.models[key]), ec.cid
        assert not ec.rejected, (ec.cid, ec.rejected)
    # what went down: changes, far fewer bytes than whole models for every download
    whole = weights_message_bytes(Kind.MODEL, strategy.models["c0"], {"key": "c0", "version": 9})
    downloads = sum(ec.transport.stats()["received"]["MODEL"]["messages"] for ec, _ in devices)
    assert result.delivered["MODEL"] < 0.5 * whole * downloads, (result.delivered, whole, downloads)
    # round 1: each device built its first model itself (the portable initial weights): envelopes only
    first = result.history[0]
    assert first["model_bytes_delivered"] < 0.02 * whole * first["tasked"], first
    ups = result.transport["received"]["UPDATE"]
    assert ups["bytes"] < 0.15 * whole * ups["messages"]
    assert not result.rejected


def test_every_device_at_the_previous_version_gets_the_change_once_on_its_cluster_topic(digits, shipped_acl):
    passwords = {c.cid: f"pw-{c.cid}" for c in digits} | {"server": "pw-server"}
    with MosquittoBroker(acl=shipped_acl(FED), passwords=passwords) as broker:
        devices = [start_device(c, i, broker.url, passwords) for i, c in enumerate(digits)]
        _, strategy, result, published = serve(broker.url, passwords, len(digits), compress="stc:0.05", rounds=2,
                                               fraction=1.0)
        for _, th in devices:
            th.join(timeout=30)
    k = len(set(result.assignment.values()))
    topics = Topics("fedsketch", FED)
    on_clusters = [t for t, what in published if what == "MODEL" and "/clusters/" in t]
    assert sorted(on_clusters) == sorted([topics.model(f"c{j}") for j in range(k)] * 3)  # 2 rounds + evaluation
    assert result.final["deliveries"] == {"cluster_topic": k, "per_device": 0}
    for ec, _ in devices:
        key = strategy.model_key_for(ec.cid)
        assert model_digest(ec.store.get(key).weights) == model_digest(strategy.models[key])


# -- hostile compressed bodies ---------------------------------------------------------------


def stc_tensor(k: int, gaps: list[int], mu: float, n_signs: int | None = None) -> bytes:
    idx = b"".join(leb(g) for g in gaps)
    signs = bytes((k + 7) // 8 if n_signs is None else n_signs)
    return struct.pack("<IBI", k, 0, len(idx)) + idx + struct.pack("<f", mu) + signs  # LEB128 positions


#: What a hostile device puts in place of its first tensor (the 1st conv's bias, 16 entries), and the reason.
HOSTILE = {
    "out-of-range": (lambda n: stc_tensor(1, [n], 0.1), "compressed-index"),
    "duplicated": (lambda n: stc_tensor(2, [3, 0], 0.1), "compressed-index"),
    "unsorted": (lambda n: stc_tensor(2, [5, 2**32 - 3], 0.1), "compressed-index"),
    "count-lies": (lambda n: stc_tensor(n + 1, list(range(1, n + 2)), 0.1), "compressed-count"),
    "huge-count": (lambda n: struct.pack("<II", 2**32 - 1, 4) + b"\x00" * 4, "compressed-count"),
    "nan-scale": (lambda n: stc_tensor(1, [0], float("nan")), "compressed-value"),
}


#: The same for int4 bodies (a first tensor of 16 entries: one scale, 8 bytes of nibbles).
HOSTILE_INT4 = {
    "nibble-0": (lambda n: struct.pack("<f", 0.01) + bytes((n + 1) // 2), "compressed-value"),
    "nan-scale": (lambda n: struct.pack("<f", float("nan")) + b"\x88" * ((n + 1) // 2), "compressed-value"),
    "negative-scale": (lambda n: struct.pack("<f", -0.01) + b"\x88" * ((n + 1) // 2), "compressed-value"),
}


def hostile_train(kind: str, table=HOSTILE):
    """A train handler that sends a compressed body broken as ``kind`` says."""
    make, _ = table[kind]

    def train(state, cmd, ctx):
        m = cmd.fields
        r = m["round"]
        held = state.store.wait(m["models"][0], r, ctx.model_timeout_s)
        comp = Compression.from_meta(m["compress"])
        zero = {n: np.zeros_like(w) for n, w in held.weights.items()}
        body, _ = encode_delta(zero, comp)
        first = sorted(held.weights)[0]
        n = held.weights[first].size
        # the first tensor's block ends where the second one's starts in an honest body
        honest_first, _ = encode_delta({first: zero[first]}, comp)
        rest = body[len(honest_first):]
        bad = body[:8] + make(n) + rest
        meta = {"round": r, "model_key": m["models"][0], "n_samples": 10, "loss": 0.0, "metrics": {},
                "version": held.version}
        ctx.link.send(ctx.link.topics.update(ctx.link.cid), Kind.UPDATE, r, meta, bad)

    return train


def test_hostile_compressed_bodies_are_refused_and_the_federation_finishes(digits, shipped_acl):
    passwords = {c.cid: f"pw-{c.cid}" for c in digits} | {"server": "pw-server"}
    kinds = list(HOSTILE)
    with MosquittoBroker(acl=shipped_acl(FED), passwords=passwords) as broker:
        devices = [start_device(c, i, broker.url, passwords,
                                hostile_train(kinds[i // 2]) if i % 2 == 0 else None)
                   for i, c in enumerate(digits)]
        _, strategy, result, _ = serve(broker.url, passwords, len(digits), compress="stc:0.05", rounds=2,
                                       fraction=1.0)
        for _, th in devices:
            th.join(timeout=30)
    assert adjusted_rand_score([c.group for c in digits], [result.assignment[c.cid] for c in digits]) == 1.0
    want: dict[str, int] = {}
    for kind in kinds:
        want[HOSTILE[kind][1]] = want.get(HOSTILE[kind][1], 0) + 2  # one body per round, 2 rounds
    assert {r: result.rejected.get(r, 0) for r in want} == want, result.rejected
    assert [h["updates"] for h in result.history] == [6, 6]  # the honest half, every round
    assert result.final["evaluated"] == len(digits)


def _hostile_int4_run(digits, shipped_acl, decode, hostile):
    passwords = {c.cid: f"pw-{c.cid}" for c in digits} | {"server": "pw-server"}
    with MosquittoBroker(acl=shipped_acl(FED), passwords=passwords) as broker:
        devices = [start_device(c, i, broker.url, passwords,
                                hostile_train(hostile[i], HOSTILE_INT4) if i in hostile else None)
                   for i, c in enumerate(digits)]
        _, strategy, result, _ = serve(broker.url, passwords, len(digits), compress="int4", rounds=2,
                                       fraction=1.0, decode=decode)
        for _, th in devices:
            th.join(timeout=30)
    return strategy, result


def test_int4_updates_decoded_where_summed_give_the_intakes_models_and_refuse_the_same_bodies(
        digits, shipped_acl, caplog):
    """The server's own rounds with the codes kept until the sum (a GPU server's path, its host side here):
    hostile int4 bodies refused with the reasons of decoding at intake, the honest ones summed, and the
    models those of the same run decoded at intake, bit for bit."""
    kinds = list(HOSTILE_INT4)
    hostile = {i: kinds[i // 4] for i in (0, 4, 8)}
    want: dict[str, int] = {}
    for kind in hostile.values():
        want[HOSTILE_INT4[kind][1]] = want.get(HOSTILE_INT4[kind][1], 0) + 2  # one body per round, 2 rounds
    digests = {}
    for decode in ("intake", "sum"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="server_kit.rounds.decoding"):
            strategy, result = _hostile_int4_run(digits, shipped_acl, decode, hostile)
        said = "int4 updates kept as they came and decoded where they are summed"
        assert (said in caplog.text) == (decode == "sum")
        assert adjusted_rand_score([c.group for c in digits], [result.assignment[c.cid] for c in digits]) == 1.0
        assert {r: result.rejected.get(r, 0) for r in want} == want, result.rejected
        assert [h["updates"] for h in result.history] == [9, 9]
        digests[decode] = {k: model_digest(w) for k, w in strategy.models.items()}
    assert digests["sum"] == digests["intake"]
