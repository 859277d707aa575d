"""Whatever ends a run early, in any phase, is told to the devices before the server exits.

The devices' messages are put straight into the server's inbox (no device
code runs); each phase is made to fail, and the broadcast ``stop`` is read
back from the in-memory broker: ``failed`` true, the phase and the error in
the reason. A device outside ``--stay`` exits 5 on it, with the reason in
its log; a device in ``--stay`` stays.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.client.commands import SERVER_FAILED
from edge_sdk.protocol import Kind, Message, Topics, decode_message, sketch_body
from edge_sdk.protocol.commands import Op, build
from edge_sdk.sketch import Sketch
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.strategies.fedavg import FedAvg
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH

FED = "fail"
CIDS = ["c0", "c1", "c2", "c3"]
HELLO = {"n_samples": 10, "capabilities": ["train-torch"], "input_shape": [8, 8]}


def orchestrator(strategy, **kw):
    broker = MemoryBroker()
    server = MemoryTransport(broker, "server", federation=FED)
    server.connect()
    config = ServerConfig(**{**dict(federation=FED, rounds=1, min_clients=len(CIDS), register_timeout_s=5,
                                    sketch_timeout_s=5, round_timeout_s=0.3, first_round_timeout_s=0.3,
                                    eval_timeout_s=0.3, architecture=ARCH, encoder="digits_encoder", seed=0),
                             **kw})
    orch = Orchestrator(strategy, server, config, template={"w": np.zeros(3, np.float32)})
    for c in CIDS:
        orch.link.inbox.put_nowait((FED, Message(Kind.HELLO, FED, c, 0, HELLO)))
    return orch, broker


def stops(broker) -> list[dict]:
    bc = Topics("fedsketch", FED).broadcast()
    return [m.meta for t, p in broker.log if t == bc and (m := decode_message(p)).meta.get("op") == "stop"]


def failing(*a, **k):
    raise RuntimeError("boom")


def test_registration_that_fails_tells_the_devices():
    orch, broker = orchestrator(FedAvg(seed=0), min_clients=8, register_timeout_s=0.3)  # 4 of 8, quorum 4
    orch.link.inbox.queue.clear()  # nobody at all registers
    with pytest.raises(TimeoutError, match="only 0 of the 8 clients needed registered"):
        orch.run()
    (stop,) = stops(broker)
    assert stop["failed"] is True and stop["reason"].startswith(
        "the server could not finish the run (register phase, round 0): only 0 of the 8 clients")


def test_clustering_that_fails_tells_the_devices(monkeypatch):
    strategy = SketchClustered(seed=0)
    monkeypatch.setattr(strategy, "on_sketches", failing)
    orch, broker = orchestrator(strategy)
    for c in CIDS:
        orch.link.inbox.put_nowait((FED, Message(Kind.SKETCH, FED, c, 0, {}, sketch_body(Sketch(bytes(25), 10, 20)))))
    with pytest.raises(RuntimeError, match="^boom$"):
        orch.run()
    assert stops(broker) == [{"op": "stop", "reason": "the server could not finish the run (cluster phase, round 0): "
                                                      "boom", "failed": True, "run": orch.run_id}]


def test_no_sketch_before_the_deadline_tells_the_devices():
    orch, broker = orchestrator(SketchClustered(seed=0), sketch_timeout_s=0.3)
    with pytest.raises(TimeoutError, match="no sketch arrived before the deadline"):
        orch.run()
    assert [s["reason"] for s in stops(broker)] == [
        "the server could not finish the run (cluster phase, round 0): no sketch arrived before the deadline"]


def test_pretraining_that_fails_tells_the_devices(monkeypatch):
    import server_kit.drivers.orchestrator as module

    strategy = FedAvg(seed=0)
    strategy.capabilities = dataclasses.replace(strategy.capabilities, pretrain={})
    monkeypatch.setattr(module, "pretrain_ae", failing)
    orch, broker = orchestrator(strategy)
    with pytest.raises(RuntimeError, match="^boom$"):
        orch.run()
    assert [s["reason"] for s in stops(broker)] == ["the server could not finish the run (register phase, round 0): "
                                                    "boom"]


def test_a_round_that_fails_tells_the_devices(monkeypatch):
    orch, broker = orchestrator(FedAvg(seed=0), rounds=3)
    monkeypatch.setattr(orch.delivery, "deliver_models", failing)  # round 1 cannot send its models
    with pytest.raises(RuntimeError, match="^boom$"):
        orch.run()
    assert [s["reason"] for s in stops(broker)] == ["the server could not finish the run (train phase, round 1): "
                                                    "boom"]


def test_the_final_evaluation_that_fails_tells_the_devices(monkeypatch):
    import server_kit.drivers.orchestrator as module

    monkeypatch.setattr(module, "final_evaluation", failing)
    orch, broker = orchestrator(FedAvg(seed=0))
    with pytest.raises(RuntimeError, match="^boom$"):
        orch.run()
    assert [s["reason"] for s in stops(broker)] == ["the server could not finish the run (train phase, round 1): "
                                                    "boom"]


def announcements(broker) -> list[dict]:
    st = Topics("fedsketch", FED).server_status()
    return [decode_message(p).meta for t, p in broker.log if t == st]


def test_a_clean_run_ends_with_one_stop_that_did_not_fail():
    orch, broker = orchestrator(FedAvg(seed=0))
    result = orch.run()
    assert stops(broker) == [{"op": "stop", "reason": "finished", "run": result.run_id}]  # the run that ended
    # the run announced on, then off, under its id; not retained (the shipped broker allows none)
    run = result.run_id
    assert announcements(broker) == [{"state": "online", "run": run}, {"state": "offline", "run": run}]
    assert broker.retained(Topics("fedsketch", FED).server_status()) is None


def test_a_failed_run_says_it_is_offline_after_its_stop():
    orch, broker = orchestrator(FedAvg(seed=0), min_clients=8, register_timeout_s=0.3)
    orch.link.inbox.queue.clear()
    with pytest.raises(TimeoutError):
        orch.run()
    assert announcements(broker) == [{"state": "online", "run": orch.run_id}, {"state": "offline", "run": orch.run_id}]


@pytest.mark.parametrize("stay", [False, True])
def test_a_device_exits_5_when_the_server_failed_unless_it_stays(stay, caplog):
    broker = MemoryBroker()
    x = np.zeros((4, 8, 8), np.float32)
    y = np.arange(4)
    device = EdgeClient(MemoryTransport(broker, "c0", federation=FED), LocalWorker("c0", x, y, architecture=ARCH),
                        federation=FED, stay=stay)
    stop = Message(Kind.CMD, FED, "server", 2, build(Op.STOP, reason="no sketch arrived", failed=True))
    with caplog.at_level(logging.ERROR, logger="edge_sdk"):
        assert device.handle(stop) is stay
    assert device.exit_code == (0 if stay else SERVER_FAILED) and SERVER_FAILED == 5
    assert [r.getMessage() for r in caplog.records] == [
        "the server could not finish the run: no sketch arrived" + ("; staying for the next run" if stay else "")]
