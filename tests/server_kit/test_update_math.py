"""Distances of client updates, chunk by chunk, against the stacked brute force; the UpdateClustered life cycle."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from scipy.spatial.distance import cdist

from edge_sdk.tasks import Update
from server_kit.clustering.updates import (
    clustering_temperature,
    cosine_distances_from_gram,
    delta_gram,
    delta_l1_distances,
    euclidean_distances_from_gram,
    mean_update_norm,
    update_norms,
)
from server_kit.strategies.base import ClientInfo
from server_kit.strategies.update_clustered import UpdateClustered


@pytest.fixture
def deltas():
    rng = np.random.default_rng(0)
    ref = {"a": rng.normal(size=(30, 20)).astype(np.float32), "b": rng.normal(size=7).astype(np.float32),
           "steps": np.array(3, np.int64)}
    ups = [{k: (v + rng.normal(size=v.shape).astype(np.float32) if v.dtype.kind == "f" else v + 1)
            for k, v in ref.items()} for _ in range(6)]
    stacked = np.stack([np.concatenate([(u[k].astype(np.float64) - ref[k]).ravel() for k in ("a", "b")])
                        for u in ups])
    return ref, ups, stacked


@pytest.mark.parametrize("chunk", [1, 33, 1 << 18])
def test_chunked_gram_and_l1_equal_the_stacked_brute_force(deltas, chunk):
    ref, ups, m = deltas  # the integer buffer "steps" is left out of both
    g = delta_gram(ups, ref, chunk=chunk)
    np.testing.assert_allclose(g, m @ m.T, rtol=1e-12)
    np.testing.assert_allclose(delta_l1_distances(ups, ref, chunk=chunk), cdist(m, m, "cityblock"), rtol=1e-12)
    np.testing.assert_allclose(cosine_distances_from_gram(g), cdist(m, m, "cosine"), atol=1e-12)
    np.testing.assert_allclose(euclidean_distances_from_gram(g), cdist(m, m), atol=1e-9)
    np.testing.assert_allclose(update_norms(g), np.linalg.norm(m, axis=1))
    w = np.arange(1, 7, dtype=float)
    np.testing.assert_allclose(mean_update_norm(g, w), np.linalg.norm(w @ m / w.sum()))


def test_temperature_of_hand_made_distances():
    assert clustering_temperature(np.zeros((4, 4))) == 0.0
    d = 2.0 * (1 - np.eye(3))  # all updates opposite: the maximum
    assert clustering_temperature(d) == pytest.approx(1.0)
    d = np.array([[0, 1.0], [1.0, 0]])  # ||D||_F = sqrt(2), sqrt(4 * 2 * 1) = sqrt(8)
    assert clustering_temperature(d) == pytest.approx(0.5)


def test_zero_update_is_at_cosine_distance_one(deltas):
    ref, ups, _ = deltas
    ups = [dict(ref)] + ups[:2]
    d = cosine_distances_from_gram(delta_gram(ups, ref))
    np.testing.assert_allclose(d[0, 1:], 1.0)
    assert d[0, 0] == 0.0


def test_bad_updates_are_named(deltas):
    ref, ups, _ = deltas
    bad = {k: v.copy() for k, v in ups[1].items()}
    bad["b"][2] = np.nan
    with pytest.raises(ValueError, match=r"update 1: tensor 'b' holds NaN or Inf"):
        delta_gram([ups[0], bad], ref)
    with pytest.raises(ValueError, match=r"update 0: tensor 'a' has shape \(20, 30\), expected \(30, 20\)"):
        delta_gram([{**ups[0], "a": ups[0]["a"].T}], ref)
    with pytest.raises(ValueError, match="update 0 has no tensor 'b'"):
        delta_gram([{"a": ups[0]["a"]}], ref)


class SignSplit(UpdateClustered):
    """Clusters by the sign of the first delta value, at round 2 (or when forced)."""

    name = "sign-split"

    def decide(self, rnd, updates, reference, force):
        if rnd < 2 and not force:
            return None
        return [int(u.weights["x"][0] > reference["x"][0]) * 7 for u in updates]  # labels 0 and 7


def _w(v):
    return {"x": np.array([v, 0.0], np.float32)}


def test_update_clustered_warms_up_then_children_inherit_the_global_model(caplog):
    s = SignSplit(max_warmup_rounds=5)
    s.setup([ClientInfo(c, 10) for c in "abcde"], _w(0.0))
    tasks = s.configure_round(1, list("abcde"))
    assert [t.cid for t in tasks] == list("abcde") and all(set(t.models) == {"global"} for t in tasks)
    s._combine(1, [Update(c, 1, "global", _w(v), 10, 0.0) for c, v in zip("abcd", (1, 1, -1, -1))])
    assert not s.clustered and s.models["global"]["x"][0] == 0.0
    with caplog.at_level(logging.WARNING):
        summary = s._combine(2, [Update(c, 2, "global", _w(v), 10, 0.0) for c, v in
                                        zip("abcd", (1, 3, -1, -1))])
    assert summary["clusters"] == 2 and s.cluster_round_ == 2
    assert s.clusters() == {"a": 0, "b": 0, "c": 1, "d": 1, "e": 0}  # e sent nothing: largest, ties to the first
    assert "client e sent no update in round 2" in caplog.text
    np.testing.assert_allclose(s.models["c0"]["x"], s.models["c1"]["x"])  # both inherit the averaged model
    assert s.models["c0"]["x"][0] == pytest.approx(0.5)
    meta, tensors = s.state()
    t = SignSplit(max_warmup_rounds=5)
    t.setup([ClientInfo(c, 10) for c in "abcde"], _w(0.0))
    t.load_state(meta, tensors)
    assert t.clusters() == s.clusters() and t.cluster_round_ == 2


def test_update_clustered_ignores_a_nan_update_for_clustering(caplog):
    s = SignSplit(max_warmup_rounds=1)
    s.setup([ClientInfo(c, 10) for c in "ab"], _w(0.0))
    bad = _w(1.0)
    bad["x"][1] = np.nan
    with caplog.at_level(logging.WARNING):
        s._combine(1, [Update("a", 1, "global", bad, 10, 0.0), Update("b", 1, "global", _w(1), 10, 0.0)])
    assert "update of a not used for clustering" in caplog.text
    assert s.clusters() == {"a": 0, "b": 0}


@pytest.mark.parametrize(("kw", "message"), [
    ({"max_warmup_rounds": 0}, "max_warmup_rounds must be an integer >= 1, got 0"),
    ({"warmup_fraction": 0.0}, r"warmup_fraction must be > 0.0, got 0.0"),
    ({"warmup_fraction": 1.5}, r"warmup_fraction must be <= 1.0, got 1.5"),
])
def test_update_clustered_refuses_bad_settings(kw, message):
    with pytest.raises(ValueError, match=message):
        SignSplit(**kw)
