"""Secure aggregation over a real Mosquitto: the server sums each cluster's masked updates and never reads one.

Devices are EdgeClients on their own threads and sockets. The integers each device masks are recorded (the
quantiser is wrapped in this process), so the sum the server unmasks is checked against the plain sum of the
same integers, bit for bit; one device per cluster drops before sending (its pair masks come off the sum); the
server's intake holds no device's weights.
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

import edge_sdk.client.secure as device_secure
from edge_sdk.client import EdgeClient
from edge_sdk.client.commands import HANDLERS
from edge_sdk.protocol.commands import Op
from edge_sdk.secure import ServerSecureRound, round_context
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.cli import main
from server_kit.data.partition import load_digits_images, rotation_partition

from helpers import ARCH

pytest.importorskip("torch")
pytestmark = [pytest.mark.broker,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]

FED = "sec"


@pytest.fixture(scope="module")
def digits16():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 16, groups=4, seed=0)


def _silent_train(state, cmd, ctx):
    """A device that drops mid-round: it takes its train command and never answers."""


def _start(url, clients, dropping=()):
    threads = []
    for i, c in enumerate(clients):
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        t = MqttTransport(BrokerConfig.from_url(url, reconnect_min_s=0.1), c.cid, federation=FED)
        handlers = {**HANDLERS, Op.TRAIN: _silent_train} if c.cid in dropping else None
        ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=30, handlers=handlers)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": 40}, daemon=True)
        th.start()
        threads.append(th)
    return threads


def test_secure_rounds_equal_the_plain_sum_and_survive_a_dropped_device(tmp_path, digits16, monkeypatch):
    masked: dict = defaultdict(dict)  # (round, model) -> device -> the integers it masked
    unmasked: dict = {}
    encode = device_secure.SecureQuantizer.encode

    def recording_mask(state, cid, fields, rnd, key, weights, start):
        def enc(self, x, rng):
            q, clipped = encode(self, x, rng)
            masked[(rnd, key)][cid] = q.copy()
            return q, clipped
        monkeypatch.setattr(device_secure.SecureQuantizer, "encode", enc)
        return real_mask(state, cid, fields, rnd, key, weights, start)

    real_mask = device_secure.masked_update
    lock = threading.Lock()

    def serial_mask(*a):
        with lock:  # the devices' threads share the wrapped quantiser
            return recording_mask(*a)

    monkeypatch.setattr(device_secure, "masked_update", serial_mask)
    real_unmask = ServerSecureRound.unmask

    def recording_unmask(self):
        out = real_unmask(self)
        unmasked[self.params.ctx] = (self.survivors, self.dropped, out.copy())
        return out

    monkeypatch.setattr(ServerSecureRound, "unmask", recording_unmask)
    dropping = {"c03"}  # group 3's device drops in every round
    report = tmp_path / "report"
    with MosquittoBroker() as broker:
        threads = _start(broker.url, digits16, dropping)
        rc = main(["--broker", broker.url, "--federation", FED, "--min-clients", "16", "--rounds", "3",
                   "--epochs", "2", "--lr", "0.01", "--encoder", "digits_encoder", "--architecture", ARCH,
                   "--min-cluster-size", "3", "--report-goal", "0.7", "--round-timeout", "40", "--secure",
                   "--secure-clip", "5", "--report-dir", str(report)])
        for th in threads:
            th.join(timeout=60)
    assert rc == 0
    results = json.loads((report / "results.json").read_text())
    truth = [c.group for c in digits16]
    assert adjusted_rand_score(truth, [results["assignment"][c.cid] for c in digits16]) == 1.0
    sec = results["privacy"]["secure"]
    assert sec["rounds"] == 12 and sec["failed"] == 0 and sec["dropped"] == 3, sec
    assert all(h["updates"] == 15 for h in results["history"])
    # every group's unmasked sum is the plain sum of its survivors' integers, exactly
    assert len(unmasked) == 12
    for survivors, dropped, _ in unmasked.values():
        assert "c03" not in survivors and (dropped == ("c03",) or "c03" not in dropped)
    for (rnd, key), qs in masked.items():
        survivors, _, total = unmasked[round_context(results["run_id"], rnd, key)]
        assert sorted(survivors) == sorted(qs)
        assert np.array_equal(total, np.sum([qs[c] for c in survivors], axis=0))
    # and the clustered models learnt: above FedAvg's reach on rotated digits
    assert results["final_evaluation"]["mean"] > 0.6, results["final_evaluation"]
    assert "Secure aggregation" in (report / "report.html").read_text()


def test_a_device_past_its_sketch_budget_declines_and_the_run_goes_on_without_it(tmp_path, digits16, caplog):
    """Its sketch would cost 439 per device against an owner's budget of 100: not sent, the server told; the
    others are clustered and trained, and the report lists each device's epsilon and the one that declined."""
    from edge_sdk.client import EdgeClient

    clients = digits16[:8]
    report = tmp_path / "report"
    with MosquittoBroker() as broker:
        threads = []
        for i, c in enumerate(clients):
            w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
            t = MqttTransport(BrokerConfig.from_url(broker.url, reconnect_min_s=0.1), c.cid, federation=FED)
            ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=30,
                            max_sketch_epsilon=100.0 if c.cid == "c07" else None)
            threads.append(threading.Thread(target=ec.run, kwargs={"max_idle_s": 40}, daemon=True))
            threads[-1].start()
        with caplog.at_level("INFO"):
            rc = main(["--broker", broker.url, "--federation", FED, "--min-clients", "8", "--rounds", "2",
                       "--epochs", "1", "--lr", "0.01", "--encoder", "digits_encoder", "--architecture", ARCH,
                       "--min-cluster-size", "1", "--sketch-timeout", "30", "--report-dir", str(report)])
        for th in threads:
            th.join(timeout=60)
    assert rc == 0
    sk = json.loads((report / "results.json").read_text())["privacy"]["sketch"]
    assert sk["declined"] == ["c07"] and sorted(sk["devices"]) == [f"c0{i}" for i in range(7)]
    assert all(d == {"sketches": 1, "epsilon": 439.444915} for d in sk["devices"].values()), sk["devices"]
    assert sk["epsilon_per_image"] == 43.944492 and sk["flip_prob"] == 0.1
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("sketch refused: its epsilon 439.4 per device (P = 0.1, 200 bits) would bring this "
                            "device's total to 439.4, above its budget --max-sketch-epsilon 100") for m in said)
    assert "c07 declined to send its sketch (its owner's privacy budget): left out of the clustering" in said
    page = (report / "report.html").read_text()
    assert "declined (its budget)" in page and "43.9 per image" in page


