"""OCFL, Briggs et al. and K-means on weights: their math, their decisions on recorded updates, the simulator."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from scipy.spatial.distance import cdist
from sklearn.metrics import adjusted_rand_score

from edge_sdk.tasks import TrainSettings, Update
from server_kit.clustering.updates import (
    clustering_temperature,
    cosine_distances_from_gram,
    delta_gram,
)
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.drivers.simulate import Simulator
from server_kit.metrics import weighted_purity
from server_kit.strategies import make_strategy
from server_kit.strategies.base import ClientInfo
from server_kit.strategies.briggs import Briggs
from server_kit.strategies.kmeans_weights import KMeansWeights, l1_kmedians, median_distances
from server_kit.strategies.ocfl import OCFL, absorb_noise, merge_small_clusters, unit_embedding
from server_kit.strategies.update_clustered import UpdateClustered

from helpers import ARCH

pytest.importorskip("torch")

SETTINGS = TrainSettings(epochs=2, lr=1e-2, batch_size=16)
TRUTH4 = [i % 4 for i in range(12)]  # rotation_partition: client i is in group i mod groups


# -- recorded warm-up updates (the same every strategy sees: same seeds, same FedAvg warm-up) ----------


class Recorder(UpdateClustered):
    """Warm-up only: keeps every round's updates and reference."""

    name = "recorder"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rounds: dict[int, tuple[list[Update], dict[str, np.ndarray]]] = {}

    def decide(self, rnd, updates, reference, force):
        self.rounds[rnd] = (list(updates), {k: np.array(v) for k, v in reference.items()})
        return [0] * len(updates) if force else None


def record(clients, rounds=4):
    s = Recorder(settings=SETTINGS, max_warmup_rounds=rounds)
    Simulator(s, clients, architecture=ARCH, seed=0).run(rounds)
    return s.rounds


@pytest.fixture(scope="module")
def homogeneous12():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 12, groups=1, seed=0)


@pytest.fixture(scope="module")
def recorded(digits12):
    return record(digits12)


@pytest.fixture(scope="module")
def recorded_homogeneous(homogeneous12):
    return record(homogeneous12)


def replay(strategy, rounds, upto=None):
    """Feed recorded rounds to ``strategy.decide`` until it returns labels; returns ``(round, labels)``."""
    last = max(rounds) if upto is None else upto
    for rnd in range(1, last + 1):
        updates, reference = rounds[rnd]
        labels = strategy.decide(rnd, updates, reference, force=rnd == last)
        if labels is not None:
            return rnd, labels
    raise AssertionError("no decision")


# -- synthetic updates -------------------------------------------------------------------------------


def e(i, n=4):
    v = np.zeros(n, np.float32)
    v[i] = 1.0
    return v


def feed(s, rnd, deltas, cids="abcd"):
    """One round of ``_combine`` with updates ``reference + delta`` for the clients ``cids``."""
    ref = s.models[s.default_key]["w"]
    updates = [Update(c, rnd, s.default_key, {"w": (ref + d).astype(np.float32)}, 1, 0.0)
               for c, d in zip(cids, deltas)]
    return s._combine(rnd, updates)


def started(s, cids="abcd", n=4):
    s.setup([ClientInfo(c, 1) for c in cids], {"w": np.zeros(n, np.float32)})
    return s


# OCFL's hand-computed temperatures ||D||_F / sqrt(4 n (n - 1)), n = 4, sqrt(48) below:
ORTHOGONAL = [e(0), e(1), e(2), e(3)]  # all 12 off-diagonal distances 1: sqrt(12 / 48) = 0.5
TWO_PAIRS = [e(0), e(0), e(1), e(1)]  # 8 distances 1: sqrt(8 / 48)
OPPOSED_PAIRS = [e(0), e(0), -e(0), -e(0)]  # 8 distances 2: sqrt(32 / 48)


