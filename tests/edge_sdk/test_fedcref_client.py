"""FedCRef, device side: the pure math against hand and brute-force values, validation, the client."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from edge_sdk.fedcref import (
    ARCHITECTURES,
    FedCRefClient,
    association_statistic,
    build_cluster_ae,
    check_alpha,
    check_tau,
    check_theta,
    dirty_labels,
    estimate_n_clusters,
    hungarian_accuracy,
    initial_ae_weights,
    join_models,
    minmax_normalize,
    normalized_differences,
    partition_points,
    reconstruction_errors,
    refine_labels,
    split_models,
    train_cluster_ae,
)
from edge_sdk.protocol import (
    Kind,
    Message,
    decode_message,
    encode_message,
    parse_tensors,
    tensors_body,
)
from server_kit.data.partition import load_digits_images

DIGITS_AE = "fedcref_ae_64_48_32_16"


# --------------------------------------------------------------------------- pure math


def test_minmax_normalize_by_hand():
    np.testing.assert_allclose(minmax_normalize([1.0, 3.0, 5.0, 2.0]), [0.0, 0.5, 1.0, 0.25])
    np.testing.assert_array_equal(minmax_normalize([2.0, 2.0, 2.0]), [0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="empty"):
        minmax_normalize([])


def test_association_statistic_by_hand():
    own = [1.0, 2.0, 3.0, 4.0, 5.0]
    ext = [1.0, 2.5, 3.0, 5.0, 9.0]
    # |diff| = [0, 0.5, 0, 1, 4] -> min-max [0, 0.125, 0, 0.25, 1]; sorted [0, 0, .125, .25, 1]
    # the 75th percentile (linear) sits at position 3 -> 0.25; the 50th at 2 -> 0.125
    assert association_statistic(own, ext, 75, "minmax") == pytest.approx(0.25)
    assert association_statistic(own, ext, 50, "minmax") == pytest.approx(0.125)
    assert association_statistic(own, ext, 100, "minmax") == pytest.approx(1.0)
    # relative: |diff| / max = [0, 0.2, 0, 0.2, 4/9]; sorted [0, 0, .2, .2, .444]
    np.testing.assert_allclose(normalized_differences(own, ext, "relative"), [0, 0.2, 0, 0.2, 4 / 9])
    assert association_statistic(own, ext, 75) == pytest.approx(0.2)  # "relative" is the default
    assert association_statistic(own, ext, 90, "relative") == pytest.approx(0.2 + 0.6 * (4 / 9 - 0.2))
    # the statistic is symmetric in its two error vectors and 0 for equal errors
    assert association_statistic(ext, own, 75, "minmax") == pytest.approx(0.25)
    assert association_statistic(own, own, 75, "relative") == 0.0
    assert association_statistic([0.0, 0.0], [0.0, 0.0], 75, "relative") == 0.0


def test_association_statistic_matches_brute_force():
    rng = np.random.default_rng(3)
    e1, e2 = rng.random(200), rng.random(200) * 2
    d = np.abs(e1 - e2)
    for alpha in (10.0, 75.0, 95.0):
        want = np.percentile((d - d.min()) / (d.max() - d.min()), alpha)
        assert association_statistic(e1, e2, alpha, "minmax") == pytest.approx(want)
        want_rel = np.percentile(d / np.maximum(e1, e2), alpha)
        assert association_statistic(e1, e2, alpha, "relative") == pytest.approx(want_rel)


def test_association_statistic_refuses_bad_input():
    with pytest.raises(ValueError, match="differ in length"):
        association_statistic([1.0, 2.0], [1.0], 75)
    with pytest.raises(ValueError, match="NaN or Inf"):
        association_statistic([1.0, np.nan], [1.0, 2.0], 75)
    with pytest.raises(ValueError, match="non-negative"):
        association_statistic([1.0, -2.0], [1.0, 2.0], 75)
    with pytest.raises(ValueError, match="normalization must be one of"):
        association_statistic([1.0], [1.0], 75, "zscore")


def test_hungarian_accuracy_paper_example_and_brute_force():
    # the paper's example after Eq. 6
    assert hungarian_accuracy([0, 0, 1, 1, 2], [2, 2, 1, 1, 0]) == 1.0
    assert hungarian_accuracy([0, 0, 0, 1], [5, 5, 7, 7]) == 0.75
    rng = np.random.default_rng(0)
    for _ in range(5):
        t = rng.integers(0, 3, 40)
        p = rng.integers(0, 3, 40)
        brute = max(np.mean(np.asarray(perm)[p] == t) for perm in itertools.permutations(range(3)))
        assert hungarian_accuracy(t, p) == pytest.approx(brute)
    # more predicted clusters than classes: the unmatched ones count as errors
    assert hungarian_accuracy([0, 0, 1, 1], [0, 1, 2, 3]) == 0.5
    with pytest.raises(ValueError, match="differ in length"):
        hungarian_accuracy([0, 1], [0])


def test_refine_labels_algorithm_2_by_hand():
    e = np.array([
        [0.1, 0.5, 0.9],
        [0.1, 0.5, 0.9],
        [0.1, 0.5, 0.9],
        [0.9, 0.2, 0.3],
        [0.9, 0.4, 0.3],
        [0.5, 0.9, 0.1],
    ])
    # round 1: votes m0 3, m1 1, m2 2 -> m0 takes samples 0-2; round 2 (m1, m2) on 3-5: m1 1, m2 2
    # -> m2 takes 4 and 5; sample 3 goes to the better of the selected m0 (0.9) and m2 (0.3)
    labels, selected = refine_labels(e, 2)
    assert selected == [0, 2]
    np.testing.assert_array_equal(labels, [0, 0, 0, 1, 1, 1])
    labels3, selected3 = refine_labels(e, 3)
    assert selected3 == [0, 2, 1]
    np.testing.assert_array_equal(labels3, [0, 0, 0, 2, 1, 1])
    # every sample explained before K models are chosen: fewer clusters
    labels1, selected1 = refine_labels(np.array([[0.1, 0.9], [0.2, 0.8]]), 2)
    assert selected1 == [0] and labels1.tolist() == [0, 0]
    with pytest.raises(ValueError, match="exceeds the number of models"):
        refine_labels(e, 4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        refine_labels(np.array([[np.nan, 1.0]]), 1)


def test_dirty_labels():
    y = np.repeat([3, 7, 9], 4000)
    clean = dirty_labels(y, 0.0, seed=0)
    np.testing.assert_array_equal(clean, np.repeat([0, 1, 2], 4000))
    noisy = dirty_labels(y, 0.3, seed=0)
    flipped = noisy != clean
    assert abs(flipped.mean() - 0.3) < 0.02
    assert hungarian_accuracy(y, noisy) == pytest.approx(1 - flipped.mean())
    with pytest.raises(ValueError, match=r"dirtiness must be a probability in \[0, 0.5\]"):
        dirty_labels(y, 0.6)
    with pytest.raises(ValueError, match="at least two true categories"):
        dirty_labels([1, 1, 1], 0.1)


def test_estimate_n_clusters_finds_three_blobs():
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.normal(c, 0.3, (60, 4)) for c in (0.0, 5.0, 10.0)])
    k, labels, scores = estimate_n_clusters(z, (2, 5), seed=0)
    assert k == 3
    assert sorted(scores) == [2, 3, 4, 5]
    assert hungarian_accuracy(np.repeat([0, 1, 2], 60), labels) == 1.0
    with pytest.raises(ValueError, match="k_range must satisfy 2 <= min <= max"):
        estimate_n_clusters(z, (1, 3))


def test_ward_partition_and_its_silhouette_choice_of_k():
    rng = np.random.default_rng(0)
    z = np.concatenate([rng.normal(c, 0.3, (40, 3)) for c in (0, 6, 12)])
    truth = np.repeat([0, 1, 2], 40)
    ward = partition_points(z, 3, "ward")
    assert ward.dtype == np.int64 and hungarian_accuracy(truth, ward) == 1.0
    np.testing.assert_array_equal(partition_points(z, 3, "ward", seed=5), ward)  # no randomness
    k, labels, scores = estimate_n_clusters(z, (2, 4), method="ward")
    assert k == 3 and sorted(scores) == [2, 3, 4]
    np.testing.assert_array_equal(labels, ward)


def test_partition_points_refuses_an_unknown_method_and_too_many_samples_for_ward():
    with pytest.raises(ValueError, match=r"method must be one of \('kmeans', 'ward'\), got 'dbscan'"):
        partition_points(np.zeros((4, 2)), 2, "dbscan")
    with pytest.raises(ValueError, match="Ward's clustering holds every pairwise distance: 5001 samples are more "
                                         "than 5000; use init='kmeans'"):
        partition_points(np.zeros((5001, 2)), 2, "ward")


@pytest.mark.parametrize(
    ("check", "bad", "match"),
    [
        (check_alpha, 0, r"alpha must be a percentile in \(0, 100\]"),
        (check_alpha, 100.5, r"alpha must be a percentile in \(0, 100\]"),
        (check_alpha, float("nan"), "alpha must be a percentile"),
        (check_alpha, True, "alpha must be a percentile"),
        (check_theta, 0.0, r"theta must be an association threshold in \(0, 1\]"),
        (check_theta, 1.2, r"theta must be an association threshold in \(0, 1\]"),
        (check_theta, -0.2, "theta must be an association threshold"),
        (check_theta, "0.2", "theta must be an association threshold"),
        (check_tau, 0, r"tau must be a stability threshold in \(0, 1\]"),
        (check_tau, 1.01, r"tau must be a stability threshold in \(0, 1\]"),
    ],
)
def test_thresholds_are_validated(check, bad, match):
    with pytest.raises(ValueError, match=match):
        check(bad)


def test_thresholds_accept_the_paper_values():
    assert (check_alpha(75), check_theta(0.2), check_tau(0.8)) == (75.0, 0.2, 0.8)
    assert (check_alpha(100), check_theta(1), check_tau(1)) == (100.0, 1.0, 1.0)


# --------------------------------------------------------------------------- models


def test_architectures_parameter_counts():
    torch = pytest.importorskip("torch")
    counts = {name: sum(p.numel() for p in build_cluster_ae(name).parameters()) for name in ARCHITECTURES}
    assert counts["fedcref_ae_784_100_64_32"] == 174_840  # the paper's Table 2
    assert counts["fedcref_ae_64_48_32_16"] == 10_480
    with torch.no_grad():
        out = build_cluster_ae(DIGITS_AE)(torch.rand(3, 64))
    assert out.shape == (3, 64) and float(out.min()) >= 0.0 and float(out.max()) <= 1.0


def test_training_lowers_the_reconstruction_error_and_is_seeded():
    x, y = load_digits_images()
    x = x[y == 0][:80]
    w0 = initial_ae_weights(DIGITS_AE, 0)
    before = reconstruction_errors(DIGITS_AE, w0, x).mean()
    w1, loss = train_cluster_ae(DIGITS_AE, w0, x, epochs=15, batch_size=16, seed=1)
    after = reconstruction_errors(DIGITS_AE, w1, x).mean()
    assert after < 0.5 * before
    assert loss == pytest.approx(after, rel=0.5)
    w2, _ = train_cluster_ae(DIGITS_AE, w0, x, epochs=15, batch_size=16, seed=1)
    for name in w1:
        np.testing.assert_array_equal(w1[name], w2[name])
    with pytest.raises(ValueError, match="epochs must be an integer >= 1"):
        train_cluster_ae(DIGITS_AE, w0, x, epochs=0)
    with pytest.raises(ValueError, match="the autoencoder takes 64"):
        reconstruction_errors(DIGITS_AE, w0, np.zeros((2, 784), dtype=np.float32))


def test_join_and_split_models_round_trip():
    a = {"w": np.ones((2, 2), np.float32)}
    b = {"w": np.zeros((2, 2), np.float32), "b": np.ones(2, np.float32)}
    joined = join_models({0: a, "1": b})
    assert sorted(joined) == ["0/w", "1/b", "1/w"]
    back = split_models(joined)
    assert set(back) == {"0", "1"} and set(back["1"]) == {"w", "b"}
    with pytest.raises(ValueError, match="not of the form"):
        split_models({"w": a["w"]})


# --------------------------------------------------------------------------- the client


def _client(cid: str, classes, *, seed: int, **kw) -> tuple[FedCRefClient, np.ndarray]:
    x, y = load_digits_images()
    rng = np.random.default_rng(seed)
    idx = np.concatenate([rng.choice(np.flatnonzero(y == c), 60, replace=False) for c in classes])
    return FedCRefClient(cid, x[idx], seed=seed, **kw), y[idx]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"alpha": 0}, r"alpha must be a percentile in \(0, 100\]"),
        ({"normalization": "zscore"}, "normalization must be one of"),
        ({"init": "dec"}, "init must be one of"),
        ({"dirtiness": 0.7}, r"dirtiness must be a probability in \[0, 0.5\]"),
        ({"epochs": 0}, "epochs must be an integer >= 1"),
        ({"k_range": (1, 4)}, "k_range must satisfy"),
        ({"architecture": "fedcref_ae_784_100_64_32"}, "takes 784 features, x has 64"),
    ],
)
def test_client_refuses_bad_parameters(kw, match):
    x, _ = load_digits_images()
    with pytest.raises(ValueError, match=match):
        FedCRefClient("c0", x[:20], **kw)


def test_client_refuses_bad_data():
    with pytest.raises(ValueError, match=r"finite values in \[0, 1\]"):
        FedCRefClient("c0", np.full((5, 64), 2.0, dtype=np.float32))
    with pytest.raises(ValueError, match="cid must be"):
        FedCRefClient("a/b", np.zeros((5, 64), dtype=np.float32))
    client = FedCRefClient("c0", np.zeros((5, 64), dtype=np.float32), init="dirty")
    with pytest.raises(ValueError, match="needs true_labels"):
        client.initialize()


def test_client_kmeans_init_estimates_k_on_digit_latents():
    client, y = _client("c0", (0, 3, 6), seed=0, init="kmeans")
    meta, tensors = client.initialize()
    assert meta["type"] == "hello" and tensors == {}
    assert client.n_clusters_ == 3
    assert client.latents_.shape == (180, 20)  # the shipped digits encoder
    assert set(client.silhouette_) == {2, 3, 4, 5}
    assert hungarian_accuracy(y, client.labels_) > 0.95


def test_client_ward_init_estimates_k_on_digit_latents():
    client, y = _client("c0", (0, 3, 6), seed=0, init="ward")
    client.initialize()
    assert client.n_clusters_ == 3
    assert client.latents_.shape == (180, 20)
    assert set(client.silhouette_) == {2, 3, 4, 5}
    assert hungarian_accuracy(y, client.labels_) > 0.95
    with pytest.raises(ValueError, match="init must be one of"):
        FedCRefClient("c0", np.zeros((5, 64), dtype=np.float32), init="spectral")


def test_client_objects_survive_the_wire_and_refinement_keeps_k():
    """Two clients holding digit 0: their 0-clusters associate both ways, their others do not."""
    kw = {"init": "dirty", "dirtiness": 0.2, "epochs": 40, "batch_size": 16}
    a, ya = _client("a", (0, 1), seed=1, **kw)
    b, yb = _client("b", (0, 4), seed=2, **kw)
    a._set_labels(dirty_labels(ya, 0.0))  # start a clean, b dirty
    a.true_labels, b.true_labels = ya, yb
    b.initialize()
    a.initial_labels_ = a.labels_.copy()

    def wire(kind, payload, sender):
        meta, tensors = payload
        raw = encode_message(Message(kind, "t", sender, 1, meta, tensors_body(tensors) if tensors else b""))
        msg = decode_message(raw, expected_sender=sender)
        return dict(msg.meta), (parse_tensors(msg.body) if msg.body else {})

    ups = {c.cid: wire(Kind.UPDATE, c.train_models({"iteration": 1, "train": True}), c.cid) for c in (a, b)}
    assert sorted(ups["a"][1]) == sorted(f"{q}/{k}" for q in (0, 1) for k in a.models_[0])
    a.receive_models(*ups["b"])
    b.receive_models(*ups["a"])
    assert a.train_models({"iteration": 2, "train": False}) is None  # nothing changed: nothing to send
    ra, ta = wire(Kind.FEATURES, a.association_report({"iteration": 1}), "a")
    rb, tb = wire(Kind.FEATURES, b.association_report({"iteration": 1}), "b")
    assert ra["clusters"] == ["a:0", "a:1"] and ra["external"] == ["b:0", "b:1"]
    sa, sb = ta["stat"], tb["stat"]
    assert sa.shape == (2, 2) and sa.dtype == np.float32
    # digit 0 is cluster 0 on both sides: the only pair that passes theta = 0.3 both ways
    passes = (sa <= 0.3) & (sb.T <= 0.3)
    assert passes.tolist() == [[True, False], [False, False]]
    # a community model for digit 0, one FedAvg round by both members
    meta = {"type": "community_model", "community": 0, "round": 1, "iteration": 1}
    ua = a.community_update({**meta, "members": ["a:0"]}, a.models_[0])
    ub = b.community_update({**meta, "members": ["b:0"]}, a.models_[0])
    assert ua[0]["n"] == int((a.labels_ == 0).sum()) and ub[0]["community"] == 0
    with pytest.raises(ValueError, match="got community 0 training for b:0"):
        a.community_update({**meta, "members": ["b:0"]}, a.models_[0])
    comm = {"type": "community_models", "iteration": 1, "communities": [0], "versions": ["1.0"],
            "members": {"0": ["a:0", "b:0"]}}
    before = hungarian_accuracy(yb, b.labels_)
    report, _ = wire(Kind.METRICS, b.refine(comm, join_models({"0": ua[1]})), "b")
    assert report["n_clusters"] == 2 == b.n_clusters_
    assert report["stability"] == pytest.approx(hungarian_accuracy(b.initial_labels_, b.labels_))
    assert hungarian_accuracy(yb, b.labels_) > before + 0.1  # the 20 % noise is mostly cleaned
    assert {s["community"] for s in report["selected"]} == {0, -1}


@pytest.mark.parametrize("own_models", [True, False])
def test_a_cluster_defined_by_a_community_model_publishes_a_model_of_its_own(own_models):
    """Algorithm 1, line 8: the published cluster models are trained on the device's own clusters."""
    c, y = _client("c", (0, 1), seed=3, init="dirty", dirtiness=0.4, epochs=1, batch_size=16,
                   link_communities=False, own_models=own_models)
    c.true_labels = y
    c.initialize()
    c.train_models({"iteration": 1, "train": True})  # one epoch on 40 % wrong labels: poor own models
    x = c.x
    start = initial_ae_weights(c.architecture, 0)
    comm = {str(d): train_cluster_ae(c.architecture, start, x[y == d], epochs=60, batch_size=16, seed=d)[0]
            for d in (0, 1)}
    meta = {"type": "community_models", "iteration": 1, "communities": [0, 1], "versions": ["1.0", "1.1"],
            "members": {"0": [], "1": []}}
    report, _ = c.refine(meta, join_models(comm))
    picked = [s for s in report["selected"] if s["kind"] == "community"]
    assert picked, report["selected"]  # the clean community models beat the poor own ones
    # a stable device is told not to train: it still publishes, and what it publishes says what it owns
    meta_up, tensors = c.train_models({"iteration": 2, "train": False})
    published = split_models(tensors)
    for p, s in enumerate(report["selected"]):
        if s["kind"] != "community":
            continue
        same = all(np.array_equal(published[str(p)][k], comm[str(s["g"])][k]) for k in comm[str(s["g"])])
        assert same is (not own_models), (p, s)
    assert c.train_models({"iteration": 3, "train": False}) is None  # retrained once, then nothing new


