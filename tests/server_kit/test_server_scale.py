"""A server for big fleets: per-message work that does not grow with the fleet, traffic that scales.

- The pump's stopping rule and the message handlers run a constant number of
  Python lines whatever the fleet's size (counted with ``sys.settrace`` at
  100 and at 10,000 registered devices; no clock involved).
- Models: each device downloads exactly the models it needs, and a model
  goes once on its cluster topic when every device following that topic
  needs it (the final evaluation of a fleet); the final evaluation is one
  broadcast command, optionally of a seeded sample of the devices
  (``eval_fraction``), and the server waits for exactly that sample.

Real-broker runs of the same rules are in test_mqtt_e2e.py.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.protocol import Kind, Message, Topics, decode_message, sketch_body, tensors_body
from edge_sdk.sketch import Sketch
from edge_sdk.tasks import TrainSettings
from edge_sdk.training.sampling import in_sample, sample_point
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.drivers.delivery import _Follow
from server_kit.drivers.final_eval import final_evaluation
from server_kit.drivers.phase import Phase
from server_kit.drivers.registration import register
from server_kit.drivers.sketch_phase import cluster_from_sketches
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH

FED = "s"


# -- one sampling rule on both sides -----------------------------------------------------------


def test_in_sample_is_deterministic_and_takes_the_fraction_asked():
    # pinned: from sha256("<seed>:<id>"), the same on every machine and Python version
    assert sample_point("c00", 0) == 0.13136851067960753
    assert sample_point("dev00001", 7) == 0.6272741490796362
    ids = [f"dev{i:05d}" for i in range(4000)]
    assert all(in_sample(c, 1.0, 7) for c in ids) and not any(in_sample(c, 0.0, 7) for c in ids)
    half = [c for c in ids if in_sample(c, 0.5, 7)]
    assert 1800 < len(half) < 2200
    assert half == [c for c in ids if in_sample(c, 0.5, 7)]  # the same sample every time
    assert half != [c for c in ids if in_sample(c, 0.5, 8)]  # another seed, another sample
    assert set([c for c in ids if in_sample(c, 0.25, 7)]) <= set(half)  # nested: a point below 0.25 is below 0.5
    with pytest.raises(ValueError, match=r"fraction must be in \[0, 1\], got 1.5"):
        in_sample("c0", 1.5, 0)


def test_bad_eval_fraction_is_refused(capsys):
    from server_kit.cli import main

    with pytest.raises(ValueError, match=r"eval_fraction must be in \(0, 1\], got 0"):
        ServerConfig(eval_fraction=0)
    for bad in ("1.5", "0", "-0.5", "nan"):
        assert main(["--eval-fraction", bad]) == 2
        assert capsys.readouterr().err == f"fedsketch-server: error: --eval-fraction must be in (0, 1], got {bad}\n"


# -- per-message cost --------------------------------------------------------------------------


def _lines(fn, *args):
    """``fn(*args)`` and the number of Python trace events (calls and lines) it ran."""
    n = 0

    def trace(frame, event, arg):
        nonlocal n
        n += 1
        return trace

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        out = fn(*args)
    finally:
        sys.settrace(old)
    return out, n


class _Meter:
    """Counts the trace events of every stopping-rule call of the pump (per phase) and of some handlers."""

    MEASURED = (Kind.SKETCH, Kind.UPDATE, Kind.METRICS)

    def __init__(self, orch: Orchestrator) -> None:
        self.phase = "?"
        self.until: dict[str, list[int]] = defaultdict(list)
        self.handler: dict[str, list[int]] = defaultdict(list)
        pump, handle = orch.link.pump, orch.link.handle_safely

        def metered_pump(until, timeout):
            def counted():
                done, n = _lines(until)
                self.until[self.phase].append(n)
                return done

            return pump(counted, timeout)

        def metered_handle(topic, msg):
            if msg.kind in self.MEASURED:
                _, n = _lines(handle, topic, msg)
                self.handler[msg.kind.name].append(n)
            else:
                handle(topic, msg)

        orch.link.pump = metered_pump
        orch.link.handle_safely = metered_handle


def _fleet_costs(server_transport, n: int) -> tuple[dict[str, int], dict[str, int], Orchestrator]:
    """Registration, sketches, one round and the final evaluation of ``n`` scripted devices.

    The devices' messages are put in the server's inbox (no device code
    runs): all hellos, then ``k`` sketches, ``k`` updates and ``k`` metrics
    of the first devices, so every phase waits on most of the fleet.
    Returns the most trace events of one stopping-rule call per phase and
    of one handler call per message kind.
    """
    broker = MemoryBroker()
    server = server_transport(broker, federation=FED)
    server.connect()
    template = {"w": np.zeros((2, 3), np.float32)}
    strategy = SketchClustered(min_cluster_size=2, seed=0)
    k = min(n // 2, 200) // 4 * 4  # k / 4 answers in each of the 4 clusters
    # the sketches close on the k-th answer, the round on the (k / 4)-th of each cluster, whatever the clock
    quorum = (k - 0.5) / n
    config = ServerConfig(federation=FED, rounds=1, min_clients=n, register_timeout_s=120, sketch_timeout_s=60,
                          sketch_quorum=quorum, round_timeout_s=60, report_goal=quorum, eval_timeout_s=2.0,
                          encoder="digits_encoder", architecture=ARCH, seed=0)
    orch = Orchestrator(strategy, server, config, template=template)
    meter = _Meter(orch)
    cids = [f"d{i:05d}" for i in range(n)]
    put = orch.link.inbox.put_nowait
    hello = {"n_samples": 10, "capabilities": ["train-torch"], "input_shape": [8, 8]}
    for c in cids:
        put((FED, Message(Kind.HELLO, FED, c, 0, hello)))
    meter.phase = "register"
    register(orch.parts, orch.config, orch.run_id)
    assert len(orch.clients) == n
    orch.strategy.setup([s.info for s in orch.clients.values()], orch.run_models.template)

    def cluster(got):  # the clustering itself is not what is measured here: 4 clusters by position
        strategy.set_assignment({c: i % 4 for i, c in enumerate(cids)})
        return strategy.assignment

    strategy.on_sketches = cluster
    bits = sketch_body(Sketch(bytes(25), 10, 20))
    for c in cids[:k]:
        put((FED, Message(Kind.SKETCH, FED, c, 0, {}, bits)))
    meter.phase = "sketch"
    cluster_from_sketches(orch.parts, orch.strategy, orch.config)
    orch.intake.run.enter(Phase.TRAIN, rnd=0)
    orch.assignments.announce()
    body = tensors_body({"w": np.ones((2, 3), np.float32)})
    for c in cids[:k]:
        meta = {"round": 1, "model_key": strategy.model_key_for(c), "n_samples": 10, "loss": 0.5}
        put((FED, Message(Kind.UPDATE, FED, c, 1, meta, body)))
    meter.phase = "round"
    rec = orch._run_round(1)
    assert rec["updates"] == k and rec["close"] == "goal", rec["close"]
    for c in cids:  # every device confirms its model topic
        put((FED, Message(Kind.STATUS, FED, c, 0, {"state": "online", "follow": [strategy.model_key_for(c)]})))
    for c in cids[:k]:
        put((FED, Message(Kind.METRICS, FED, c, 2, {"round": 2, "model_key": strategy.model_key_for(c),
                                                    "accuracy": 0.5, "n_test": 3})))
    meter.phase = "evaluate"
    final = final_evaluation(orch.config, strategy, architecture=orch.run_models.architecture, link=orch.link, fleet=orch.fleet,
                             intake=orch.intake, assignments=orch.assignments, delivery=orch.delivery)
    assert len(final.per_client) == k
    return ({p: max(v) for p, v in meter.until.items()}, {m: max(v) for m, v in meter.handler.items()}, orch)


def test_per_message_work_does_not_grow_with_the_fleet(server_transport):
    """Every phase's stopping rule and every handler: as many Python lines at 10,000 devices as at 100.

    Before the pending sets, "all sketches in" and a round's "anyone left"
    scanned the fleet before every message (10,000 lines each at 10,000
    devices), and the final evaluation's rule scanned the answered prefix.
    """
    small_until, small_handler, _ = _fleet_costs(server_transport, 100)
    big_until, big_handler, orch = _fleet_costs(server_transport, 10_000)
    assert set(big_until) == {"register", "sketch", "round", "evaluate"}
    for phase, cost in big_until.items():
        assert cost <= small_until[phase] + 5, (phase, small_until, big_until)
        assert cost <= 50, (phase, big_until)
    assert set(big_handler) == {"SKETCH", "UPDATE", "METRICS"}
    for kind, cost in big_handler.items():
        assert cost <= small_handler[kind] + 30, (kind, small_handler, big_handler)
    assert not orch.delivery.pending  # every confirmation was taken in


def test_a_model_goes_on_a_cluster_topic_only_to_confirmed_followers_that_all_need_it(server_transport):
    broker = MemoryBroker()
    server = server_transport(broker, federation=FED)
    orch = Orchestrator(SketchClustered(), server, ServerConfig(federation=FED, architecture=ARCH),
                        template={"w": np.zeros(2, np.float32)})
    orch.delivery.online = lambda: ["a", "b", "c", "d"]  # online devices, without registering them
    orch.delivery.follow = {"a": _Follow(frozenset({"c0"})), "b": _Follow(frozenset({"c0"})),
                    "c": _Follow(frozenset({"c1", "+"}), confirmed=False, told=frozenset({"c1"})),
                    "d": _Follow(frozenset({"c2"}))}
    needs = {"a": ["c0"], "b": ["c0"], "c": ["c1"], "d": ["c2"]}
    # c0: both followers need it; c1: its follower has not confirmed (it may still get every topic),
    # which also holds c0 and c2 back
    assert orch.delivery.topic_receivers(needs, ["c0", "c1", "c2"]) == {}
    orch.delivery.follow["c"] = _Follow(frozenset({"c1"}))
    assert orch.delivery.topic_receivers(needs, ["c0", "c1", "c2"]) == {"c0": {"a", "b"}, "c1": {"c"}, "c2": {"d"}}
    # a follower that does not need it: the model goes per device to those who do
    assert orch.delivery.topic_receivers({"a": ["c0"], "c": ["c1"]}, ["c0", "c1"]) == {"c1": {"c"}}


def test_a_device_saying_hello_again_must_confirm_its_topic_again(server_transport):
    broker = MemoryBroker()
    server = server_transport(broker, federation=FED)
    server.connect()
    template = {"w": np.zeros(2, np.float32)}
    strategy = SketchClustered()
    orch = Orchestrator(strategy, server, ServerConfig(federation=FED, architecture=ARCH), template=template)
    hello = Message(Kind.HELLO, FED, "c1", 0, {"n_samples": 10, "capabilities": ["train-torch"]})
    orch.link.handle_safely("t", hello)
    strategy.setup([orch.clients["c1"].info], template)
    strategy.set_assignment({"c1": 0})
    orch.intake.run.enter(Phase.TRAIN, rnd=0)
    ack = Message(Kind.STATUS, FED, "c1", 0, {"state": "online", "follow": ["c0"]})

    def last_assign():
        return [decode_message(p).meta for t, p in broker.log if t.endswith("/c1/cmd")
                and decode_message(p).meta.get("op") == "assign"][-1]

    orch.assignments.assign("c1", "c0")
    assert last_assign() == {"op": "assign", "model_key": "c0", "follow": ["c0"]}
    assert orch.delivery.pending == {"c1"} and orch.delivery.topic_receivers({"c1": ["c0"]}, ["c0"]) == {}
    orch.link.handle_safely("t", ack)
    assert not orch.delivery.pending and orch.delivery.topic_receivers({"c1": ["c0"]}, ["c0"]) == {"c0": {"c1"}}
    n = len(broker.log)
    orch.assignments.assign("c1", "c0")  # confirmed already: no follow to change
    assert last_assign() == {"op": "assign", "model_key": "c0"} and len(broker.log) == n + 1
    # restarted (every model) or reconnected (its own): the server cannot tell, and waits for a confirmation
    orch.link.handle_safely("t", hello)
    assert last_assign() == {"op": "assign", "model_key": "c0", "follow": ["c0"]}
    assert orch.delivery.pending == {"c1"} and orch.delivery.topic_receivers({"c1": ["c0"]}, ["c0"]) == {}
    orch.link.handle_safely("t", Message(Kind.STATUS, FED, "c1", 0, {"state": "offline"}))
    assert not orch.delivery.pending  # nobody waits for an offline device
    orch.link.handle_safely("t", ack)
    assert orch.delivery.follow["c1"].confirmed


# -- traffic, in memory ----------------------------------------------------------------------


def _run(digits12, start_edge_clients, server_transport, **kw):
    broker = MemoryBroker()
    threads, edges = start_edge_clients(broker, digits12, FED, architecture=ARCH)
    server = server_transport(broker, federation=FED)
    server.connect()
    strategy = SketchClustered(settings=TrainSettings(epochs=1, lr=1e-2, batch_size=16), min_cluster_size=3,
                               fraction=kw.pop("fraction", 1.0))
    base = dict(federation=FED, rounds=2, min_clients=12, register_timeout_s=20, sketch_timeout_s=20,
                round_timeout_s=30, eval_timeout_s=20, encoder="digits_encoder", architecture=ARCH, seed=0)
    result = Orchestrator(strategy, server, ServerConfig(**{**base, **kw})).run()
    for th in threads:
        th.join(timeout=30)
    return result, edges, broker


def _published(broker):
    """(topic, op or MODEL key) of every publication, decoded."""
    out = []
    for topic, payload in broker.log:
        msg = decode_message(payload)
        out.append((topic, msg.meta.get("op") if msg.kind == Kind.CMD else msg.kind.name))
    return out


def test_sampled_rounds_go_per_device_and_the_evaluation_once_per_cluster(digits12, start_edge_clients, server_transport):
    result, edges, broker = _run(digits12, start_edge_clients, server_transport, fraction=0.5)
    topics = Topics("fedsketch", FED)
    k = len(set(result.assignment.values()))
    assert k == 4
    # 2 of each cluster's 3 devices train per round: the third follows the topic and needs nothing
    for h in result.history:
        assert h["tasked"] == 8 and h["deliveries"] == {"cluster_topic": 0, "per_device": 8}
    assert result.final["deliveries"] == {"cluster_topic": k, "per_device": 0}
    assert result.final["asked"] == result.final["evaluated"] == 12
    # every device downloaded exactly what it needed: a model per round it trained, one to evaluate
    for e in edges:
        assert e.transport.stats()["received"]["MODEL"]["messages"] == e.handled.get("train", 0) + 1, e.cid
        assert e.followed == {topics.model(f"c{result.assignment[e.cid]}")}
    got = sum(e.transport.stats()["received"]["MODEL"]["bytes"] for e in edges)
    assert got == result.delivered["MODEL"]
    pubs = _published(broker)
    on_clusters = [t for t, what in pubs if "/clusters/" in t]
    assert sorted(on_clusters) == sorted({topics.model(f"c{j}") for j in range(k)})  # once each, all at the end
    # the same command for everyone goes once: the sketch request and the evaluation
    for op in ("sketch", "evaluate"):
        assert [t for t, what in pubs if what == op] == [topics.broadcast()], op
    assert not result.rejected


def test_eval_fraction_asks_the_sample_and_waits_for_it_only(digits12, start_edge_clients, server_transport):
    result, edges, broker = _run(digits12, start_edge_clients, server_transport, rounds=1, eval_fraction=0.5)
    final = result.final
    assignment = result.assignment
    sampled = {c for c in assignment if in_sample(c, 0.5, 0)}
    extra = set()
    for j in set(assignment.values()):  # a cluster the sample missed: its device of the smallest point
        members = [c for c in assignment if assignment[c] == j]
        if not sampled & set(members):
            extra.add(min(members, key=lambda c: sample_point(c, 0)))
    expected = sampled | extra
    assert 0 < len(sampled) < 12
    assert set(final["per_client"]) == expected
    assert final["asked"] == final["evaluated"] == len(expected) and final["eval_fraction"] == 0.5
    assert {f"c{assignment[c]}" for c in expected} == set(final["per_model"])  # every cluster evaluated
    assert final["commands"] == {"broadcast": 1, "per_device": len(extra)}
    for e in edges:
        asked = e.cid in expected
        sent = e.transport.stats()["sent"].get("METRICS", {}).get("messages", 0)
        assert sent == int(asked), e.cid
        # a device outside the sample gets the broadcast, ignores it, and downloads no model for it
        assert e.handled.get("evaluate", 0) >= 1
        assert e.transport.stats()["received"]["MODEL"]["messages"] == e.handled.get("train", 0) + int(asked)
    assert sum(e.transport.stats()["received"]["MODEL"]["bytes"] for e in edges) == result.delivered["MODEL"]
    pubs = _published(broker)
    topics = Topics("fedsketch", FED)
    assert sorted(t for t, what in pubs if what == "evaluate") == sorted(
        [topics.broadcast()] + [topics.cmd(c) for c in extra])
    assert not result.rejected


# -- the device's side --------------------------------------------------------------------------


def _device(broker, cid="c1"):
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images[:40] / 16.0).astype(np.float32)
    worker = LocalWorker(cid, x, d.target[:40], x[:10], d.target[:10], architecture=ARCH, seed=0)
    return EdgeClient(MemoryTransport(broker, cid, federation=FED), worker, federation=FED, seed=0,
                      model_timeout_s=0.2)


def _deliver_cmd(ec, topic, meta, rnd=0):
    """A command as the device's transport hands it over, then handled."""
    ec.link.on_command(topic, Message(Kind.CMD, FED, "server", rnd, meta))
    return ec.handle(ec.link.commands.get_nowait())