def test_ocfl_clusters_at_the_first_temperature_rise(caplog):
    caplog.set_level("INFO")
    s = started(OCFL(algorithm="kmeans", k=2))
    assert "clusters" not in feed(s, 1, ORTHOGONAL)  # no previous temperature
    assert "clusters" not in feed(s, 2, TWO_PAIRS)  # falls
    assert not s.clustered
    summary = feed(s, 3, OPPOSED_PAIRS)  # rises: cluster
    assert summary["clusters"] == 2 and s.cluster_round_ == 3
    np.testing.assert_allclose(s.temperatures_, [0.5, math.sqrt(1 / 6), math.sqrt(2 / 3)])
    assert s.clusters() == {"a": 0, "b": 0, "c": 1, "d": 1}
    # both children inherit the global model after round 3 (the mean of +e0, +e0, -e0, -e0: unchanged)
    np.testing.assert_allclose(s.models["c0"]["w"], s.models["c1"]["w"])
    assert "temperature 0.8165 (previous 0.4082), rising: clustering" in caplog.text
    assert s.silhouette_ == pytest.approx(1.0)


def test_ocfl_is_forced_at_max_warmup_rounds(caplog):
    caplog.set_level("INFO")
    s = started(OCFL(algorithm="kmeans", k=2, max_warmup_rounds=2))
    feed(s, 1, ORTHOGONAL)
    assert feed(s, 2, TWO_PAIRS)["clusters"] == 2  # the temperature fell, but round 2 is the last
    assert s.cluster_round_ == 2 and s.clusters() == {"a": 0, "b": 0, "c": 1, "d": 1}
    assert "forced: clustering" in caplog.text


def test_unit_embedding_is_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 40))
    d = cosine_distances_from_gram(x @ x.T)
    emb = unit_embedding(d)
    unit = x / np.linalg.norm(x, axis=1, keepdims=True)
    np.testing.assert_allclose(cdist(emb, emb), cdist(unit, unit), atol=1e-7)
    np.testing.assert_allclose(cdist(emb, emb) ** 2, 2 * d, atol=1e-7)


def test_noise_and_small_clusters_join_their_nearest():
    d = np.array([[0, 1, 5, 5, 3],
                  [1, 0, 5, 5, 4],
                  [5, 5, 0, 1, 2],
                  [5, 5, 1, 0, 2],
                  [3, 4, 2, 2, 0]], dtype=float)
    # client 4 is noise: mean distance 3.5 to cluster 0, 2 to cluster 1
    np.testing.assert_array_equal(absorb_noise(d, [0, 0, 1, 1, -1]), [0, 0, 1, 1, 1])
    np.testing.assert_array_equal(absorb_noise(d, [-1] * 5), [0] * 5)
    # singletons {3} (label 1, lowest), {2}, {4}, min size 2: {3} joins {2} (mean 1 < 2 < 5), then {4}
    # joins {2, 3} (mean 2 against 3.5)
    np.testing.assert_array_equal(merge_small_clusters(d, [0, 0, 2, 1, 4], 2), [0, 0, 2, 2, 2])
    np.testing.assert_array_equal(merge_small_clusters(d, [0, 0, 1, 1, 1], 3), [1, 1, 1, 1, 1])
    np.testing.assert_array_equal(merge_small_clusters(d, [0, 0, 1, 1, 1], 2), [0, 0, 1, 1, 1])


