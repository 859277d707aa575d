"""A device's compressed updates: the delta from the version it holds, its error feedback, its state folder."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.client import EdgeClient
from edge_sdk.compress import Compression, Method, chain_body, decode_delta, encode_delta
from edge_sdk.compress.steps import Step
from edge_sdk.protocol import SERVER_ID, Kind, Message, ProtocolError, tensors_body
from edge_sdk.protocol.commands import Op, build
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker

from helpers import ARCH, model_digest

FED = "squeeze"


def device(state_dir=None) -> tuple[EdgeClient, list[Message]]:
    rng = np.random.default_rng(0)
    w = LocalWorker("c1", rng.random((20, 8, 8), dtype=np.float32), np.arange(20) % 10, architecture=ARCH, seed=0)
    ec = EdgeClient(MemoryTransport(MemoryBroker(), "c1", federation=FED), w, federation=FED, state_dir=state_dir,
                    model_timeout_s=2)
    sent: list[Message] = []
    ec.link.send = lambda topic, kind, rnd=0, meta=None, body=b"": sent.append(Message(kind, FED, "c1", rnd,
                                                                                     dict(meta or {}), body))
    return ec, sent


def template():
    from edge_sdk.training.trainer import initial_weights

    return initial_weights(ARCH, 0)


def model_msg(rnd: int, meta: dict, body: bytes) -> Message:
    return Message(Kind.MODEL, FED, SERVER_ID, rnd, meta, body)


def train(ec: EdgeClient, rnd: int, comp: str) -> None:
    m = build(Op.TRAIN, round=rnd, models=["c0"], epochs=1, lr=1e-2, batch_size=8,
              compress=Compression.parse(comp).to_meta())
    ec.handle(Message(Kind.CMD, FED, SERVER_ID, rnd, {**m, "_via": "cmd"}))


def test_the_update_is_the_compressed_delta_and_the_rest_is_kept_across_a_restart(tmp_path):
    pytest.importorskip("torch")
    w0 = template()
    ec, sent = device(tmp_path)
    ec.link.on_model("t", model_msg(1, {"key": "c0", "version": 4}, tensors_body(w0)))
    train(ec, 1, "topk:0.1")
    (upd,) = [m for m in sent if m.kind == Kind.UPDATE]
    assert upd.meta["version"] == 4 and upd.meta["model_key"] == "c0"
    spec = {n: (v.shape, "float32") for n, v in w0.items()}
    delta = decode_delta(upd.body, spec, Method.TOPK)
    kept = sum(int(np.count_nonzero(d)) for d in delta.values())
    assert 0 < kept <= sum(int(np.ceil(0.1 * v.size)) for v in w0.values())
    assert ec.feedback.residual_norm("c0") > 0 and (tmp_path / "residual.safetensors").is_file()
    # a restarted device reads its feedback back at its first compressed update
    again, _ = device(tmp_path)
    again.link.on_model("t", model_msg(2, {"key": "c0", "version": 5}, tensors_body(w0)))
    train(again, 2, "topk:0.1")
    assert again.state.feedback_read and again.feedback.keys == ["c0"]
    # moved to another cluster: the unsent part of c0 is dropped, on disk too
    again.handle(Message(Kind.CMD, FED, SERVER_ID, 2, {**build(Op.ASSIGN, model_key="c0"), "_via": "cmd"}))
    again.handle(Message(Kind.CMD, FED, SERVER_ID, 2, {**build(Op.ASSIGN, model_key="c1"), "_via": "cmd"}))
    assert again.feedback.keys == []
    fresh, _ = device(tmp_path)
    fresh.state.feedback_read = False
    fresh.load_feedback(Compression.parse("topk:0.1"))
    assert fresh.feedback.keys == []


def test_a_chain_of_changes_brings_the_held_model_to_the_servers_bits():
    w0 = template()
    rng = np.random.default_rng(1)
    comp = Compression.parse("stc:0.2")
    server, steps = dict(w0), []
    for v in range(1, 4):
        body, sent = encode_delta({n: rng.normal(size=a.shape).astype(np.float32) for n, a in w0.items()}, comp)
        server = {n: np.asarray(np.add(server[n], sent[n], dtype=np.float32)) for n in server}
        steps.append(Step(v - 1, v, body))
    ec, _ = device()
    ec.link.on_model("t", model_msg(1, {"key": "c0", "version": 0}, tensors_body(w0)))
    ec.link.on_model("t", model_msg(3, {"key": "c0", "version": 3, "base": 0, "codec": "stc"}, chain_body(steps)))
    held = ec.store.get("c0")
    assert held.version == 3 and held.round == 3 and model_digest(held.weights) == model_digest(server)
    # a chain that starts after the version held is refused, the model kept
    ec.link.on_model("t", model_msg(4, {"key": "c0", "version": 5, "base": 4, "codec": "stc"},
                                chain_body([Step(4, 5, steps[0].body)])))
    assert ec.rejected == {"model-base": 1} and ec.store.get("c0").version == 3
    with pytest.raises(ProtocolError, match="no version of it is held"):
        ec.store.receive("c9", model_msg(5, {"key": "c9", "version": 1, "base": 0, "codec": "stc"},
                                         chain_body(steps[:1])), {"key": "c9", "version": 1, "base": 0,
                                                                  "codec": "stc"})


def test_a_late_copy_of_an_earlier_rounds_model_is_refused_until_the_server_comes_back():
    """A QoS 1 redelivery of round 2's model after round 3's must not replace it (the evaluation waits for 3)."""
    w0 = template()
    w1 = {n: a + 1 for n, a in w0.items()}
    ec, _ = device()
    ec.link.on_model("t", model_msg(3, {"key": "c0"}, tensors_body(w1)))
    ec.link.on_model("t", model_msg(2, {"key": "c0"}, tensors_body(w0)))
    assert ec.rejected == {"model-stale": 1}
    held = ec.store.wait("c0", 3, 0.1)
    assert held.round == 3 and model_digest(held.weights) == model_digest(w1)
    # the run's server goes away and comes back (resumed from a checkpoint of round 1): its models go in again
    for state in ("offline", "online"):
        ec.link.on_server_status("s", Message(Kind.STATUS, FED, SERVER_ID, 0, {"state": state, "run": "r1"}))
    ec.link.on_model("t", model_msg(2, {"key": "c0"}, tensors_body(w0)))
    assert ec.store.get("c0").round == 2 and model_digest(ec.store.get("c0").weights) == model_digest(w0)
    ec.link.on_model("t", model_msg(1, {"key": "c0"}, tensors_body(w1)))  # the rewind lets one model in, not more
    assert ec.rejected == {"model-stale": 2} and ec.store.get("c0").round == 2


def test_a_device_builds_its_free_first_model_keeps_a_current_one_and_asks_for_a_model_it_cannot_apply():
    from edge_sdk.compress import catchup_body
    from edge_sdk.models.portable_init import tensors_sha256

    pytest.importorskip("torch")
    w0 = template()
    ec, sent = device()
    init = {"key": "c0", "version": 0, "init": 0, "architecture": ARCH, "sha256": tensors_sha256(w0)}
    ec.link.on_model("t", model_msg(1, init, b""))
    held = ec.store.get("c0")
    assert held.version == 0 and model_digest(held.weights) == model_digest(w0) and sent == []
    # current: the same weights, now of round 2
    ec.link.on_model("t", model_msg(2, {"key": "c0", "version": 0, "current": True}, b""))
    assert ec.store.get("c0").round == 2 and ec.store.get("c0").weights is held.weights
    # an exact merged catch-up lands on the server's bits
    w3 = {n: (a + np.float32(0.003)).astype(np.float32) for n, a in w0.items()}
    ec.link.on_model("t", model_msg(3, {"key": "c0", "version": 3, "base": 0, "codec": "exact"}, catchup_body(w0, w3)))
    assert ec.store.get("c0").version == 3 and model_digest(ec.store.get("c0").weights) == model_digest(w3)
    # what does not apply to its copy: refused, counted, and the model asked for whole (status "need")
    ec.link.on_model("t", model_msg(4, {"key": "c0", "version": 2, "current": True}, b""))
    ec.link.on_model("t", model_msg(4, {**init, "key": "c1", "sha256": "0" * 64}, b""))
    assert ec.rejected == {"model-base": 1, "model-init": 1} and ec.store.get("c0").version == 3
    assert [(m.kind, m.meta) for m in sent] == [(Kind.STATUS, {"state": "online", "need": ["c0"]}),
                                                (Kind.STATUS, {"state": "online", "need": ["c1"]})]
