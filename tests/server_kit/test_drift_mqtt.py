"""Data that drifts (issue 15) over a real Mosquitto: the server, real MQTT devices, a device that drifts.

24 digits devices in 4 rotation groups (6 each) are clustered from their
sketches. After round 1, 3 devices of group 0 say their data changed
(``EdgeClient.data_changed``) to group 1's rotation: each sends its new
sketch unasked, the server moves exactly those 3 to group 1's cluster before
round 2, and each trains its new cluster's model from round 2 on. The server
is then stopped and resumed from its checkpoint: the new assignment holds.
A run that does not follow drift refuses such a sketch (counted) and changes
nothing else.
"""

from __future__ import annotations

import threading
import time

import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.tasks import TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from edge_sdk.worker import LocalWorker
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.data.drift import rotation_drift
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, ari_against, count_publishes

pytest.importorskip("torch")
pytestmark = [pytest.mark.broker,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]

SETTINGS = TrainSettings(epochs=1, lr=1e-2, batch_size=16)


class RecordingWorker(LocalWorker):
    """A device's worker that records the model key of every update it made: ``trained[round] = key``."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.trained: dict[int, str] = {}

    def fit(self, task):
        update = super().fit(task)
        self.trained[task.round] = update.model_key
        return update


def _config(fed: str, rounds: int, n: int, **kw) -> ServerConfig:
    return ServerConfig(federation=fed, rounds=rounds, min_clients=n, register_timeout_s=60, sketch_timeout_s=60,
                        round_timeout_s=60, eval_timeout_s=60, encoder="digits_encoder", architecture=ARCH, seed=0,
                        **kw)


def _start_devices(url: str, fed: str, clients) -> list[EdgeClient]:
    edges = []
    for i, c in enumerate(clients):
        worker = RecordingWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        transport = MqttTransport(BrokerConfig.from_url(url, reconnect_min_s=0.1), c.cid, federation=fed)
        ec = EdgeClient(transport, worker, federation=fed, seed=i, model_timeout_s=60)
        threading.Thread(target=ec.run, kwargs={"max_idle_s": 90}, daemon=True).start()
        edges.append(ec)
    return edges


def _server(url: str, fed: str) -> MqttTransport:
    server = MqttTransport(BrokerConfig.from_url(url), "server", federation=fed)
    server.connect(timeout=10)
    return server


def _drift_after_round_1(server, edges, event, by_id):
    """The ``on_round`` of the server: after round 1, the event's devices change their data, and the
    server waits until their unasked sketches have reached it (so that round 2 acts on them)."""

    def on_round(rec):
        if rec["round"] != 1:
            return
        before = server.stats()["received"]["SKETCH"]["messages"]
        for cid in event.clients:
            new = event.transform(by_id[cid])
            edges[cid].data_changed(new.x_train, new.y_train, new.x_test, new.y_test)
        deadline = time.monotonic() + 60
        while server.stats()["received"]["SKETCH"]["messages"] < before + len(event.clients):
            assert time.monotonic() < deadline, "the unasked sketches did not arrive"
            time.sleep(0.05)

    return on_round




@pytest.fixture(scope="module")
def broker():
    with MosquittoBroker() as b:
        yield b


@pytest.fixture(scope="module")
def drifted(broker, digits24, tmp_path_factory):
    """Two rounds with a drift after round 1 (checkpointed), then the server resumed for round 3."""
    fed = "drift"
    sched = rotation_drift(digits24, round=2, moves=[(0, 1, 3)], seed=0)
    (event,) = sched.events
    by_id = {c.cid: c for c in digits24}
    devices = _start_devices(broker.url, fed, digits24)
    edges = {e.cid: e for e in devices}
    ck = str(tmp_path_factory.mktemp("drift-checkpoint"))
    server = _server(broker.url, fed)
    try:
        strategy = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0, follow_drift=True)
        first = Orchestrator(strategy, server, _config(fed, 2, 24, checkpoint_dir=ck, stop_clients=False),
                             on_round=_drift_after_round_1(server, edges, event, by_id)).run()
    finally:
        server.close()
    server = _server(broker.url, fed)
    try:
        again = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0, follow_drift=True)
        resumed = Orchestrator(again, server, _config(fed, 3, 24, checkpoint_dir=ck)).run(resume=True)
    finally:
        server.close()
    return {"first": first, "resumed": resumed, "strategy": strategy, "again": again, "edges": edges,
            "event": event, "before": sched.truth(digits24, 1), "after": sched.truth(digits24, 2)}


def test_the_drifted_devices_and_only_they_move_to_the_cluster_they_now_fit(drifted):
    first, event, before = drifted["first"], drifted["event"], drifted["before"]
    drift = first.history[1]["summary"]["drift"]
    assert sorted(m["cid"] for m in drift["moves"]) == sorted(event.clients)
    assert drift["pooled"] == [] and drift["new_clusters"] == [] and drift["retired"] == []
    assert drift["unasked"] == 3 and drift["asked"] == 0 and drift["reassigned"] == 3 and drift["bytes"] > 0
    group1 = {first.assignment[c] for c, g in before.items() if g == 1}
    assert len(group1) == 1 and {m["to"] for m in drift["moves"]} == group1
    for m in drift["moves"]:  # logged with the distances that decided it
        assert m["distance_from"] > m["radius_from"] and m["distance_to"] <= m["radius_to"]
    assert "drift" not in first.history[0]["summary"]
    assert {k: first.drift[k] for k in ("moves", "unasked", "reassigned", "rounds")} == {
        "moves": 3, "unasked": 3, "reassigned": 3, "rounds": 1}
    assert first.rejected == {}
    # clustered right before the drift, right again after it
    assert ari_against(drifted["after"], first.assignment) == 1.0 and ari_against(before, first.assignment) < 1.0


def test_a_moved_device_gets_its_new_clusters_model_and_its_updates_go_there(drifted):
    first, strategy, event = drifted["first"], drifted["strategy"], drifted["event"]
    (new_key,) = {strategy.key(m["to"]) for m in first.history[1]["summary"]["drift"]["moves"]}
    for cid, ec in drifted["edges"].items():
        trained = ec.worker.trained
        assert sorted(trained) == [1, 2, 3], cid
        if cid in event.clients:  # round 1 with its old cluster, then the new cluster's model (its own record)
            assert trained[1] != new_key and trained[2] == trained[3] == new_key, (cid, trained)
            assert ec.model_key == new_key
        else:
            assert trained[1] == trained[2] == trained[3] == ec.model_key, (cid, trained)
    # the server took round 2's updates of the moved devices for the new cluster: 6 of group 1 and the 3
    assert first.history[1]["summary"][new_key] == 9 and first.history[0]["summary"][new_key] == 6
    assert [h["updates"] for h in first.history] == [24, 24]


def test_resume_after_a_migration_keeps_the_new_assignment(drifted):
    first, resumed, again = drifted["first"], drifted["resumed"], drifted["again"]
    assert resumed.assignment == first.assignment == again.assignment
    assert again.drift_.counts["moves"] == 3
    assert [h["round"] for h in resumed.history] == [1, 2, 3] and resumed.history[2]["updates"] == 24
    assert ari_against(drifted["after"], resumed.assignment) == 1.0
    assert resumed.final["evaluated"] == 24 and resumed.drift["moves"] == 3


def test_a_run_that_does_not_follow_drift_refuses_an_unasked_sketch_and_changes_nothing(broker, digits24):
    fed = "static"
    clients = digits24[:12]  # 3 devices per group
    sched = rotation_drift(clients, round=2, moves=[(0, 1, 1)], seed=0)
    (event,) = sched.events
    devices = _start_devices(broker.url, fed, clients)
    edges = {e.cid: e for e in devices}
    server = _server(broker.url, fed)
    try:
        strategy = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0)
        result = Orchestrator(strategy, server, _config(fed, 2, 12),
                              on_round=_drift_after_round_1(server, edges, event, {c.cid: c for c in clients})).run()
    finally:
        server.close()
    (cid,) = event.clients
    assert edges[cid].drift.unasked == 1  # the device told the server
    assert result.rejected == {"unasked-sketch": 1}  # which refused it, counted
    assert ari_against(sched.truth(clients, 1), result.assignment) == 1.0  # nobody moved
    assert result.drift is None and all("drift" not in h["summary"] for h in result.history)
    assert [h["updates"] for h in result.history] == [12, 12] and result.final["evaluated"] == 12
    trained = edges[cid].worker.trained
    assert trained[1] == trained[2] == edges[cid].model_key  # it trains on with its cluster, nothing lost


def test_a_scheduled_resketch_asks_every_device_at_once_and_moves_nobody(broker, digits24):
    fed = "resketch"
    clients = digits24[:12]
    _start_devices(broker.url, fed, clients)
    server = _server(broker.url, fed)
    published = count_publishes(server)  # (topic, what): a command's op, or the message kind
    try:
        strategy = SketchClustered(settings=SETTINGS, min_cluster_size=3, seed=0, resketch_every=1)
        orch = Orchestrator(strategy, server, _config(fed, 2, 12))
        result = orch.run()
    finally:
        server.close()
    drift = result.history[1]["summary"]["drift"]
    assert (drift["asked"], drift["answered"], drift["sketches"], drift["unasked"]) == (12, 12, 12, 0)
    assert drift["moves"] == drift["pooled"] == drift["new_clusters"] == []
    # the devices keep their sketch key: unchanged data, the same bits as the sketches clustered
    assert all(orch.intake.sketches[c.cid].packed().tobytes() == strategy.drift_.sketches[c.cid].tobytes() for c in clients)
    assert strategy.drift_.counts == {"moves": 0, "pooled": 0, "new_clusters": 0, "retired": 0, "sketches": 12}
    # one broadcast before clustering, one before round 2
    assert [t for t, what in published if what == "sketch"] == [server.topics.broadcast()] * 2
    assert result.transport["received"]["SKETCH"]["messages"] == 24
    assert ari_against({c.cid: c.group for c in clients}, result.assignment) == 1.0


def test_the_server_options_turn_drift_following_on_for_ours_only(monkeypatch, capsys):
    import server_kit.cli as cli
    import server_kit.strategies as strategies

    made = []
    make = strategies.make_strategy

    def recording(name, **kw):
        made.append(make(name, **kw))
        return made[-1]

    monkeypatch.setattr(strategies, "make_strategy", recording)
    monkeypatch.setattr(cli, "_with_broker", lambda *a, **kw: None)  # no broker: main returns 3 after building
    assert cli.main(["--strategy", "fedsketch", "--follow-drift", "--resketch-every", "3", "--flip-prob", "0.2"]) == 3
    (s,) = made
    assert s.capabilities.follows_drift and s.drift_.resketch_every == 3 and s.drift_.flip_prob == 0.2
    assert s.resketch_asked(4, ['a', 'b']) == ['a', 'b'] and s.resketch_asked(3, ['a', 'b']) == []
    assert cli.main(["--strategy", "fedsketch"]) == 3 and not made[-1].capabilities.follows_drift
    for argv, message in (
        (["--strategy", "fedavg", "--follow-drift"], "--follow-drift and --resketch-every apply to --strategy "
                                                     "fedsketch and fedsketch-fedae"),
        (["--strategy", "fedsketch", "--resketch-every", "0"], "resketch_every must be"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "fedsketch-server: error:" in err and message in err, err