def test_device_follows_its_cluster_topic_and_ignores_broadcasts_not_for_it(caplog, server_transport):
    broker = MemoryBroker()
    topics = Topics("fedsketch", FED)
    watcher = MemoryTransport(broker, "watch", federation=FED)
    seen = []
    watcher.subscribe(topics.all_clients("status"), lambda t, m: seen.append(m.meta))
    watcher.subscribe(topics.all_clients("metrics"), lambda t, m: seen.append(m.meta))
    watcher.subscribe(topics.all_clients("sketch"), lambda t, m: seen.append("sketch"))
    watcher.connect()
    ec = _device(broker)
    ec.start()
    seen.clear()
    assert ec.followed == {topics.model("+")}
    with caplog.at_level(logging.DEBUG, logger="edge_sdk.client"):
        # not admitted yet: a sketch request for admitted devices is not for it
        assert _deliver_cmd(ec, topics.broadcast(), {"op": "sketch", "num_classes": 10})
        # nothing assigned: an evaluation of the assigned devices is not for it
        assert _deliver_cmd(ec, topics.broadcast(), {"op": "evaluate", "round": 3}, 3)
        assert seen == []
        assert "not admitted yet, ignored" in caplog.text and "none assigned here, ignored" in caplog.text
        assert _deliver_cmd(ec, topics.cmd("c1"), {"op": "assign", "model_key": "c1", "follow": ["c1"]})
        assert ec.model_key == "c1" and ec.followed == {topics.model("c1")}
        assert seen == [{"state": "online", "follow": ["c1"]}]  # the confirmation
        assert {f for f, _ in ec.transport._inbox.filters()} == {topics.cmd("c1"), topics.broadcast(),
                                                                  topics.server_status(), topics.model("c1")}
        server = server_transport(broker, federation=FED)
        server.connect()
        body = tensors_body({"w": np.zeros(4, np.float32)})
        for key in ("c0", "c1", "c2"):
            server.publish(topics.model(key), Message(Kind.MODEL, FED, "server", 3, {"key": key}, body))
        assert ec.transport.stats()["received"]["MODEL"]["messages"] == 1 and set(ec.store.keys()) == {"c1"}
        # in no sample of fraction 0: ignored, nothing evaluated, nothing sent
        assert _deliver_cmd(ec, topics.broadcast(), {"op": "evaluate", "round": 3, "fraction": 0.0, "seed": 1}, 3)
        assert "not in the sample of 0, ignored" in caplog.text
        assert len(seen) == 1
        # following every model again, as told
        assert _deliver_cmd(ec, topics.cmd("c1"), {"op": "assign", "model_key": "c1", "follow": ["+", "c1"]})
        assert ec.followed == {topics.model("+")} and seen[-1] == {"state": "online", "follow": ["+"]}
        # a hello (a new run, a reconnection) is said while following every model: no confirmation needed
        assert _deliver_cmd(ec, topics.cmd("c1"), {"op": "assign", "model_key": "c1", "follow": ["c1"]})
        assert ec.followed == {topics.model("c1")}
        watcher.subscribe(topics.all_clients("hello"), lambda t, m: seen.append(
            ("hello", {f for f, _ in ec.transport._inbox.filters()})))
        n = len(seen)
        assert _deliver_cmd(ec, topics.broadcast(), {"op": "hello"})
        assert ec.followed == {topics.model("+")}
        assert ("hello", {topics.cmd("c1"), topics.broadcast(), topics.server_status(), topics.model("+")}) in seen[n:]
        assert not any(isinstance(m, dict) and "follow" in m for m in seen[n:])
    ec.transport.close()


