"""An aggregator's memory bound: the updates held past it wait on disk, and the partial sum is still FedAvg's, bit
for bit (the in-memory broker: the aggregator's arithmetic and files, not the network, are under test here)."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.protocol import Kind, Message, parse_tensors, tensors_body
from edge_sdk.transport.memory import MemoryBroker, MemoryTransport
from server_kit.aggregate import fedavg
from server_kit.partials.aggregator import PartialAggregator

FED = "hold"
AID = "ingest-0"


def _connected(broker: MemoryBroker, cid: str) -> MemoryTransport:
    t = MemoryTransport(broker, cid, federation=FED)
    t.connect()
    return t


def test_updates_past_the_memory_bound_wait_on_disk_and_sum_to_fedavg_exactly():
    rng = np.random.default_rng(0)
    model = {"w": rng.normal(size=(64, 32)).astype(np.float32), "b": np.zeros(32, np.float32),
             "steps": np.array([3], dtype=np.int64)}
    size = sum(a.nbytes for a in model.values())
    broker = MemoryBroker()
    transport = MemoryTransport(broker, AID, federation=FED)
    agg = PartialAggregator(transport, AID, updates_filter=transport.topics.partition_updates(0),
                            hold_memory_bytes=2 * size)
    agg.start()
    agg.transport.connect()
    server = _connected(broker, "server")
    partials: list[Message] = []
    receipts: list[Message] = []
    server.subscribe(server.topics.aggregator(AID, "partial"), lambda _t, m: partials.append(m))
    server.subscribe(server.topics.aggregator(AID, "receipt"), lambda _t, m: receipts.append(m))
    server.publish(server.topics.aggregation(),
                   Message(Kind.COLLECT, FED, "server", 1, {"round": 1, "model_key": "0"}, tensors_body(model)))
    updates = {}
    for i in range(5):
        cid = f"c{i}"
        w = {k: (v + rng.normal(size=v.shape).astype(v.dtype)) if v.dtype.kind == "f" else v + i
             for k, v in model.items()}
        updates[cid] = (w, 10 + i)
        _connected(broker, cid).publish(server.topics.update(cid, 0), Message(
            Kind.UPDATE, FED, cid, 1, {"round": 1, "model_key": "0", "n_samples": 10 + i}, tensors_body(w)))
    assert [m.meta.get("refused") for m in receipts] == [None] * 5
    assert agg.spilled == 3  # two fit the bound; three wait on disk
    spill_dir = agg._spill.dir
    assert spill_dir is not None and len(list(spill_dir.iterdir())) == 3

    server.publish(server.topics.aggregation(), Message(Kind.FLUSH, FED, "server", 1, {
        "round": 1, "aggregator": AID, "members": {cid: [n, 1.0] for cid, (_, n) in updates.items()}}))
    assert len(partials) == 1
    assert partials[0].meta["members"] == sorted(updates)
    assert partials[0].meta["n_samples"] == sum(n for _, n in updates.values())
    got, want = parse_tensors(partials[0].body), fedavg(list(updates.values()))
    for name in model:
        assert got[name].dtype == want[name].dtype
        np.testing.assert_array_equal(got[name], want[name])
    assert list(spill_dir.iterdir()) == []  # each file deleted once summed
    agg.close()
    assert not spill_dir.exists()


def test_a_negative_memory_bound_is_refused():
    broker = MemoryBroker()
    with pytest.raises(ValueError, match=r"^hold_memory_bytes must be an integer >= 0, got -1$"):
        PartialAggregator(MemoryTransport(broker, AID, federation=FED), AID, hold_memory_bytes=-1)