def test_community_check_matrix_tests_other_community_models_against_the_own_communitys_model():
    from edge_sdk.fedcref.association import check_homes, community_check_matrix

    labels = np.array([0, 0, 0, 0, 1, 1, 2, 2])
    rng = np.random.default_rng(0)
    # own clusters 0 (in community 5) and 2 (in community 3); cluster 1 is in none; another client's node is skipped
    home = check_homes("c1", {"5": ["c1:0", "c9:0"], "3": ["c1:2"], "8": ["c9:1"]})
    assert home == {0: "5", 2: "3"}
    errors = {g: rng.uniform(0.1, 1.0, labels.size) for g in ("3", "5", "8")}
    stat, nodes = community_check_matrix("c1", labels, home, errors, alpha=75)
    assert nodes == ["c1:0", "c1:2"]
    assert stat.dtype == np.float32 and stat.shape == (2, 3)  # columns: communities 3, 5, 8

    def s(g, h, m):
        return association_statistic(errors[g][m], errors[h][m])

    m0, m2 = labels == 0, labels == 2
    np.testing.assert_allclose(stat[0], [s("5", "3", m0), 0.0, s("5", "8", m0)], rtol=1e-6)
    np.testing.assert_allclose(stat[1], [0.0, s("3", "5", m2), s("3", "8", m2)], rtol=1e-6)
    assert stat[0, 0] != stat[1, 1]  # each side on its own samples with its own community's model
    # an empty member cluster never links; a member whose community model is missing is refused
    stat, _ = community_check_matrix("c1", labels, {7: "5"}, errors)
    np.testing.assert_array_equal(stat, np.ones((1, 3)))
    with pytest.raises(ValueError, match="cluster 0 is in community 4, whose model is missing"):
        community_check_matrix("c1", labels, {0: "4"}, errors)