def test_dp_on_secure_sums_over_mosquitto_accounts_each_cluster(tmp_path, digits16):
    """Both at once: the devices clip to the DP clip before masking, the server adds the noise to each cluster's
    secure sum and accounts its round; results.json holds each cluster's accountant and the secure sums."""
    report = tmp_path / "report"
    with MosquittoBroker() as broker:
        threads = _start(broker.url, digits16)
        rc = main(["--broker", broker.url, "--federation", FED, "--min-clients", "16", "--rounds", "2",
                   "--epochs", "1", "--lr", "0.01", "--encoder", "digits_encoder", "--architecture", ARCH,
                   "--min-cluster-size", "3", "--secure", "--dp-epsilon", "8", "--dp-clip", "3",
                   "--report-dir", str(report)])
        for th in threads:
            th.join(timeout=60)
    assert rc == 0
    privacy = json.loads((report / "results.json").read_text())["privacy"]
    assert privacy["secure"]["rounds"] == 8 and privacy["secure"]["failed"] == 0 and privacy["secure"]["clip"] == 3.0
    dp = privacy["dp"]
    assert dp["epsilon_budget"] == 8.0 and dp["clip"] == 3.0 and len(dp["clusters"]) == 4
    for c in dp["clusters"].values():  # 4 devices a cluster, all asked: no sampling amplification
        assert (c["members"], c["per_round"], c["rounds"]) == (4, 4, 2) and 7.0 < c["epsilon"] <= 8.0
        assert c["epsilon_per_round"][0] < c["epsilon_per_round"][1] == c["epsilon"]
