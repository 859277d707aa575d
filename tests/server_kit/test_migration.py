"""Drift decisions (server_kit/clustering/migration.py) on sketches made with the real bit quantisation.

A fleet: 4 groups x 25 devices, each device's class means its group's
prototype (10 classes x latent 20) plus its own noise, sketched to 200 bits
with P = 0.1 and its own flip key (:func:`edge_sdk.bits.quantize_pack`, what
``Sketcher.sketch_vectors`` calls). Prototype 4 is one nobody had.

:class:`Migration` is a pure geometric rule (radius = reach + z sigma; stay,
move to a clearly nearer holding cluster, or pool). The guarantee that unchanged
data never moves lies with the caller
(:class:`~server_kit.strategies.drift.DriftTracker` decides only sketches more
than ``change_bits`` from the device's reference sketch); :data:`CHANGE_BITS` is
that threshold at the tracker's default ``z = 4``.
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
from server_kit.clustering.migration import (
    MIN_REACH_MEMBERS,
    POOLED,
    Decision,
    Migration,
    group_pool,
    loo_distances,
)

P, N_CLASSES, LATENT = 0.1, 10, 20
N_BITS = N_CLASSES * LATENT
GROUPS, PER_GROUP = 4, 25
DEVICE_SD, SAMPLING_SD = 0.05, 0.02
TRUTH = np.repeat(np.arange(GROUPS), PER_GROUP)
CIDS = [f"d{i:03d}" for i in range(GROUPS * PER_GROUP)]
#: A DriftTracker (default z = 4) decides only sketches more than this many bits from the reference one.
CHANGE_BITS = noise_margin_bits(N_BITS, P, 4.0)  # 21.7 bits


def _sketch(vectors: np.ndarray, seeds: np.ndarray) -> np.ndarray:
    return np.stack([quantize_pack(v, P, int(s)) for v, s in zip(vectors, seeds)])


def _bits(packed: np.ndarray) -> np.ndarray:
    return np.unpackbits(packed, axis=1)[:, :N_BITS].astype(float)


def _hamming(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Bits that differ, row by row (what the DriftTracker compares with CHANGE_BITS)."""
    return np.unpackbits(a ^ b, axis=1)[:, :N_BITS].sum(axis=1)


def _sigma(centroid: np.ndarray, p: float = P) -> float:
    return math.sqrt(p * (1.0 - p) * float(np.sum((1.0 - 2.0 * centroid) ** 2)))


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


def test_radius_is_the_largest_leave_one_out_distance_plus_z_sigma_of_flip_noise():
    mig = _migration()
    assert mig.z == 2.0 and not hasattr(mig, "margin")
    bits = _bits(_fleet(0)[3])
    for k in range(GROUPS):
        b = bits[TRUTH == k]
        brute = [np.sum((b[i] - np.delete(b, i, axis=0).mean(axis=0)) ** 2) for i in range(len(b))]
        np.testing.assert_allclose(loo_distances(b), brute)
        assert mig.sigma(k) == pytest.approx(_sigma(b.mean(axis=0)))
        assert mig.radius(k) == pytest.approx(max(brute) + 2.0 * _sigma(b.mean(axis=0)))
        np.testing.assert_allclose(mig.centroid(k), b.mean(axis=0))
        assert mig.size(k) == PER_GROUP
    assert [round(mig.sigma(k), 2) for k in mig.clusters] == [3.24, 3.28, 3.18, 3.27]  # ~7 bits of margin
    assert [round(mig.radius(k), 1) for k in mig.clusters] == [34.7, 37.9, 36.4, 33.3]
    assert mig.max_radius == mig.radius(1)
    wider = Migration.from_labels(_fleet(0)[3], TRUTH, N_BITS, flip_prob=P, z=3.0)  # one more sigma each
    assert [wider.radius(k) - mig.radius(k) for k in mig.clusters] == pytest.approx([mig.sigma(k) for k in
                                                                                    mig.clusters])
    exact = Migration.from_labels(_fleet(0)[3], TRUTH, N_BITS, flip_prob=0.0)  # no flips: the reach alone
    assert [exact.radius(k) for k in exact.clusters] == pytest.approx(
        [loo_distances(bits[TRUTH == k]).max() for k in range(GROUPS)])
    one = Migration({7: _fleet(0)[3][:1]}, N_BITS)  # one member, no reach anywhere: z sigma alone
    assert one.sigma(7) == pytest.approx(math.sqrt(0.09 * N_BITS)) and one.clusters == [7]
    assert one.radius(7) == pytest.approx(2.0 * math.sqrt(0.09 * N_BITS))  # 8.5 bits
    # the radius itself is inside: P = 0 and lone members give radius 0 and distance 0 to their own
    tight = Migration({0: _fleet(0)[3][:1], 1: _fleet(0)[3][25:26]}, N_BITS, flip_prob=0.0)
    assert [tight.radius(k) for k in tight.clusters] == [0.0, 0.0]
    assert [(d.action, d.target) for d in (tight.decide("a", _fleet(0)[3][0], 0),
                                           tight.decide("a", _fleet(0)[3][0], POOLED),
                                           tight.decide("a", _fleet(0)[3][1], 0))] == \
        [("stay", None), ("move", 0), ("pool", None)]