@pytest.mark.parametrize("algorithm", ["hdbscan", "meanshift", "affinity", "kmeans"])
def test_ocfl_algorithms_on_the_rotation_federation(recorded, recorded_homogeneous, algorithm):
    s = OCFL(algorithm=algorithm)
    rnd, labels = replay(s, recorded)
    ari = adjusted_rand_score(TRUTH4, labels)
    print(f"OCFL-{algorithm}: decided at round {rnd}, {len(set(labels))} clusters, ARI {ari:.3f}, "
          f"temperatures {np.round(s.temperatures_, 4).tolist()}")
    # temperatures 0.4317, 0.408, 0.3617, then a rise to 0.415 (another floating-point path: within 0.0004); over
    # seeds 0-3 and both paths the rise always came in round 4, 0.054-0.079 above round 3
    assert rnd == 4
    assert ari >= 0.9 and len(set(labels)) == 4
    h = OCFL(algorithm=algorithm)
    rnd, labels = replay(h, recorded_homogeneous)
    assert rnd == 4 and set(labels) == {labels[0]}, labels  # homogeneous: one cluster


def test_ocfl_in_the_simulator(digits12, recorded):
    s = OCFL(settings=SETTINGS)
    res = Simulator(s, digits12, architecture=ARCH, seed=0).run(5)
    print(f"OCFL-hdbscan simulator: ARI {res.ari:.3f}, accuracy {np.round(res.accuracies, 3).tolist()}")
    assert res.ari >= 0.9 and s.cluster_round_ == 4
    assert sorted(s.models) == ["c0", "c1", "c2", "c3"] and res.rounds[3].summary["clusters"] == 4
    assert sum(res.rounds[4].summary[k] for k in s.models) == 12
    # the simulator's warm-up is the recorded one: the same temperatures
    expected = [clustering_temperature(cosine_distances_from_gram(delta_gram([u.weights for u in ups], ref)))
                for ups, ref in (recorded[r] for r in range(1, 5))]
    np.testing.assert_allclose(s.temperatures_, expected, rtol=1e-6)


def test_ocfl_homogeneous_in_the_simulator(homogeneous12):
    s = OCFL(settings=SETTINGS)
    res = Simulator(s, homogeneous12, architecture=ARCH, seed=0).run(4)
    assert s.cluster_round_ == 4 and set(res.assignment.values()) == {0} and sorted(s.models) == ["c0"]


# -- Briggs ------------------------------------------------------------------------------------------

# cosine distances a-b 0.1 (cos 0.9), c-d 0.2 (cos 0.8), every other pair orthogonal (1)
HIER = [e(0), 0.9 * e(0) + math.sqrt(1 - 0.81) * e(1), e(2), 0.8 * e(2) + 0.6 * e(3)]


def test_briggs_cuts_the_average_linkage_tree():
    s = started(Briggs(distance_threshold=0.5))
    assert feed(s, 1, HIER)["clusters"] == 2
    np.testing.assert_allclose(s.linkage_[:, 2], [0.1, 0.2, 1.0], atol=1e-6)
    assert s.clusters() == {"a": 0, "b": 0, "c": 1, "d": 1}
    one = started(Briggs(distance_threshold=1.0))  # everything merges at or below 1.0: one cluster
    assert feed(one, 1, HIER)["clusters"] == 1
    single = started(Briggs(distance_threshold=0.15, linkage="single"))  # c-d merge at 0.2 > 0.15
    assert feed(single, 1, HIER)["clusters"] == 3
    late = started(Briggs(cluster_round=2, distance_threshold=0.5))
    assert "clusters" not in feed(late, 1, HIER) and feed(late, 2, HIER)["clusters"] == 2
    # Euclidean + Ward: a, b at distance ~0.45, c, d at ~0.63, the pairs ~1.4 apart
    ward = started(Briggs(distance_threshold=1.0, metric="euclidean", linkage="ward"))
    assert feed(ward, 1, HIER)["clusters"] == 2


def test_briggs_on_the_rotation_federation(digits12, recorded_homogeneous):
    s = Briggs(settings=SETTINGS, cluster_round=3, distance_threshold=0.55)
    res = Simulator(s, digits12, architecture=ARCH, seed=0).run(3)
    print(f"Briggs simulator: ARI {res.ari:.3f}, top merges {np.round(s.linkage_[-4:, 2], 3).tolist()}")
    assert res.ari >= 0.9 and s.cluster_round_ == 3 and len(s.models) == 4
    h = Briggs(cluster_round=3, distance_threshold=0.55)
    rnd, labels = replay(h, recorded_homogeneous, upto=3)
    assert rnd == 3 and set(labels) == {0}


