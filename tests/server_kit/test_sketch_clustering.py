"""SketchClustering: Ward on Hamming bits, CH-maximising threshold search, one-cluster test."""

from __future__ import annotations

import re

import numpy as np
import pytest
from scipy.cluster.hierarchy import fcluster, linkage
from scipy.spatial.distance import pdist
from sklearn.datasets import load_digits
from sklearn.metrics import adjusted_rand_score, calinski_harabasz_score

import server_kit.clustering as clustering
from edge_sdk import OnnxEncoder, Sketcher, hamming_pdist, stack_sketches
from server_kit.clustering import (
    SketchClustering,
    calinski_harabasz_bits,
    cut_profile,
    plot_search,
    ward_linkage,
)


def noisy_groups(sizes, n_bits, flip_prob, seed=0):
    """Sketches of clients drawn from one random prototype per group, bits flipped with P.

    Returns ``(packed, bits, truth, prototypes, rng)``; the rng goes on to make late joiners.
    """
    rng = np.random.default_rng(seed)
    protos = rng.integers(0, 2, size=(len(sizes), n_bits), dtype=np.uint8)
    truth = np.repeat(np.arange(len(sizes)), sizes)
    bits = protos[truth] ^ (rng.random((truth.size, n_bits)) < flip_prob).astype(np.uint8)
    return np.packbits(bits, axis=1), bits, truth, protos, rng


def sizes_of(labels):
    return np.bincount(labels)


# ----------------------------------------------------------------- the maths


def test_ward_on_sqrt_hamming_equals_ward_on_float_bits():
    packed, bits, *_ = noisy_groups([20, 15, 25], n_bits=37, flip_prob=0.2, seed=1)
    d = hamming_pdist(packed, 37)
    np.testing.assert_array_equal(d, np.rint(pdist(bits, "hamming") * 37).astype(np.int32))
    ours = linkage(np.sqrt(d), method="ward")
    reference = linkage(bits.astype(float), "ward")
    np.testing.assert_array_equal(ours[:, [0, 1, 3]], reference[:, [0, 1, 3]])
    np.testing.assert_allclose(ours[:, 2], reference[:, 2], rtol=1e-12)
    np.testing.assert_array_equal(ward_linkage(d), ours)


def test_ch_of_every_cut_matches_scikit_learn_on_the_bits():
    packed, bits, *_ = noisy_groups([12, 9, 14, 5], n_bits=45, flip_prob=0.25, seed=2)
    z = ward_linkage(hamming_pdist(packed, 45))
    prof = cut_profile(z)
    n = bits.shape[0]
    for k in range(2, 12):
        labels = fcluster(z, k, criterion="maxclust")
        assert labels.max() == k
        expected = calinski_harabasz_score(bits, labels)
        np.testing.assert_allclose(prof.ch[n - k], expected, rtol=1e-9)
        np.testing.assert_allclose(calinski_harabasz_bits(bits, labels), expected, rtol=1e-12)
    assert np.isnan(prof.ch[-1]) and prof.n_clusters[-1] == 1


def test_cut_profile_size_rule_matches_fcluster():
    packed, bits, *_ = noisy_groups([30, 30, 4], n_bits=64, flip_prob=0.2, seed=3)
    z = ward_linkage(hamming_pdist(packed, 64))
    for mcs in (1, 3, 5, 10):
        prof = cut_profile(z, mcs)
        for m in np.flatnonzero(prof.reachable)[::3]:
            if m == 0:
                continue
            t = z[m - 1, 2]
            labels = fcluster(z, t, criterion="distance")
            assert labels.max() == prof.n_clusters[m]
            ok = labels.max() >= 2 and sizes_of(labels)[1:].min() >= mcs
            assert prof.allowed[m] == ok, (mcs, m)


def test_calinski_harabasz_bits_rejects_a_single_cluster():
    with pytest.raises(ValueError, match="2 <= clusters < samples"):
        calinski_harabasz_bits(np.eye(4, dtype=np.uint8), np.zeros(4, dtype=int))


# ----------------------------------------------------------- synthetic groups


