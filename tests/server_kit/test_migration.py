"""Drift decisions (server_kit/clustering/migration.py) on sketches made with the real bit quantisation.

A fleet: 4 groups x 25 devices, each device's class means its group's
prototype (10 classes x latent 20) plus its own noise, sketched to 200 bits
with P = 0.1 and its own flip key (:func:`edge_sdk.bits.quantize_pack`, what
``Sketcher.sketch_vectors`` calls). Prototype 4 is one nobody had.
"""

from __future__ import annotations

import json
import math
import re
from functools import cache

import numpy as np
import pytest
from sklearn.metrics import adjusted_rand_score

from edge_sdk.bits import quantize_pack
from edge_sdk.drift import noise_margin_bits
from edge_sdk.sketch import Sketch
from server_kit.clustering.migration import POOLED, Decision, Migration, group_pool, loo_distances

P, N_CLASSES, LATENT = 0.1, 10, 20
N_BITS = N_CLASSES * LATENT
GROUPS, PER_GROUP = 4, 25
DEVICE_SD, SAMPLING_SD = 0.05, 0.02
TRUTH = np.repeat(np.arange(GROUPS), PER_GROUP)
CIDS = [f"d{i:03d}" for i in range(GROUPS * PER_GROUP)]


def _sketch(vectors: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    return np.stack([quantize_pack(v, P, int(s)) for v, s in zip(vectors, seeds)])


@cache
def _fleet(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Prototypes (6), the devices' class means, their flip keys and their sketches as clustered."""
    rng = np.random.default_rng(seed)
    protos = rng.random((6, N_CLASSES, LATENT))
    vectors = protos[TRUTH] + rng.normal(0.0, DEVICE_SD, (TRUTH.size, N_CLASSES, LATENT))
    seeds = 10_000 * (seed + 1) + np.arange(TRUTH.size)
    return protos, vectors, seeds, _sketch(vectors, seeds)


def _migration(seed: int = 0) -> Migration:
    return Migration.from_labels(_fleet(seed)[3], TRUTH, N_BITS, flip_prob=P)


def _decide_all(mig: Migration, packed: np.ndarray, current: np.ndarray) -> list[Decision]:
    return [mig.decide(c, row, int(k)) for c, row, k in zip(CIDS, packed, current)]


def _drifted(seed: int, who: np.ndarray, proto: int) -> np.ndarray:
    """The fleet's sketches with devices ``who`` given prototype ``proto`` (their own keys, fresh noise)."""
    protos, vectors, seeds, packed = _fleet(seed)
    rng = np.random.default_rng(seed + 100)
    out = packed.copy()
    out[who] = _sketch(protos[proto] + rng.normal(0.0, DEVICE_SD, (who.size, N_CLASSES, LATENT)), seeds[who])
    return out


def test_radius_is_the_largest_leave_one_out_distance_plus_the_flip_margin():
    mig = _migration()
    bits = np.unpackbits(_fleet(0)[3], axis=1)[:, :N_BITS].astype(float)
    for k in range(GROUPS):
        b = bits[TRUTH == k]
        brute = [np.sum((b[i] - np.delete(b, i, axis=0).mean(axis=0)) ** 2) for i in range(len(b))]
        np.testing.assert_allclose(loo_distances(b), brute)
        assert mig.radius(k) == pytest.approx(max(brute) + noise_margin_bits(N_BITS, P, 4.0))
        np.testing.assert_allclose(mig.centroid(k), b.mean(axis=0))
        assert mig.size(k) == PER_GROUP
    assert mig.margin == pytest.approx(4.0 * math.sqrt(200 * 0.18 * 0.82))  # 21.7 bits
    assert [round(mig.radius(k), 1) for k in mig.clusters] == [49.9, 53.0, 51.7, 48.5]
    one = Migration({7: _fleet(0)[3][:1]}, N_BITS)  # one member: the margin alone
    assert one.radius(7) == pytest.approx(one.margin) and one.clusters == [7]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unchanged_data_resketched_stays(seed):
    protos, vectors, seeds, packed = _fleet(seed)
    again = _sketch(vectors, seeds)
    np.testing.assert_array_equal(again, packed)  # the flip key is the device's: the same bits
    decisions = _decide_all(_migration(seed), again, TRUTH)
    assert [d.action for d in decisions] == ["stay"] * TRUTH.size
    # a member as clustered is inside by construction, with room to spare
    assert max(d.distance_current - d.radius_current for d in decisions) < -23.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fresh_data_of_the_own_group_stays_over_many_resketches(seed):
    protos, vectors, seeds, _ = _fleet(seed)
    mig, rng = _migration(seed), np.random.default_rng(seed + 7)
    worst = -math.inf
    for _ in range(5):  # 500 re-sketches per seed, sampling noise on every class mean
        fresh = _sketch(vectors + rng.normal(0.0, SAMPLING_SD, vectors.shape), seeds)
        decisions = _decide_all(mig, fresh, TRUTH)
        assert [d.action for d in decisions] == ["stay"] * TRUTH.size
        worst = max(worst, max(d.distance_current - d.radius_current for d in decisions))
    # a whole new draw of each device from its group (a 26th member) stays as well
    new = _sketch(protos[TRUTH] + rng.normal(0.0, DEVICE_SD, vectors.shape), seeds)
    assert {d.action for d in _decide_all(mig, new, TRUTH)} == {"stay"}
    assert worst < -20.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_devices_that_take_another_groups_data_move_to_its_cluster(seed):
    who = np.arange(15)  # 15 devices of group 0 take group 1's prototype
    decisions = _decide_all(_migration(seed), _drifted(seed, who, 1), TRUTH)
    moved = {d.cid: d.target for d in decisions if d.action == "move"}
    assert moved == {CIDS[i]: 1 for i in who}
    assert sum(d.action == "stay" for d in decisions) == TRUTH.size - 15
    for d in decisions[:15]:
        assert (d.current, d.nearest, d.target) == (0, 1, 1)
        assert d.distance_current > d.radius_current + 10.0 and d.distance_nearest < d.radius_nearest - 18.0


def test_devices_with_data_nobody_had_pool_then_form_a_new_cluster():
    who = np.arange(50, 62)  # 12 devices of group 2 take prototype 4
    packed = _drifted(0, who, 4)
    mig = _migration()
    decisions = _decide_all(mig, packed, TRUTH)
    assert [d.cid for d in decisions if d.action == "pool"] == [CIDS[i] for i in who]
    assert {d.action for i, d in enumerate(decisions) if i not in who} == {"stay"}
    assert min(min(d.distance_current - d.radius_current, d.distance_nearest - d.radius_nearest)
               for d in decisions if d.action == "pool") > 10.0

    pool = {CIDS[i]: packed[i] for i in who}
    groups = group_pool(pool, N_BITS, min_cluster_size=5)
    assert groups == [sorted(pool)]
    found = [next(g for g, grp in enumerate(groups) if c in grp) for c in sorted(pool)]
    assert adjusted_rand_score([0] * 12, found) == 1.0
    assert group_pool(pool, N_BITS, min_cluster_size=13) == []

    k = mig.add_cluster(packed[who])
    assert k == 4 and mig.clusters == [0, 1, 2, 3, 4]
    mig.set_members(2, packed[np.setdiff1d(np.flatnonzero(TRUTH == 2), who)])
    assert mig.size(2) == 13
    assert {mig.decide(CIDS[i], packed[i], 4).action for i in who} == {"stay"}
    back = mig.decide("late", packed[who[0]], POOLED)  # a pooled device that fits it now moves in
    assert (back.action, back.target, back.current, back.distance_current, back.radius_current) == \
        ("move", 4, POOLED, math.inf, 0.0)
    assert back.as_dict()["distance_current"] is None and json.dumps(back.as_dict())


def test_group_pool_separates_two_new_kinds_and_drops_strays():
    protos, _, _, _ = _fleet(0)
    rng = np.random.default_rng(5)
    truth = np.repeat([0, 1], 12)
    new = _sketch(protos[4 + truth] + rng.normal(0.0, DEVICE_SD, (24, N_CLASSES, LATENT)), 500 + np.arange(24))
    pool = {f"p{i:02d}": row for i, row in enumerate(new)}
    groups = group_pool(pool, N_BITS, min_cluster_size=5, random_state=0)
    assert groups == [[f"p{i:02d}" for i in range(12)], [f"p{i:02d}" for i in range(12, 24)]]
    assert adjusted_rand_score(truth, [0 if c in groups[0] else 1 for c in sorted(pool)]) == 1.0

    # fewer than 2 * min_cluster_size: one group, strays included, unless max_radius trims them
    strays = _sketch(rng.random((3, N_CLASSES, LATENT)), 900 + np.arange(3))
    small = {**{f"p{i:02d}": new[i] for i in range(12)}, **{f"s{i}": s for i, s in enumerate(strays)}}
    assert group_pool(small, N_BITS, min_cluster_size=10) == [sorted(small)]
    mig = _migration()
    assert group_pool(small, N_BITS, min_cluster_size=10, max_radius=mig.max_radius) == \
        [[f"p{i:02d}" for i in range(12)]]
    assert group_pool(small, N_BITS, min_cluster_size=13, max_radius=mig.max_radius) == []
    assert group_pool({}, N_BITS, min_cluster_size=2) == []


def test_inside_its_own_radius_a_device_stays_even_when_another_cluster_is_nearer():
    packed = _fleet(0)[3]
    mig = Migration({0: packed[:25], 1: packed[25:50], 9: packed[3:4]}, N_BITS)  # 9: device 3 alone
    d = mig.decide(CIDS[3], packed[3], 0)
    assert (d.action, d.target, d.nearest, d.distance_nearest) == ("stay", None, 9, 0.0)
    assert d.distance_nearest < d.distance_current <= d.radius_current
    pooled = mig.decide(CIDS[3], packed[3], POOLED)  # from the pool: the nearest cluster that holds it
    assert (pooled.action, pooled.target) == ("move", 9)
    other = mig.decide(CIDS[4], packed[4], 1)  # group 0's device filed under 1: back to 0, not to 9
    assert (other.action, other.target, other.nearest) == ("move", 0, 0)
    assert other.distance_current > other.radius_current


def test_retired_cluster_is_never_a_target_and_ids_are_not_reused():
    who = np.arange(15)
    packed = _drifted(0, who, 1)
    mig = _migration()
    mig.retire(1)
    assert mig.clusters == [0, 2, 3] and mig.retired == [1]
    decisions = _decide_all(mig, packed[TRUTH != 1], TRUTH[TRUTH != 1])
    assert [d.cid for d in decisions if d.action == "pool"] == [CIDS[i] for i in who]
    assert all(d.target != 1 and d.nearest != 1 for d in decisions)
    assert mig.add_cluster(packed[who]) == 4  # not 1
    assert {mig.decide(CIDS[i], packed[i], 0).target for i in who} == {4}


def test_state_round_trip_gives_identical_decisions():
    who = np.arange(50, 62)
    packed = _drifted(0, who, 4)
    mig = _migration()
    mig.retire(3)
    mig.add_cluster(packed[who])
    meta, tensors = mig.state()
    assert sorted(tensors) == ["centroids", "radii"] and tensors["centroids"].shape == (4, N_BITS)
    restored = Migration.from_state(json.loads(json.dumps(meta)), {k: v.copy() for k, v in tensors.items()})
    assert restored.clusters == [0, 1, 2, 4] and restored.retired == [3]
    for current in (0, 2, 4, POOLED):
        assert _decide_all(restored, packed, [current] * TRUTH.size) == _decide_all(mig, packed, [current] * 100)
    assert restored.add_cluster(packed[:3]) == 5
    assert repr(restored) == "Migration(n_bits=200, flip_prob=0.1, z=4.0, clusters=[0, 1, 2, 4, 5], retired=[3])"


def test_sketch_objects_and_bytes_are_accepted():
    mig, packed = _migration(), _fleet(0)[3]
    as_sketch = Sketch(packed[0].tobytes(), N_CLASSES, LATENT, P)
    assert mig.decide("a", as_sketch, 0) == mig.decide("a", packed[0].tobytes(), 0) == mig.decide("a", packed[0], 0)
    assert mig.unseen_drifts() == []
    close = Migration({0: packed[:25], 1: packed[25:50], 2: packed[:20]}, N_BITS)  # 2 lies inside 0
    assert (0, 2) in close.unseen_drifts() and (2, 0) in close.unseen_drifts()


def _raises(message: str, call, *args, **kw) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        call(*args, **kw)


def test_bad_input_is_refused_with_clear_messages():
    packed = _fleet(0)[3]
    mig = _migration()
    _raises("n_bits must be an integer >= 1, got 0", Migration, {0: packed}, 0)
    _raises("flip_prob must be a finite number, got nan", Migration, {0: packed}, N_BITS, flip_prob=math.nan)
    _raises("flip_prob must be <= 0.5, got 0.6", Migration, {0: packed}, N_BITS, flip_prob=0.6)
    _raises("z must be a positive number, got 0", Migration, {0: packed}, N_BITS, z=0)
    _raises("members must map at least one cluster id to its packed sketches", Migration, {}, N_BITS)
    _raises("cluster id must be an integer >= 0, got -1", Migration, {-1: packed}, N_BITS)
    _raises("cluster 0 has no members: retire it instead", Migration, {0: packed[:0]}, N_BITS)
    _raises("packed rows hold 25 bytes; 201 bits need 26", Migration, {0: packed}, 201)
    _raises("labels must be 100 integers (one per sketch), got int64 (99,)", Migration.from_labels,
            packed, TRUTH[:99], N_BITS)
    _raises("labels must be cluster ids >= 0, got -1", Migration.from_labels, packed, TRUTH - 1, N_BITS)
    _raises("packed must be one sketch of 25 uint8 bytes (200 bits), got uint8 (24,)", mig.decide, "a",
            packed[0, :24], 0)
    _raises("packed must be one sketch of 25 uint8 bytes (200 bits), got int64 (25,)", mig.decide, "a",
            packed[0].astype(np.int64), 0)
    _raises("the sketch has 180 bits; the clusters have 200", mig.decide, "a", Sketch(bytes(23), 9, 20), 0)
    _raises("unknown cluster 9: live clusters are [0, 1, 2, 3]", mig.decide, "a", packed[0], 9)
    _raises("current must be an integer >= -1, got -2", mig.decide, "a", packed[0], -2)
    _raises("current must be an integer >= -1, got 1.0", mig.decide, "a", packed[0], 1.0)
    _raises("cid must be a non-empty string, got 3", mig.decide, 3, packed[0], 0)
    mig.retire(2)
    _raises("cluster 2 is retired", mig.decide, "a", packed[0], 2)
    _raises("cluster 2 is retired", mig.set_members, 2, packed[:3])
    _raises("cluster 2 is retired", mig.retire, 2)
    _raises("migration state must be version 1, got None", Migration.from_state, {}, {})
    meta, tensors = mig.state()
    _raises("migration state lacks ['radii']", Migration.from_state, meta, {"centroids": tensors["centroids"]})
    _raises("migration state holds 3 clusters but centroids (2, 200), radii (3,) and 3 sizes",
            Migration.from_state, meta, {**tensors, "centroids": tensors["centroids"][:2]})
    _raises("migration state: centroids must be mean bits in [0, 1] and radii finite and >= 0",
            Migration.from_state, meta, {**tensors, "radii": -tensors["radii"]})
    _raises("min_cluster_size must be an integer >= 1, got 0", group_pool, {}, N_BITS, min_cluster_size=0)
    _raises("max_radius must be >= 0.0, got -1.0", group_pool, {}, N_BITS, min_cluster_size=2, max_radius=-1.0)
    _raises("pool's device ids must be strings", group_pool, {1: packed[0]}, N_BITS, min_cluster_size=1)
    _raises("pool's sketches must be 1-D packed rows (one sketch per device)", group_pool,
            {"a": packed[:2]}, N_BITS, min_cluster_size=1)
    _raises("leave-one-out distances need a 2-D array of at least 2 rows, got shape (1, 200)", loo_distances,
            np.zeros((1, 200)))