# -- K-means on weights ---------------------------------------------------------------------------------


def test_kmedians_matches_brute_force_and_streams():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.normal(0, 1, (4, 6)), rng.normal(3, 1, (3, 6))])
    ref = {"a": np.zeros(2, np.float32), "b": np.zeros((2, 2), np.float32)}
    ups = [{"a": v[:2].astype(np.float64), "b": v[2:].reshape(2, 2)} for v in x]
    x = np.concatenate([np.stack([u["a"] for u in ups]), np.stack([u["b"].ravel() for u in ups])], axis=1)
    labels = np.array([0, 0, 1, 1, 0, 1, 1])
    centres = np.stack([np.median(x[labels == j], axis=0) for j in range(2)])
    np.testing.assert_allclose(median_distances(ups, ref, labels, 2), cdist(x, centres, "cityblock"))
    np.testing.assert_allclose(median_distances(ups, ref, labels, 2, chunk=1),
                               median_distances(ups, ref, labels, 2))

    def cost(lab):
        return sum(np.abs(x[lab == j] - np.median(x[lab == j], axis=0)).sum() for j in np.unique(lab))

    best = min(cost(np.array(p)) for p in itertools.product([0, 1], repeat=7) if len(set(p)) == 2)
    l1 = cdist(x, x, "cityblock")
    found, objective, _ = l1_kmedians(ups, ref, 2, l1=l1, rng=np.random.default_rng(0), n_init=5)
    assert objective == pytest.approx(best) and cost(found) == pytest.approx(best)
    np.testing.assert_array_equal(found == found[0], [True] * 4 + [False] * 3)


def test_kmeans_weights_on_the_rotation_federation(digits12, recorded, recorded_homogeneous):
    s = KMeansWeights(settings=SETTINGS, k=4, cluster_round=3)
    res = Simulator(s, digits12, architecture=ARCH, seed=0).run(3)
    print(f"K-means on weights simulator: ARI {res.ari:.3f}, objective {s.objective_:.1f}")
    assert res.ari >= 0.9 and s.cluster_round_ == 3 and s.k_ == 4
    chosen = KMeansWeights(cluster_round=4)  # k chosen by silhouette
    rnd, labels = replay(chosen, recorded)
    print(f"K-means on weights, k chosen: {chosen.silhouettes_}, ARI {adjusted_rand_score(TRUTH4, labels):.3f}")
    # measured over partition and training seeds 0-3, on this machine's floating-point path and another
    # (ATEN_CPU_CAPABILITY=avx2, 2 BLAS threads): k = 4 and ARI 1.0 in 7 runs of 8, k = 3 (two groups merged,
    # ARI 0.645) in one; the silhouettes of 3 and 4 clusters are 0.001-0.054 apart, so either may win elsewhere
    assert chosen.k_ in (3, 4) and chosen.silhouettes_[chosen.k_] == max(chosen.silhouettes_.values())
    assert adjusted_rand_score(TRUTH4, labels) >= 0.6
    for r in (3, 4):  # homogeneous: no k reaches the silhouette floor
        h = KMeansWeights(cluster_round=r)
        rnd, labels = replay(h, recorded_homogeneous, upto=r)
        assert set(labels) == {0} and max(h.silhouettes_.values()) < 0.25, h.silhouettes_