@pytest.mark.parametrize("n_bits", [200, 1240])
def test_four_groups_of_25_are_recovered(n_bits):
    packed, bits, truth, *_ = noisy_groups([25] * 4, n_bits=n_bits, flip_prob=0.2)
    model = SketchClustering(random_state=0)
    assert model.fit(packed, n_bits) is model
    assert adjusted_rand_score(truth, model.labels_) == 1.0
    assert model.n_clusters_ == 4 and model.n_bits_ == n_bits
    assert sorted(np.unique(model.labels_)) == [0, 1, 2, 3]
    assert model.labels_[0] == 0  # numbered in order of first appearance
    np.testing.assert_allclose(model.ch_score_, calinski_harabasz_score(bits, model.labels_))
    # CH is maximised: the chosen probe is the best admissible one
    valid = [s for s in model.search_ if s["valid"]]
    assert len(model.search_) == 35 and valid
    assert model.ch_score_ == pytest.approx(max(s["ch"] for s in valid))
    assert model.ch_score_ == pytest.approx(model.max_ch_)
    low, high = model.threshold_range_
    assert low <= model.threshold_ < high
    assert set(model.search_[0]) == {"threshold", "ch", "n_clusters", "valid"}
    # the permutation test found structure
    assert model.null_pvalue_ <= 0.05 and model.null_ch_.shape == (19,)
    assert model.null_observed_ch_ > model.null_ch_.max()
    # fitted arrays
    assert model.distances_.dtype == np.int32 and model.distances_.shape == (100 * 99 // 2,)
    np.testing.assert_array_equal(model.distances_, hamming_pdist(packed, n_bits))
    assert model.linkage_.shape == (99, 4)
    assert model.centroids_.shape == (4, n_bits)
    for c in range(4):
        np.testing.assert_allclose(model.centroids_[c], bits[model.labels_ == c].mean(axis=0))
    np.testing.assert_array_equal(model.fit_predict(packed, n_bits), model.labels_)


def test_default_range_scales_with_sketch_length():
    ranges = {}
    for n_bits in (200, 1240, 7680):
        packed, _, truth, *_ = noisy_groups([25] * 4, n_bits=n_bits, flip_prob=0.2)
        model = SketchClustering(random_state=0).fit(packed, n_bits)
        assert model.n_clusters_ == 4
        ranges[n_bits] = model.threshold_range_
    # Ward heights grow like sqrt(n_bits): about 2.5x from 200 to 1,240 bits
    assert ranges[1240][1] > 2 * ranges[200][1] and ranges[7680][1] > 2 * ranges[1240][1]
    assert ranges[1240][0] > 2 * ranges[200][0]
    assert ranges[200][1] < 100 < ranges[7680][1]  # outgrows the reference's fixed (1, 100)


def test_one_prototype_gives_one_cluster():
    """No grouping: CH still picks a split; the permutation test refuses it."""
    packed, _, _, _, _ = noisy_groups([100], n_bits=200, flip_prob=0.2, seed=4)
    model = SketchClustering(random_state=0).fit(packed, 200)
    assert model.n_clusters_ == 1
    np.testing.assert_array_equal(model.labels_, np.zeros(100))
    assert model.ch_score_ is None
    assert model.null_pvalue_ > 0.05
    assert model.max_ch_ > 0  # an admissible split was on offer ...
    assert model.search_ == []  # ... but the test refused it first, so no search ran
    assert 1 <= model.null_ch_.size < 19  # and it stopped early (sequential test)
    assert model.threshold_ == model.linkage_[-1, 2]
    assert model.centroids_.shape == (1, 200)


def test_two_groups_give_two_clusters():
    """The reference code can never return fewer than 3 clusters; CH maximisation can."""
    packed, _, truth, *_ = noisy_groups([30, 30], n_bits=200, flip_prob=0.2, seed=5)
    model = SketchClustering(random_state=0).fit(packed, 200)
    assert model.n_clusters_ == 2
    assert adjusted_rand_score(truth, model.labels_) == 1.0


def test_min_cluster_size_is_respected():
    packed, _, truth, *_ = noisy_groups([40, 40, 8], n_bits=200, flip_prob=0.05, seed=6)
    small = SketchClustering(min_cluster_size=5, random_state=0).fit(packed, 200)
    assert small.n_clusters_ == 3
    assert adjusted_rand_score(truth, small.labels_) == 1.0
    big = SketchClustering(min_cluster_size=10, random_state=0).fit(packed, 200)
    assert big.n_clusters_ == 2  # the group of 8 may not stand alone: it joins another
    assert sorted(sizes_of(big.labels_)) == [40, 48]
    for probe in big.search_:
        labels = fcluster(big.linkage_, probe["threshold"], criterion="distance")
        assert probe["n_clusters"] == labels.max()
        assert probe["valid"] == (labels.max() >= 2 and sizes_of(labels)[1:].min() >= 10)


def test_inadmissible_probes_are_recorded_with_a_given_range():
    packed, _, truth, *_ = noisy_groups([25] * 4, n_bits=200, flip_prob=0.2)
    model = SketchClustering(min_cluster_size=10, threshold_range=(1.0, 100.0), random_state=0)
    model.fit(packed, 200)
    assert model.threshold_range_ == (1.0, 100.0)
    bad = [s for s in model.search_ if not s["valid"]]
    assert bad, "the reference range (1, 100) holds inadmissible thresholds"
    assert all(s["ch"] is None for s in bad if s["n_clusters"] == 1)
    assert adjusted_rand_score(truth, model.labels_) == 1.0


@pytest.mark.parametrize("n", [1, 5])
def test_too_few_clients_form_one_cluster(n):
    packed, *_ = noisy_groups([n], n_bits=16, flip_prob=0.3)
    model = SketchClustering(min_cluster_size=3).fit(packed, 16)
    assert model.n_clusters_ == 1 and model.labels_.tolist() == [0] * n
    assert model.search_ == [] and model.null_pvalue_ is None and model.ch_score_ is None
    assert model.linkage_.shape == (n - 1, 4)
    assert model.predict(packed).tolist() == [0] * n


def test_identical_sketches_form_one_cluster():
    packed = np.tile(np.array([[0b10110000, 0b01000000]], dtype=np.uint8), (12, 1))
    model = SketchClustering(random_state=0).fit(packed, 10)
    assert model.n_clusters_ == 1 and model.search_ == []
    assert (model.distances_ == 0).all() and model.threshold_ == 0.0
    np.testing.assert_array_equal(model.centroids_[0], np.unpackbits(packed[0])[:10])


# --------------------------------------------------------------- prediction


def test_predict_sends_late_joiners_to_their_group():
    packed, _, truth, protos, rng = noisy_groups([25] * 4, n_bits=200, flip_prob=0.2)
    model = SketchClustering(random_state=0).fit(packed, 200)
    cluster_of_group = {g: int(np.bincount(model.labels_[truth == g]).argmax()) for g in range(4)}
    group = np.repeat(np.arange(4), 10)
    fresh = protos[group] ^ (rng.random((40, 200)) < 0.2).astype(np.uint8)
    got = model.predict(np.packbits(fresh, axis=1))
    np.testing.assert_array_equal(got, [cluster_of_group[g] for g in group])
    np.testing.assert_array_equal(model.predict(packed), model.labels_)


def test_predict_breaks_ties_to_the_lower_label_and_checks_length():
    model = SketchClustering()
    model.n_bits_ = 8
    model.centroids_ = np.array([[1.0] * 8, [0.0] * 8, [0.5] * 8])
    x = np.packbits(np.array([[1, 1, 1, 1, 0, 0, 0, 0], [0] * 8], dtype=np.uint8), axis=1)
    # first row: 4 from both 0 and 1, 2 from the middle centroid; second: nearest is 1
    assert model.predict(x).tolist() == [2, 1]
    model.centroids_ = np.array([[1.0] * 8, [0.0] * 8])
    assert model.predict(x[:1]).tolist() == [0]  # a tie: the lower label
    with pytest.raises(ValueError, match="8 bits need 1"):
        model.predict(np.zeros((1, 2), dtype=np.uint8))
    with pytest.raises(ValueError, match="not fitted"):
        SketchClustering().predict(x)


# --------------------------------------------------- seeds, parameters, plot


def test_results_are_reproducible_with_random_state():
    packed, *_ = noisy_groups([25] * 4, n_bits=200, flip_prob=0.2)
    a = SketchClustering(random_state=7).fit(packed, 200)
    b = SketchClustering(random_state=7).fit(packed, 200)
    assert a.search_ == b.search_ and a.threshold_ == b.threshold_
    np.testing.assert_array_equal(a.labels_, b.labels_)
    np.testing.assert_array_equal(a.null_ch_, b.null_ch_)
    c = SketchClustering(random_state=8).fit(packed, 200)
    assert [s["threshold"] for s in c.search_] != [s["threshold"] for s in a.search_]


def test_the_null_test_subsamples_many_clients():
    packed, _, truth, *_ = noisy_groups([20] * 3, n_bits=120, flip_prob=0.2, seed=9)
    model = SketchClustering(null_max_clients=30, random_state=0).fit(packed, 120)
    assert model.n_clusters_ == 3 and adjusted_rand_score(truth, model.labels_) == 1.0
    assert model.null_observed_ch_ != model.max_ch_  # computed on 30 of the 60 clients
    skipped = SketchClustering(n_null=0, random_state=0).fit(packed, 120)
    assert skipped.null_pvalue_ is None and skipped.null_ch_.size == 0
    np.testing.assert_array_equal(skipped.labels_, model.labels_)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"min_cluster_size": 0}, "min_cluster_size must be an integer >= 1"),
        ({"min_cluster_size": 2.5}, "min_cluster_size must be an integer"),
        ({"n_calls": 0}, "n_calls must be an integer >= 1"),
        ({"n_initial_points": 0}, "n_initial_points must be an integer >= 1"),
        ({"n_calls": 10, "n_initial_points": 20}, "n_initial_points must be at most n_calls"),
        ({"acq_func": "UCB"}, r"acq_func must be one of \('EI', 'LCB', 'PI', 'gp_hedge'\)"),
        ({"kappa": -1.0}, "kappa must be a finite number >= 0"),
        ({"threshold_range": (5.0, 1.0)}, "threshold_range must be None or a pair"),
        ({"threshold_range": (0.0, 10.0)}, "threshold_range must be None or a pair"),
        ({"threshold_range": 10.0}, "threshold_range must be None or a pair"),
        ({"single_cluster_alpha": 1.5}, r"single_cluster_alpha must be a number in \(0, 1\)"),
        ({"n_null": -1}, "n_null must be an integer >= 0"),
        ({"n_null": 5}, "n_null must be 0 .* or at least 19"),
        ({"null_max_clients": 3}, "null_max_clients must be an integer >= 10"),
    ],
)
def test_bad_parameters_raise_naming_the_parameter(params, match):
    packed, *_ = noisy_groups([10, 10], n_bits=16, flip_prob=0.1)
    with pytest.raises(ValueError, match=match):
        SketchClustering(**params).fit(packed, 16)


