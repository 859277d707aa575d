"""The one admission of a round's update, and the one update codec: the reasons both the intake and the workers give."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.compress import Compression, ErrorFeedback
from edge_sdk.compress.update_codec import (
    CompressedDelta,
    InMemoryFeedback,
    WholeWeights,
    update_codec,
    with_delta,
)
from edge_sdk.protocol import ProtocolError
from server_kit.rounds.admission import admit_update

VERSIONS = {"c0": 3}


def admit(meta, *, codec=None, open_round=2, tasked=True, held=False):
    admit_update("d1", {"round": 2, "model_key": "c0", **meta}, open_round=open_round, tasked=tasked,
                 allowed=frozenset({"c0"}), version_of=VERSIONS.get, codec=codec or update_codec("topk:0.5"),
                 held=held)


@pytest.mark.parametrize("meta, kw, reason, text", [
    ({"version": 3}, {"open_round": None}, "stale-update", "update for round 2 (open: None, tasked: True)"),
    ({"round": 1, "version": 3}, {}, "stale-update", "update for round 1 (open: 2, tasked: True)"),
    ({"version": 3}, {"tasked": False}, "stale-update", "update for round 2 (open: 2, tasked: False)"),
    ({"model_key": "c1", "version": 3}, {}, "wrong-model",
     "update for model 'c1' in round 2; this client was sent ['c0']"),
    ({"version": 2}, {}, "wrong-version", "update from model 'c0' version 2; the round's is version 3"),
    ({"version": 3}, {"held": True}, "duplicate-update", "a second update from d1 in round 2"),
])
def test_each_refusal_has_one_reason_and_wording(meta, kw, reason, text):
    with pytest.raises(ProtocolError) as e:
        admit(meta, **kw)
    assert e.value.reason == reason and str(e.value).endswith(text)


def test_whole_weights_name_no_version_and_compressed_deltas_must():
    admit({"version": 3})
    admit({}, codec=update_codec(None))  # whole weights: no version asked
    assert isinstance(update_codec("none"), WholeWeights) and isinstance(update_codec("stc:0.1"), CompressedDelta)
    assert update_codec(None).command_meta == {} and update_codec("int8").command_meta == {
        "compress": Compression.parse("int8").to_meta()}


def test_the_codecs_round_trip_to_the_same_bits():
    rng = np.random.default_rng(0)
    start = {"w": rng.normal(size=(4, 5)).astype(np.float32), "b": rng.normal(size=3).astype(np.float32)}
    trained = {n: (v + rng.normal(size=v.shape) * 0.1).astype(np.float32) for n, v in start.items()}
    spec = {n: (v.shape, "float32") for n, v in start.items()}
    for codec in (update_codec(None), update_codec("int8")):
        device = InMemoryFeedback(ErrorFeedback(codec.compression))
        body, extra, sent = codec.encode("c0", trained, start, 7, device)
        got = codec.weights(codec.decode(body, spec, extra.get("version")), start)
        want = trained if sent is None else with_delta(start, sent)
        assert all(np.array_equal(got[n], want[n]) for n in start)
        assert extra == ({} if sent is None else {"version": 7})
    with pytest.raises(ValueError, match="compressed updates asked, but model 'c0' came without a version"):
        update_codec("int8").encode("c0", trained, start, None, InMemoryFeedback(ErrorFeedback(Compression.parse("int8"))))