def test_weighted_purity_by_hand():
    # clusters {0, 1}: pure (1); {2, 3, 4}: truths 0, 1, 1, one pair of three agrees (1/3); {5}: one client (1)
    assert weighted_purity([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 2]) == pytest.approx((1 + 1 / 3 + 1) / 3)
    assert weighted_purity([0] * 5 + [1] * 5, [7] * 5 + [3] * 5) == 1.0  # the paper's 2 x 5: 1.0
    assert weighted_purity([0, 0, 1, 1], [0, 0, 0, 0]) == pytest.approx(2 / 6)
    with pytest.raises(ValueError, match="truth and labels must be 1-D and of equal length"):
        weighted_purity([0, 1], [0])


# -- what all three share --------------------------------------------------------------------------------

ROUND_ONE = {  # each decides on round 1's updates
    "ocfl": dict(algorithm="kmeans", k=2, max_warmup_rounds=1),
    "briggs": dict(distance_threshold=0.5),
    "kmeans-weights": dict(k=2),
}
PAIRS5 = [e(0, 5), 0.9 * e(0, 5) + math.sqrt(0.19) * e(1, 5), e(2, 5), 0.8 * e(2, 5) + 0.6 * e(3, 5)]


@pytest.mark.parametrize("name", sorted(ROUND_ONE))
def test_a_nan_update_is_ignored_and_state_round_trips(name, caplog):
    s = started(make_strategy(name, **ROUND_ONE[name]), "abcde", 5)
    ref = s.models["global"]["w"]
    bad = ref + e(4, 5)
    bad[4] = np.nan
    updates = [Update(c, 1, "global", {"w": (ref + d).astype(np.float32)}, 1, 0.0) for c, d in zip("abcd", PAIRS5)]
    summary = s._combine(1, [*updates, Update("e", 1, "global", {"w": bad}, 1, 0.0)])
    assert summary["clusters"] == 2 and summary["updates"] == 4 and summary["rejected"] == 1
    assert "update of e not used for clustering" in caplog.text
    assert "client e sent no update in round 1; it joins the largest cluster" in caplog.text
    assert s.clusters()["a"] == s.clusters()["b"] != s.clusters()["c"] == s.clusters()["d"]
    meta, tensors = s.state()
    json.dumps(meta)  # plain data
    t = started(make_strategy(name, **ROUND_ONE[name]), "abcde", 5)
    t.load_state(meta, tensors)
    assert t.clusters() == s.clusters() and t.cluster_round_ == 1 and sorted(t.models) == sorted(s.models)
    if name == "ocfl":
        assert t.temperatures_ == s.temperatures_ and len(t.temperatures_) == 1
    elif name == "briggs":
        np.testing.assert_array_equal(t.linkage_, s.linkage_)
    else:
        assert t.k_ == s.k_ == 2 and t.objective_ == s.objective_
    with pytest.raises(ValueError, match=f"checkpoint is for strategy '{name}', not 'fedavg'"):
        make_strategy("fedavg").load_state(meta, tensors)


def test_make_strategy_builds_them_from_plain_values():
    o = make_strategy("ocfl", algorithm="meanshift", bandwidth=0.9, architecture=ARCH, seed=2)
    assert isinstance(o, OCFL) and (o.algorithm, o.bandwidth, o.seed) == ("meanshift", 0.9, 2)
    b = make_strategy("briggs", cluster_round=2, linkage="complete", metric="euclidean", distance_threshold=3)
    assert isinstance(b, Briggs) and (b.cluster_round, b.linkage, b.distance_threshold_) == (2, "complete", 3.0)
    k = make_strategy("kmeans-weights", k=3, cluster_round=2, max_warmup_rounds=5)
    assert isinstance(k, KMeansWeights) and (k.k, k.cluster_round, k.max_warmup_rounds) == (3, 2, 5)
    assert Briggs().distance_threshold_ == 0.5
    with pytest.raises(TypeError, match="bogus"):
        make_strategy("ocfl", bogus=1)


