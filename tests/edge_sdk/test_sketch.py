"""Algorithm 1: per-class means, noise for absent classes, quantisation, real separation."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_digits

from edge_sdk import OnnxEncoder, Sketch, Sketcher, pairwise_hamming, stack_sketches


class LinearEncoder:
    """A fixed random linear map: a real encoder for unit tests of the averaging."""

    def __init__(self, n_in: int = 6, latent: int = 16, seed: int = 0) -> None:
        self.w = np.random.default_rng(seed).normal(size=(n_in, latent))
        self.latent_dim = latent

    def encode(self, x):
        return np.asarray(x, dtype=np.float64) @ self.w


def toy_data(classes, n_per=5, n_in=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.random((n_per * len(classes), n_in))
    y = np.repeat(np.asarray(classes), n_per)
    return x, y


def test_class_means_are_exact_and_absent_classes_are_uniform_noise():
    enc = LinearEncoder()
    x, y = toy_data([0, 2])
    vec, present = Sketcher(enc, num_classes=4, flip_prob=0.0, seed=1).class_means(x, y)
    assert present.tolist() == [True, False, True, False]
    z = enc.encode(x)
    np.testing.assert_allclose(vec[0], z[y == 0].mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(vec[2], z[y == 2].mean(axis=0), rtol=1e-12)
    assert (vec[[1, 3]] >= 0).all() and (vec[[1, 3]] < 1).all()
    other, _ = Sketcher(enc, num_classes=4, flip_prob=0.0, seed=2).class_means(x, y)
    np.testing.assert_array_equal(vec[[0, 2]], other[[0, 2]])  # data: independent of the seed
    assert not np.array_equal(vec[[1, 3]], other[[1, 3]])  # noise: depends on the seed


def test_absent_classes_produce_noise_bits_present_ones_do_not():
    enc = LinearEncoder(latent=16)
    x, y = toy_data([1, 4, 7])
    present = [1, 4, 7]
    absent = [c for c in range(10) if c not in present]
    runs = [Sketcher(enc, 10, flip_prob=0.0, seed=s).sketch(x, y).class_bits() for s in (1, 2, 3)]
    for other in runs[1:]:
        np.testing.assert_array_equal(runs[0][present], other[present])
        assert not np.array_equal(runs[0][absent], other[absent])
    # present classes hold exactly the rounded, min-max normalised class means
    means, _ = Sketcher(enc, 10, flip_prob=0.0, seed=1).class_means(x, y)
    lo = means.min(axis=1, keepdims=True)
    norm = (means - lo) / (means.max(axis=1, keepdims=True) - lo)
    np.testing.assert_array_equal(runs[0][present], np.round(norm[present]).astype(np.uint8))


def test_every_client_sends_the_same_length():
    enc = LinearEncoder(latent=20)
    full = Sketcher(enc, 10, 0.1, seed=0).sketch(*toy_data(list(range(10))))
    one = Sketcher(enc, 10, 0.1, seed=0).sketch(*toy_data([3]))
    assert full.n_bits == one.n_bits == 200
    assert len(full.bits) == len(one.bits) == 25


def test_seeding():
    enc = LinearEncoder()
    x, y = toy_data([0, 1, 2])
    a = Sketcher(enc, 3, 0.2, seed=5)
    assert a.sketch(x, y) == Sketcher(enc, 3, 0.2, seed=5).sketch(x, y)
    os_seeded = Sketcher(enc, 3, 0.2)
    # one OS key per Sketcher: asking again returns the same bits (no averaging attack) ...
    assert os_seeded.sketch(x, y) == os_seeded.sketch(x, y)
    # ... while two Sketchers draw different keys
    assert len({Sketcher(enc, 3, 0.5).sketch(x, y).bits for _ in range(4)}) == 4


@pytest.mark.parametrize(
    ("y", "message"),
    [
        (np.array([0, 1, 12, 3, 4]), r"labels must lie in \[0, 10\), got values from 0 to 12"),
        (np.array([-1, 1, 2, 3, 4]), r"labels must lie in \[0, 10\), got values from -1 to 4"),
        (np.array([0.0, 1, 2, 3, 4]), "labels must be integers, got dtype float64"),
        (np.array([0, 1, 2]), r"y must be a 1-D array of 5 labels \(one per sample\), got shape \(3,\)"),
    ],
)
def test_bad_labels_are_refused(y, message):
    x = np.random.default_rng(0).random((5, 6))
    with pytest.raises(ValueError, match=message):
        Sketcher(LinearEncoder(), 10, 0.1, seed=0).sketch(x, y)


def test_bad_parameters_are_refused():
    enc = LinearEncoder()
    with pytest.raises(ValueError, match=r"flip_prob must be in \[0, 0.5\], got 0.7"):
        Sketcher(enc, 10, 0.7)
    with pytest.raises(ValueError, match="num_classes must be a positive integer, got 0"):
        Sketcher(enc, 0, 0.1)
    with pytest.raises(ValueError, match="no samples"):
        Sketcher(enc, 10, 0.1).sketch(np.zeros((0, 6)), np.zeros(0, dtype=int))
    nan_x = np.full((2, 6), np.nan)
    with pytest.raises(ValueError, match="encoder returned NaN or Inf"):
        Sketcher(enc, 10, 0.1).sketch(nan_x, np.array([0, 1]))


def test_sketch_object_checks_its_bytes():
    with pytest.raises(ValueError, match="needs 25 bytes, got 24"):
        Sketch(bytes(24), num_classes=10, latent_dim=20)
    with pytest.raises(ValueError, match="padding bits past n_bits must be zero"):
        Sketch(bytes([0, 0b00000001]), num_classes=3, latent_dim=3)
    s = Sketch(bytes([0b10100000, 0]), num_classes=3, latent_dim=3)
    assert s.unpack().tolist() == [1, 0, 1, 0, 0, 0, 0, 0, 0]
    t = Sketch(bytes([0b00100000, 0b10000000]), num_classes=3, latent_dim=3)
    assert s.hamming(t) == 2
    with pytest.raises(ValueError, match="sketches differ in shape"):
        s.hamming(Sketch(bytes(1), num_classes=1, latent_dim=8))


def _digits_clients(rotations, per_client=150, seed=0):
    d = load_digits()
    images = (d.images / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(images))
    for i, k in enumerate(rotations):
        idx = order[i * per_client : (i + 1) * per_client]
        yield np.rot90(images[idx], k=k, axes=(1, 2)).copy(), d.target[idx]


@pytest.mark.parametrize("flip_prob", [0.0, 0.1])
def test_rotated_digits_sketch_farther_than_unrotated_pairs(flip_prob):
    """Real data, real ONNX encoder: the rotation groups separate in Hamming space."""
    encoder = OnnxEncoder("digits_encoder")
    rotations = [0, 0, 0, 0, 1, 1, 1, 1]  # four upright clients, four turned 90 degrees
    sketches = [
        Sketcher(encoder, 10, flip_prob, seed=i).sketch(x, y)
        for i, (x, y) in enumerate(_digits_clients(rotations))
    ]
    d = pairwise_hamming(sketches)
    g = np.array(rotations)
    same = (g[:, None] == g[None, :]) & ~np.eye(len(g), dtype=bool)
    upright_pairs = d[:4, :4][~np.eye(4, dtype=bool)]
    cross = d[:4, 4:]
    assert upright_pairs.max() < cross.min(), (upright_pairs, cross)
    assert d[same].mean() * 1.5 < d[~same & ~np.eye(len(g), dtype=bool)].mean()
    assert stack_sketches(sketches).shape == (8, 25)  # 10 classes x 20 bits = 25 bytes