def test_a_cluster_of_fewer_than_five_members_takes_the_largest_reach_of_the_big_clusters():
    packed = _fleet(0)[3]
    bits = _bits(packed)
    mixed, few, five = [0, 25, 50], list(range(50, 54)), list(range(75, 80))
    reach = {k: float(loo_distances(bits[idx]).max()) for k, idx in
             {0: list(range(25)), 5: five, 7: mixed, 8: few}.items()}
    assert [round(reach[k], 1) for k in (0, 5, 7, 8)] == [28.2, 30.3, 78.0, 33.1]
    assert MIN_REACH_MEMBERS == 5
    mig = Migration({0: packed[:25], 5: packed[five], 7: packed[mixed], 8: packed[few]}, N_BITS)
    assert [mig.size(k) for k in mig.clusters] == [25, 5, 3, 4]
    # 5 members: its own reach, and it counts for the fleet; 3 or 4: the fleet's (30.3), even below their own
    own = {k: mig.radius(k) - 2.0 * mig.sigma(k) for k in mig.clusters}
    assert own == pytest.approx({0: reach[0], 5: reach[5], 7: reach[5], 8: reach[5]})
    mig.retire(5)  # now cluster 0's
    assert [mig.radius(k) - 2.0 * mig.sigma(k) for k in (7, 8)] == pytest.approx([reach[0]] * 2)
    mig.retire(0)  # no cluster has a reliable reach: the largest of all
    assert [mig.radius(k) - 2.0 * mig.sigma(k) for k in (7, 8)] == pytest.approx([reach[7]] * 2)
    mig.set_members(8, packed[five])  # 5 members again: its own reach, and the fleet's for 7
    assert [mig.radius(k) - 2.0 * mig.sigma(k) for k in (7, 8)] == pytest.approx([reach[5]] * 2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unchanged_data_resketched_stays(seed):
    protos, vectors, seeds, packed = _fleet(seed)
    again = _sketch(vectors, seeds)
    np.testing.assert_array_equal(again, packed)  # the flip key is the device's: the same bits
    mig = _migration(seed)
    decisions = _decide_all(mig, again, TRUTH)
    assert [(d.action, d.target) for d in decisions] == [("stay", None)] * TRUTH.size
    # a member as clustered is at ((m - 1) / m) ** 2 of its leave-one-out distance, so the reach covers it
    for k in range(GROUPS):
        got = [d.distance_current for d in decisions if d.current == k]
        np.testing.assert_allclose(got, (24 / 25) ** 2 * loo_distances(_bits(packed[TRUTH == k])))
        assert max(got) < mig.radius(k) - 2.0 * mig.sigma(k)
    assert max(d.distance_current - d.radius_current for d in decisions) < -8.5
    # and no other cluster holds any, nor comes anywhere near
    assert min(d.distance_nearest - d.radius_nearest for d in decisions) > 23.0
    assert min(d.distance_nearest - d.distance_current for d in decisions) > 36.5


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fresh_data_of_the_own_group_stays_over_many_resketches(seed):
    protos, vectors, seeds, packed = _fleet(seed)
    mig, rng = _migration(seed), np.random.default_rng(seed + 7)
    worst, most_flipped = -math.inf, 0
    for _ in range(5):  # 500 re-sketches per seed, sampling noise on every class mean
        fresh = _sketch(vectors + rng.normal(0.0, SAMPLING_SD, vectors.shape), seeds)
        most_flipped = max(most_flipped, int(_hamming(fresh, packed).max()))
        decisions = _decide_all(mig, fresh, TRUTH)
        assert [d.action for d in decisions] == ["stay"] * TRUTH.size
        worst = max(worst, max(d.distance_current - d.radius_current for d in decisions))
    # sampling noise flips at most 12 of a device's bits: a DriftTracker would not even decide these,
    # and the rule alone keeps them too, inside their radius
    assert most_flipped <= 12 < CHANGE_BITS
    assert worst < -6.0
    # whole new draws of each device from its group (a 26th member): the few that differ by more than
    # CHANGE_BITS, which a DriftTracker does decide, stay like all the others
    decided, worst = 0, -math.inf
    for _ in range(4):
        new = _sketch(protos[TRUTH] + rng.normal(0.0, DEVICE_SD, vectors.shape), seeds)
        decisions = _decide_all(mig, new, TRUTH)
        assert [d.action for d in decisions] == ["stay"] * TRUTH.size
        decided += int(np.sum(_hamming(new, packed) > CHANGE_BITS))
        worst = max(worst, max(d.distance_current - d.radius_current for d in decisions))
    assert decided == {0: 4, 1: 2, 2: 1}[seed]
    assert worst < -3.0


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_devices_that_take_another_groups_data_move_to_its_cluster(seed):
    who = np.arange(15)  # 15 devices of group 0 take group 1's prototype
    packed = _drifted(seed, who, 1)
    assert (_hamming(packed, _fleet(seed)[3]) > CHANGE_BITS).tolist() == [True] * 15 + [False] * 85
    decisions = _decide_all(_migration(seed), packed, TRUTH)
    moved = {d.cid: d.target for d in decisions if d.action == "move"}
    assert moved == {CIDS[i]: 1 for i in who}
    assert sum(d.action == "stay" for d in decisions) == TRUTH.size - 15
    for d in decisions[:15]:
        assert (d.current, d.nearest, d.target) == (0, 1, 1)
        assert d.distance_current > d.radius_current + 25.0 and d.distance_nearest < d.radius_nearest - 7.0


def test_devices_with_data_nobody_had_pool_then_form_a_new_cluster():
    who = np.arange(50, 62)  # 12 devices of group 2 take prototype 4
    packed = _drifted(0, who, 4)
    mig = _migration()
    decisions = _decide_all(mig, packed, TRUTH)
    assert [d.cid for d in decisions if d.action == "pool"] == [CIDS[i] for i in who]
    assert all(d.target is None for d in decisions)
    assert {d.action for i, d in enumerate(decisions) if i not in who} == {"stay"}
    assert min(min(d.distance_current - d.radius_current, d.distance_nearest - d.radius_nearest)
               for d in decisions if d.action == "pool") > 30.0

    pool = {CIDS[i]: packed[i] for i in who}
    groups = group_pool(pool, N_BITS, min_cluster_size=5)
    assert groups == [sorted(pool)] == group_pool(pool, N_BITS, min_cluster_size=5, max_radius=mig.max_radius)
    found = [next(g for g, grp in enumerate(groups) if c in grp) for c in sorted(pool)]
    assert adjusted_rand_score([0] * 12, found) == 1.0
    assert group_pool(pool, N_BITS, min_cluster_size=13) == []

    k = mig.add_cluster(packed[who])
    assert k == 4 and mig.clusters == [0, 1, 2, 3, 4] and mig.size(4) == 12
    assert mig.radius(4) == pytest.approx(loo_distances(_bits(packed[who])).max() + 2.0 * mig.sigma(4))
    mig.set_members(2, packed[np.setdiff1d(np.flatnonzero(TRUTH == 2), who)])
    assert mig.size(2) == 13
    assert [mig.decide(CIDS[i], packed[i], 4).action for i in who] == ["stay"] * 12
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


def test_inside_its_own_radius_a_device_moves_to_a_clearly_nearer_holding_cluster():
    packed = _fleet(0)[3]
    members = {0: packed[:25], 1: packed[25:50], 9: packed[3:4]}  # 9: device 3 alone
    mig = Migration(members, N_BITS)
    d = mig.decide(CIDS[3], packed[3], 0)
    assert (d.action, d.target, d.nearest, d.distance_nearest) == ("move", 9, 9, 0.0)
    assert d.distance_current <= d.radius_current and d.distance_nearest <= d.radius_nearest  # both hold it
    noise = 2.0 * math.hypot(mig.sigma(0), mig.sigma(9))
    assert (round(d.distance_current, 2), round(noise, 2)) == (18.48, 10.68)  # clearly nearer: 18.5 > 10.7
    # the bar is exactly z * hypot(sigma_0, sigma_9) (sigma does not depend on z): just above, it stays
    z_star = d.distance_current / math.hypot(mig.sigma(0), mig.sigma(9))
    assert Migration(members, N_BITS, z=z_star * 1.001).decide(CIDS[3], packed[3], 0).action == "stay"
    assert Migration(members, N_BITS, z=z_star * 0.999).decide(CIDS[3], packed[3], 0).target == 9
    # 9 holds 6 more of group 0's devices, but 0 is nearer to them: they stay
    held = [i for i in range(25) if mig.distances(packed[i])[9] <= mig.radius(9)]
    assert held == [0, 2, 3, 8, 13, 14, 23]
    assert [mig.decide(CIDS[i], packed[i], 0).action for i in range(25)] == ["stay"] * 3 + ["move"] + ["stay"] * 21
    pooled = mig.decide(CIDS[3], packed[3], POOLED)  # from the pool: the nearest cluster that holds it
    assert (pooled.action, pooled.target) == ("move", 9)
    other = mig.decide(CIDS[0], packed[0], 1)  # group 0's device filed under 1: to 0, the nearest holding
    assert (other.action, other.target, other.nearest) == ("move", 0, 0)
    assert other.distance_current > other.radius_current and 0 in held


def test_a_holding_cluster_nearer_by_less_than_the_noise_does_not_move_a_device():
    packed = _fleet(0)[3]
    mig = Migration({0: packed[:25], 8: packed[:24], 1: packed[25:50]}, N_BITS)  # 8: 0 without device 24
    noise = 2.0 * math.hypot(mig.sigma(0), mig.sigma(8))
    for current, twin, nearer in ((0, 8, 17), (8, 0, 8)):
        gaps = [mig.distances(packed[i])[current] - mig.distances(packed[i])[twin] for i in range(25)]
        assert sum(g > 0 for g in gaps) == nearer and max(gaps) < 2.0 < noise  # the twin is nearer, not clearly
        decisions = [mig.decide(CIDS[i], packed[i], current) for i in range(25)]
        assert [(d.action, d.nearest) for d in decisions] == [("stay", twin)] * 25


def test_retired_cluster_is_never_a_target_and_ids_are_not_reused():
    who = np.arange(15)
    packed = _drifted(0, who, 1)
    mig = _migration()
    mig.retire(1)
    assert mig.clusters == [0, 2, 3] and mig.retired == [1]
    decisions = _decide_all(mig, packed[TRUTH != 1], TRUTH[TRUTH != 1])
    assert [d.cid for d in decisions if d.action == "pool"] == [CIDS[i] for i in who]
    assert sum(d.action == "stay" for d in decisions) == 60
    assert all(d.target != 1 and d.nearest != 1 for d in decisions)
    assert mig.add_cluster(packed[who]) == 4  # not 1
    assert [(d.action, d.target) for d in (mig.decide(CIDS[i], packed[i], 0) for i in who)] == [("move", 4)] * 15


def test_state_round_trip_gives_identical_decisions():
    who = np.arange(50, 62)
    packed = _drifted(0, who, 4)
    mig = _migration()
    mig.retire(3)
    mig.add_cluster(packed[who])
    mig.add_cluster(packed[[0, 25, 50]])  # 5: small, takes the fleet's reach
    meta, tensors = mig.state()
    assert meta == {"version": 2, "n_bits": N_BITS, "flip_prob": P, "z": 2.0, "clusters": [0, 1, 2, 4, 5],
                    "sizes": [25, 25, 25, 12, 3], "retired": [3], "next_id": 6}
    assert sorted(tensors) == ["centroids", "reach"] and tensors["centroids"].shape == (5, N_BITS)
    np.testing.assert_allclose(tensors["reach"][[0, 4]], [loo_distances(_bits(packed[:25])).max(),
                                                          loo_distances(_bits(packed[[0, 25, 50]])).max()])
    restored = Migration.from_state(json.loads(json.dumps(meta)), {k: v.copy() for k, v in tensors.items()})
    assert restored.clusters == [0, 1, 2, 4, 5] and restored.retired == [3]
    assert [restored.radius(k) for k in restored.clusters] == [mig.radius(k) for k in mig.clusters]
    assert restored.radius(5) < tensors["reach"][4]  # the size came back too: 5 still takes the fleet's reach
    for current in (0, 2, 4, 5, POOLED):
        assert _decide_all(restored, packed, [current] * TRUTH.size) == _decide_all(mig, packed, [current] * 100)
    assert restored.add_cluster(packed[:3]) == 6
    assert repr(restored) == "Migration(n_bits=200, flip_prob=0.1, z=2.0, clusters=[0, 1, 2, 4, 5, 6], retired=[3])"


def test_sketch_objects_and_bytes_are_accepted():
    mig, packed = _migration(), _fleet(0)[3]
    as_sketch = Sketch(packed[0].tobytes(), N_CLASSES, LATENT, P)
    assert mig.decide("a", as_sketch, 0) == mig.decide("a", packed[0].tobytes(), 0) == mig.decide("a", packed[0], 0)
    assert mig.unseen_drifts() == []
    close = Migration({0: packed[:25], 1: packed[25:50], 2: packed[:20]}, N_BITS)  # 2 lies inside 0
    assert close.unseen_drifts() == [(0, 2), (2, 0)]


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
    _raises("unknown cluster 9: live clusters are [0, 1, 2, 3]", mig.sigma, 9)
    _raises("current must be an integer >= -1, got -2", mig.decide, "a", packed[0], -2)
    _raises("current must be an integer >= -1, got 1.0", mig.decide, "a", packed[0], 1.0)
    _raises("cid must be a non-empty string, got 3", mig.decide, 3, packed[0], 0)
    mig.retire(2)
    _raises("cluster 2 is retired", mig.decide, "a", packed[0], 2)
    _raises("cluster 2 is retired", mig.set_members, 2, packed[:3])
    _raises("cluster 2 is retired", mig.retire, 2)
    _raises("cluster 2 is retired", mig.radius, 2)
    _raises("cluster 2 is retired", mig.sigma, 2)
    _raises("migration state must be version 2, got None", Migration.from_state, {}, {})
    meta, tensors = mig.state()
    _raises("migration state must be version 2, got 1", Migration.from_state, {**meta, "version": 1}, tensors)
    _raises("migration state lacks ['reach']", Migration.from_state, meta, {"centroids": tensors["centroids"]})
    _raises("migration state lacks ['next_id', 'reach']",  # a version-1 "radii" is no "reach"
            Migration.from_state, {k: v for k, v in meta.items() if k != "next_id"},
            {"centroids": tensors["centroids"], "radii": tensors["reach"]})
    _raises("migration state holds 3 clusters but centroids (2, 200), reach (3,) and 3 sizes",
            Migration.from_state, meta, {**tensors, "centroids": tensors["centroids"][:2]})
    _raises("migration state: centroids must be mean bits in [0, 1] and reaches finite and >= 0",
            Migration.from_state, meta, {**tensors, "reach": -tensors["reach"]})
    _raises("min_cluster_size must be an integer >= 1, got 0", group_pool, {}, N_BITS, min_cluster_size=0)
    _raises("max_radius must be >= 0.0, got -1.0", group_pool, {}, N_BITS, min_cluster_size=2, max_radius=-1.0)
    _raises("pool's device ids must be strings", group_pool, {1: packed[0]}, N_BITS, min_cluster_size=1)
    _raises("pool's sketches must be 1-D packed rows (one sketch per device)", group_pool,
            {"a": packed[:2]}, N_BITS, min_cluster_size=1)
    _raises("leave-one-out distances need a 2-D array of at least 2 rows, got shape (1, 200)", loo_distances,
            np.zeros((1, 200)))