@pytest.mark.parametrize("make, match", [
    (lambda: OCFL(algorithm="dbscan"),
     r"algorithm must be one of \['affinity', 'hdbscan', 'kmeans', 'meanshift'\], got 'dbscan'"),
    (lambda: OCFL(min_cluster_size=1), "min_cluster_size must be an integer >= 2, got 1"),
    (lambda: OCFL(min_cluster_size=-3), "min_cluster_size must be an integer >= 2, got -3"),
    (lambda: OCFL(min_cluster_fraction=0), r"min_cluster_fraction must be > 0.0, got 0"),
    (lambda: OCFL(min_cluster_fraction=1.5), r"min_cluster_fraction must be <= 1.0, got 1.5"),
    (lambda: OCFL(min_silhouette=2), r"min_silhouette must be <= 1.0, got 2"),
    (lambda: OCFL(k=3), "k applies to algorithm 'kmeans' only, not 'hdbscan'"),
    (lambda: OCFL(selection="tree"), r"selection must be 'eom' or 'leaf' \(HDBSCAN's cluster_selection_method\)"),
    (lambda: OCFL(algorithm="kmeans", selection="leaf"), "selection applies to algorithm 'hdbscan' only"),
    (lambda: OCFL(algorithm="kmeans", bandwidth=0.5), "bandwidth applies to algorithm 'meanshift' only"),
    (lambda: OCFL(algorithm="kmeans", k=0), "k must be an integer >= 1, got 0"),
    (lambda: OCFL(algorithm="meanshift", bandwidth=-1), r"bandwidth must be > 0.0, got -1"),
    (lambda: OCFL(algorithm="affinity", damping=1.0), r"damping must be in \[0.5, 1\), got 1.0"),
    (lambda: OCFL(max_warmup_rounds=0), "max_warmup_rounds must be an integer >= 1, got 0"),
    (lambda: Briggs(linkage="centroid"),
     r"linkage must be one of \['average', 'complete', 'single', 'ward'\], got 'centroid'"),
    (lambda: Briggs(metric="manhattan"), r"metric must be one of \['cosine', 'euclidean'\], got 'manhattan'"),
    (lambda: Briggs(linkage="ward"), "linkage 'ward' needs metric 'euclidean', got metric 'cosine'"),
    (lambda: Briggs(metric="euclidean"), "distance_threshold is required with metric 'euclidean'"),
    (lambda: Briggs(distance_threshold=-0.1), r"distance_threshold must be > 0.0, got -0.1"),
    (lambda: Briggs(distance_threshold=float("nan")), "distance_threshold must be a finite number, got nan"),
    (lambda: Briggs(cluster_round=5, max_warmup_rounds=3), "cluster_round must be <= max_warmup_rounds=3, got 5"),
    (lambda: KMeansWeights(k=0), "k must be an integer >= 1, got 0"),
    (lambda: KMeansWeights(max_k=1), "max_k must be an integer >= 2, got 1"),
    (lambda: KMeansWeights(min_silhouette=-2), r"min_silhouette must be >= -1.0, got -2"),
    (lambda: KMeansWeights(cluster_round=0), "cluster_round must be an integer >= 1, got 0"),
    (lambda: KMeansWeights(cluster_round=11), "cluster_round must be <= max_warmup_rounds=10, got 11"),
    (lambda: KMeansWeights(n_init=0), "n_init must be an integer >= 1, got 0"),
])
def test_bad_parameters_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_sizes_above_the_client_count_are_refused_when_deciding():
    too_big = started(OCFL(min_cluster_size=5))
    with pytest.raises(ValueError, match="min_cluster_size=5 exceeds the 4 clients that sent updates in round 1"):
        feed(too_big, 1, ORTHOGONAL)
    with pytest.raises(ValueError, match="k=5 exceeds the 4 clients that sent updates in round 1"):
        feed(started(KMeansWeights(k=5)), 1, ORTHOGONAL)
    with pytest.raises(ValueError, match="k=6 exceeds the 4 clients that sent updates in round 2"):
        feed(started(OCFL(algorithm="kmeans", k=6)), 2, ORTHOGONAL)