def test_bad_input_raises():
    model = SketchClustering()
    with pytest.raises(ValueError, match="packed must be a 2-D uint8 array"):
        model.fit(np.zeros((4, 2)), 16)
    with pytest.raises(ValueError, match="packed rows hold 2 bytes; 20 bits need 3"):
        model.fit(np.zeros((4, 2), dtype=np.uint8), 20)
    with pytest.raises(ValueError, match="n_bits must be an integer >= 1"):
        model.fit(np.zeros((4, 2), dtype=np.uint8), 0)
    with pytest.raises(ValueError, match="no sketches"):
        model.fit(np.zeros((0, 2), dtype=np.uint8), 16)


def test_init_stores_arguments_unchanged():
    model = SketchClustering(threshold_range=[1, 2], random_state=3, min_cluster_size=4)
    assert model.threshold_range == [1, 2] and model.random_state == 3
    assert model.get_params()["min_cluster_size"] == 4
    assert "min_cluster_size=4" in repr(model)
    with pytest.raises(TypeError):
        SketchClustering(4)  # keyword-only


def test_plot_search_writes_a_figure(tmp_path):
    packed, *_ = noisy_groups([25] * 4, n_bits=200, flip_prob=0.2)
    model = SketchClustering(min_cluster_size=10, threshold_range=(1.0, 100.0), random_state=0)
    out = plot_search(model.fit(packed, 200), tmp_path / "search.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_package_exports_are_sorted():
    assert clustering.__all__ == sorted(clustering.__all__)


# ------------------------------------------------------------ real sketches


def digit_rotation_sketches(flip_prob, n_clients=20, seed=0):
    """scikit-learn digits over 20 clients, client i rotated by 90 * (i mod 4) degrees."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(images))
    encoder = OnnxEncoder("digits_encoder")
    sketches = []
    for i, idx in enumerate(np.array_split(order, n_clients)):
        x = np.rot90(images[idx], k=i % 4, axes=(1, 2)).copy()
        sketcher = Sketcher(encoder, 10, flip_prob=flip_prob, seed=100 + i)
        sketches.append(sketcher.sketch(x, digits.target[idx]))
    return stack_sketches(sketches), sketches[0].n_bits, np.arange(n_clients) % 4


def test_real_digit_sketches_flat_choice_splits_along_the_rotation_axis():
    """Real sketches (shipped ONNX encoder, P = 0.1), the paper's flat choice (refine=False).

    The encoder places a digit and its 180-degree turn close together (mean
    Hamming distance about 23 of 160 bits without flips, against 8 inside a
    group and 79 between a quarter turn). CH maximisation therefore picks the
    two groups {0, 180} and {90, 270}, exactly; it does not split them into
    the four rotations (CH is higher for k = 2 than k = 4 even with P = 0).
    """
    packed, n_bits, rotation = digit_rotation_sketches(flip_prob=0.1)
    model = SketchClustering(min_cluster_size=3, refine=False, random_state=0).fit(packed, n_bits)
    axis = rotation % 2  # 0 and 180 degrees vs 90 and 270
    assert adjusted_rand_score(axis, model.labels_) == 1.0
    assert model.n_clusters_ == 2 and model.null_pvalue_ <= 0.05
    assert model.refinements_ == []


@pytest.mark.parametrize("data_seed", [0, 1, 2])
def test_real_digit_sketches_refined_recover_the_four_rotations(data_seed):
    """With refinement (the default) each pair is tested on its own and split: ARI 1.0 at P = 0.1."""
    packed, n_bits, rotation = digit_rotation_sketches(flip_prob=0.1, seed=data_seed)
    model = SketchClustering(min_cluster_size=3, random_state=0).fit(packed, n_bits)
    assert adjusted_rand_score(rotation, model.labels_) == 1.0
    assert model.n_clusters_ == 4
    assert [r["n_clusters"] for r in model.refinements_] == [2, 2]
    # late joiners: a fresh client of each rotation goes to its group's cluster
    fresh, _, fresh_rot = digit_rotation_sketches(flip_prob=0.1, n_clients=8, seed=data_seed + 10)
    pred = model.predict(fresh)
    by_group = {int(g): int(model.labels_[np.flatnonzero(rotation == g)[0]]) for g in range(4)}
    assert pred.tolist() == [by_group[int(g)] for g in fresh_rot]


def test_refinement_does_not_split_homogeneous_groups():
    """Four well separated synthetic groups: the refinement tests each and keeps it whole."""
    packed, _, truth, *_ = noisy_groups([25, 25, 25, 25], n_bits=200, flip_prob=0.2, seed=3)
    model = SketchClustering(min_cluster_size=5, random_state=0).fit(packed, 200)
    assert adjusted_rand_score(truth, model.labels_) == 1.0
    assert model.refinements_ and all(r["n_clusters"] == 1 for r in model.refinements_)


def test_real_digit_sketches_hold_the_four_rotations_in_the_dendrogram():
    packed, n_bits, rotation = digit_rotation_sketches(flip_prob=0.0)
    model = SketchClustering(min_cluster_size=3, random_state=0).fit(packed, n_bits)
    four = fcluster(model.linkage_, 4, criterion="maxclust")
    assert adjusted_rand_score(rotation, four) == 1.0
    prof = cut_profile(model.linkage_, 3)
    assert prof.ch[20 - 2] > prof.ch[20 - 4]  # why the flat search stops at the top split
    flat = SketchClustering(min_cluster_size=3, refine=False, random_state=0).fit(packed, n_bits)
    assert adjusted_rand_score(rotation % 2, flat.labels_) == 1.0
    assert adjusted_rand_score(rotation, model.labels_) == 1.0  # refinement finds all four


def test_block_clipped_distances_are_the_sum_of_clipped_block_hammings():
    """sketch_pdist with a clip: every pair's blocks compared, each block's Hamming capped, summed (pdist order)."""
    from scipy.spatial.distance import squareform

    from server_kit.clustering.distances import sketch_pdist

    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2, size=(600, 60), dtype=np.uint8)  # 600 rows: two chunks of rows
    got = sketch_pdist(np.packbits(bits, axis=1), 60, block_bits=20, noise_clip=7)
    i, j = 5, 577
    want = sum(min(int((bits[i, b:b + 20] != bits[j, b:b + 20]).sum()), 7) for b in (0, 20, 40))
    assert got.dtype == np.int32 and got.size == 600 * 599 // 2
    assert squareform(got)[i, j] == want
    plain = sketch_pdist(np.packbits(bits, axis=1), 60)
    assert squareform(plain)[i, j] == int((bits[i] != bits[j]).sum())
    assert (got <= plain).all() and (got <= 21).all()


@pytest.mark.parametrize(("kw", "message"), [
    ({"noise_clip": 9}, "noise_clip needs block_bits (the bits of one class block), got noise_clip=9"),
    ({"block_bits": 0, "noise_clip": 9}, "block_bits must be an integer >= 1, got 0"),
    ({"block_bits": 20, "noise_clip": 0}, "noise_clip must be an integer >= 1, got 0"),
])
def test_noise_clip_settings_are_checked(kw, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SketchClustering(**kw).fit(np.zeros((4, 25), dtype=np.uint8), 200)


def test_a_clipped_fit_builds_its_dendrogram_on_the_clipped_distances():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2, size=(30, 200), dtype=np.uint8)
    bits[:15, :40] = 0  # two groups that share a class block pattern each
    bits[15:, :40] = 1
    packed = np.packbits(bits, axis=1)
    m = SketchClustering(min_cluster_size=5, block_bits=20, noise_clip=9, random_state=0).fit(packed, 200)
    from server_kit.clustering.distances import block_clipped_pdist

    assert np.array_equal(m.distances_, block_clipped_pdist(bits, 20, 9))
    assert m.n_clusters_ == 2 and adjusted_rand_score(np.repeat([0, 1], 15), m.labels_) == 1.0
    auto = SketchClustering(min_cluster_size=5, block_bits=20, random_state=0).fit(packed, 200)
    assert np.array_equal(auto.distances_, m.distances_)  # the default clip of 20-bit blocks is 9


@pytest.mark.parametrize(("block_bits", "clip"), [(1, 1), (4, 2), (8, 3), (10, 4), (16, 7), (20, 9), (64, 30),
                                                  (768, 377)])
def test_the_default_clip_is_half_a_noise_deviation_below_its_mean(block_bits, clip):
    from server_kit.clustering.distances import default_noise_clip

    assert default_noise_clip(block_bits) == clip


def test_long_blocks_are_clipped_alike():
    """Blocks past 64 bits (a matrix product; shorter ones: XOR and popcount) are clipped and summed alike."""
    from scipy.spatial.distance import squareform

    from server_kit.clustering.distances import block_clipped_pdist

    bits = np.random.default_rng(2).integers(0, 2, size=(40, 260), dtype=np.uint8)
    long = squareform(block_clipped_pdist(bits, 130, 60))
    plain = [(bits[:, None, b:b + 130] != bits[None, :, b:b + 130]).sum(-1) for b in (0, 130)]
    assert np.array_equal(long, np.minimum(plain[0], 60) + np.minimum(plain[1], 60))
