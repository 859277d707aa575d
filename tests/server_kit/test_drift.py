"""Data that drifts (issue 15), on scikit-learn's digits in the in-process simulator.

24 devices in 4 rotation groups (6 each) are clustered from sketches; during
training some devices switch their data: to another group's rotation (they
must move) or to a rotation nobody had (they must form a new cluster).
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.protocol import Kind, sketch_body
from edge_sdk.tasks import TrainSettings
from server_kit.data.drift import DriftEvent, DriftSchedule, rotate_images, rotation_drift
from server_kit.drivers.simulate import Simulator
from server_kit.metrics import message_bytes
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, ari_against

pytest.importorskip("torch")

SETTINGS = TrainSettings(epochs=1, lr=1e-2, batch_size=16)



@pytest.fixture(scope="module")
def encoder():
    from edge_sdk import OnnxEncoder

    return OnnxEncoder("digits_encoder")


def _ours(**kw):
    return SketchClustered(settings=SETTINGS, min_cluster_size=3, follow_drift=True, **kw)


def _sketch200():
    from edge_sdk.sketch import Sketch

    return Sketch(bytes(25), 10, 20)



def test_rotate_images_is_exact_for_quarter_turns_and_keeps_range():
    x = np.random.default_rng(0).random((3, 8, 8), dtype=np.float32)
    assert np.array_equal(rotate_images(x, 90), np.rot90(x, 1, axes=(1, 2)))
    assert np.array_equal(rotate_images(x, -270), np.rot90(x, 1, axes=(1, 2)))
    r45 = rotate_images(x, 45)
    assert r45.shape == x.shape and r45.dtype == np.float32 and 0.0 <= r45.min() and r45.max() <= 1.0
    with pytest.raises(ValueError, match=r"^images must be \(n, h, w\) or \(n, c, h, w\), got shape \(8, 8\)$"):
        rotate_images(x[0], 90)


def test_drift_schedule_transforms_data_and_tells_the_truth_of_each_round(digits24):
    sched = rotation_drift(digits24, round=3, moves=[(0, 1, 2)], new=[(2, 4, 45.0, 3)], seed=1)
    moved, new = sched.events
    assert len(moved.clients) == 2 and len(new.clients) == 3 and not set(moved.clients) & set(new.clients)
    by_id = {c.cid: c for c in digits24}
    assert all(by_id[c].group == 0 for c in moved.clients) and all(by_id[c].group == 2 for c in new.clients)
    assert sched.apply(by_id, 2) == {}
    changed = sched.apply(by_id, 3)
    assert sorted(changed) == sorted(moved.clients + new.clients)
    c = moved.clients[0]
    assert np.array_equal(changed[c].x_train, np.rot90(by_id[c].x_train, 1, axes=(1, 2)))
    assert changed[c].group == 1 and by_id[c].group == 0  # the original is not changed
    before, after = sched.truth(digits24, 2), sched.truth(digits24, 3)
    assert before == {d.cid: d.group for d in digits24}
    assert {k for k in after if after[k] != before[k]} == set(moved.clients + new.clients)
    assert {after[k] for k in new.clients} == {4}
    with pytest.raises(ValueError, match="^device c000 drifts twice in round 2$"):
        DriftSchedule([DriftEvent(2, ("c000",), 1, rotate_by=90), DriftEvent(2, ("c000",), 2, rotate_by=180)])
    with pytest.raises(ValueError, match="^a drift event must change something"):
        DriftEvent(2, ("c000",), 1, rotate_by=360)
    with pytest.raises(ValueError, match="^group 0 has 6 devices left to drift, asked for 7$"):
        rotation_drift(digits24, round=2, moves=[(0, 1, 7)])


def test_a_drifted_device_moves_and_its_next_update_goes_to_the_new_cluster(digits24, encoder):
    sched = rotation_drift(digits24, round=2, moves=[(0, 1, 3)], seed=0)
    (event,) = sched.events
    s = _ours()
    res = Simulator(s, digits24, architecture=ARCH, encoder=encoder, drift=sched).run(3)
    before = {c.cid: c.group for c in digits24}
    after = sched.truth(digits24, 2)
    # clustered right before the drift, and right again after it
    drift = res.rounds[1].summary["drift"]
    assert sorted(m["cid"] for m in drift["moves"]) == sorted(event.clients)
    assert drift["pooled"] == [] and drift["new_clusters"] == [] and drift["retired"] == []
    assert ari_against(after, res.assignment) == 1.0 and ari_against(before, res.assignment) < 1.0
    for m in drift["moves"]:
        assert m["distance_from"] > m["radius_from"] and m["distance_to"] <= m["radius_to"]
    target = {res.assignment[d.cid] for d in digits24 if before[d.cid] == 1}
    assert {m["to"] for m in drift["moves"]} == target
    assert res.ari == 1.0  # scored against the truth after the drift
    assert s.drift_.counts["moves"] == 3
    # the moved devices were sent their sketch unasked: 3 sketches, nobody else
    one = message_bytes(Kind.SKETCH, sketch_body(_sketch200()))
    assert drift["sketches"] == 3 and res.drift_bytes == 3 * one


def test_devices_that_fit_no_cluster_pool_then_form_a_new_cluster_that_trains(digits24, encoder):
    sched = rotation_drift(digits24, round=2, new=[(2, 4, 45.0, 4)], seed=0)
    (event,) = sched.events
    s = _ours()
    res = Simulator(s, digits24, architecture=ARCH, encoder=encoder, drift=sched).run(3)
    drift = res.rounds[1].summary["drift"]
    assert sorted(drift["pooled"]) == sorted(event.clients)
    (new,) = drift["new_clusters"]
    assert new["devices"] == sorted(event.clients)
    # started from the model of the nearest existing cluster, trained from the next round on
    assert new["started_from"] in set(res.assignment.values()) - {new["cluster"]}
    key = s.key(new["cluster"])
    assert res.rounds[1].summary[key] == 4 and res.rounds[2].summary[key] == 4
    # a new cluster trains every member for its first rounds, whatever the strategy's fraction
    assert [s.drift_.young(new["cluster"], r) for r in (2, 4, 5)] == [True, True, False]
    s.fraction = 0.5
    assert s.cluster_fraction(new["cluster"], 4) == 1.0 and s.cluster_fraction(new["started_from"], 4) is None
    tasks = s.configure_round(4, sorted(res.assignment))
    assert sum(t.cid in new["devices"] for t in tasks) == 4
    # ... with three times the local epochs (more work on the device, no more bytes)
    assert {t.settings.epochs for t in tasks if t.cid in new["devices"]} == {3 * SETTINGS.epochs}
    assert {t.settings.epochs for t in tasks if t.cid not in new["devices"]} == {SETTINGS.epochs}
    assert {t.settings.epochs for t in s.configure_round(5, sorted(res.assignment))} == {SETTINGS.epochs}
    assert ari_against(sched.truth(digits24, 2), res.assignment) == 1.0
    assert len(set(res.assignment.values())) == 5


def test_no_device_moves_without_drift_over_many_resketches(digits24, encoder):
    s = _ours(resketch_every=1)
    res = Simulator(s, digits24, architecture=ARCH, encoder=encoder).run(4)
    assert s.drift_.counts == {"moves": 0, "pooled": 0, "new_clusters": 0, "retired": 0, "sketches": 72}
    assert [r.summary["drift"]["sketches"] for r in res.rounds[1:]] == [24, 24, 24]
    assert res.ari == 1.0


def test_a_restored_strategy_keeps_the_new_assignment_and_decides_alike(digits24, encoder):
    sched = rotation_drift(digits24, round=2, moves=[(0, 1, 3)], new=[(2, 4, 45.0, 4)], seed=0)
    s = _ours()
    res = Simulator(s, digits24, architecture=ARCH, encoder=encoder, drift=sched).run(2)
    meta, tensors = s.state()
    back = _ours()
    back.load_state(meta, tensors)
    assert back.assignment == s.assignment == res.assignment
    assert back.drift_.pool == s.drift_.pool and back.drift_.counts == s.drift_.counts
    assert sorted(back.models) == sorted(s.models)
    for cid, packed in s.drift_.sketches.items():
        current = s.assignment[cid]
        assert back.drift_.migration.decide(cid, packed, current) == s.drift_.migration.decide(cid, packed, current)


@pytest.mark.parametrize("name", ["fedavg", "ifca", "cfl", "fedsketch"])
def test_baselines_run_unchanged_on_the_drifting_fleet(digits24, encoder, name):
    """Methods that do not follow drift train on the drifted data, and no device sends a sketch for it."""
    from server_kit.strategies import make_strategy

    sched = rotation_drift(digits24, round=2, moves=[(0, 1, 3)], seed=0)
    (event,) = sched.events
    kw = {"min_cluster_size": 3} if name == "fedsketch" else {}
    s = make_strategy(name, settings=SETTINGS, architecture=ARCH, **kw)
    sim = Simulator(s, digits24, architecture=ARCH, encoder=encoder, drift=sched)
    res = sim.run(2)
    assert res.drift_bytes == 0 and "drift" not in res.rounds[1].summary
    c = event.clients[0]
    original = next(d for d in digits24 if d.cid == c)
    assert np.array_equal(sim.workers[c].x, np.rot90(original.x_train, 1, axes=(1, 2)))
    assert sim.data[c].group == 1 and len(res.rounds) == 2