def test_a_fleet_registering_logs_the_first_admissions_then_the_count(caplog, server_transport):
    import logging

    from server_kit.drivers.fleet import ADMISSIONS_LOGGED

    broker = MemoryBroker()
    server = server_transport(broker, federation=FED)
    server.connect()
    n = ADMISSIONS_LOGGED + 10
    config = ServerConfig(federation=FED, rounds=1, min_clients=n, register_timeout_s=30,
                          encoder="digits_encoder", architecture=ARCH, seed=0)
    orch = Orchestrator(SketchClustered(min_cluster_size=2, seed=0), server, config,
                        template={"w": np.zeros((2, 3), np.float32)})
    hello = {"n_samples": 10, "capabilities": ["train-torch"], "input_shape": [8, 8]}
    for i in range(n):
        orch.link.inbox.put_nowait((FED, Message(Kind.HELLO, FED, f"d{i:03d}", 0, hello)))
    with caplog.at_level(logging.DEBUG, logger="server_kit.drivers"):
        register(orch.parts, orch.config, orch.run_id)
    admitted = [r for r in caplog.records if "admitted (10 samples" in r.getMessage()]
    assert [r.levelno for r in admitted] == [logging.INFO] * ADMISSIONS_LOGGED + [logging.DEBUG] * 10
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert info.count("more clients are registering: each one logged at DEBUG (-v), the count when "
                      "registration closes") == 1
    assert f"registration closed: {n} clients admitted ({n} train)" in info
