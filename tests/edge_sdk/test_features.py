"""LADD's client summary: per-class centred FFT amplitudes."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.features import SUMMARIES, default_ladd_b, ladd_features


def images(n, h, w, seed=0):
    return np.random.default_rng(seed).random((n, h, w)).astype(np.float32)


def test_window_sizes_follow_the_image_size():
    y = np.arange(10) % 10
    assert ladd_features(images(10, 28, 28), y, num_classes=10).shape == (10, 25)  # b = 2: 5x5
    assert ladd_features(images(10, 8, 8), y, num_classes=10).shape == (10, 9)  # digits: b = 1, 3x3
    assert ladd_features(images(10, 32, 32), y, num_classes=10).shape == (10, 49)  # b = 3
    assert ladd_features(images(10, 8, 8), y, num_classes=10, b=0).shape == (10, 1)
    assert ladd_features(images(10, 8, 8), y, num_classes=10, b=3).shape == (10, 49)
    assert [default_ladd_b(s, s) for s in (3, 8, 9, 10, 19, 20, 28, 64)] == [1, 1, 1, 1, 1, 2, 2, 6]
    f = ladd_features(images(10, 28, 28), y, num_classes=10)
    assert f.dtype == np.float32 and f.flags.c_contiguous
    assert SUMMARIES["ladd"] is ladd_features


def test_constant_image_has_only_a_dc_term():
    # fft2 of a constant c over H x W: c * H * W at frequency (0, 0), zero elsewhere;
    # after fftshift the DC term is the window's centre (index 4 of the 3x3 window)
    x = np.stack([np.full((8, 8), 0.5), np.full((8, 8), 1.0), np.full((8, 8), 0.25)]).astype(np.float32)
    y = np.array([0, 0, 2])
    f = ladd_features(x, y, num_classes=3)
    want = np.zeros((3, 9), np.float32)
    want[0, 4] = (0.5 * 64 + 1.0 * 64) / 2  # class mean: 48
    want[2, 4] = 0.25 * 64
    np.testing.assert_allclose(f, want, atol=1e-5)
    assert not f[1].any()  # class 1 is absent: zeros


def test_odd_image_sizes_centre_the_window_on_the_dc_term():
    x = np.full((1, 7, 9), 2.0, np.float32)
    f = ladd_features(x, np.array([0]), num_classes=1, b=1)
    np.testing.assert_allclose(f[0], [0, 0, 0, 0, 2.0 * 63, 0, 0, 0, 0], atol=1e-4)


def test_a_180_degree_rotation_leaves_the_amplitudes_unchanged():
    """Why LADD cannot tell clients rotated by 0 and 180 degrees apart (|F(-u,-v)| = |F(u,v)|)."""
    x = images(50, 28, 28, seed=1)
    y = np.random.default_rng(2).integers(0, 10, 50)
    img = x[0].astype(np.float64)
    np.testing.assert_allclose(np.abs(np.fft.fft2(np.rot90(img, 2))), np.abs(np.fft.fft2(img)), atol=1e-9)
    f0 = ladd_features(x, y, num_classes=10)
    f180 = ladd_features(np.rot90(x, 2, axes=(1, 2)), y, num_classes=10)
    f90 = ladd_features(np.rot90(x, 1, axes=(1, 2)), y, num_classes=10)
    np.testing.assert_allclose(f180, f0, rtol=1e-5, atol=1e-4)
    assert not np.allclose(f90, f0, rtol=1e-3, atol=1e-2)  # 90 degrees does change them


def test_channel_axis_is_accepted():
    x = images(6, 8, 8)
    y = np.array([0, 1, 2, 0, 1, 2])
    np.testing.assert_array_equal(ladd_features(x[:, None], y, num_classes=3), ladd_features(x, y, num_classes=3))


def test_bad_inputs_are_refused():
    x = images(4, 8, 8)
    y = np.array([0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"x must be \(N, H, W\) or \(N, 1, H, W\) single-channel images, got shape \(4, 64\)"):
        ladd_features(x.reshape(4, 64), y, num_classes=4)
    with pytest.raises(ValueError, match=r"single-channel images, got shape \(4, 3, 8, 8\)"):
        ladd_features(np.repeat(x[:, None], 3, axis=1), y, num_classes=4)
    bad = x.copy()
    bad[1, 2, 3] = np.nan
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        ladd_features(bad, y, num_classes=4)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\) for num_classes=3, got \[0, 3\]"):
        ladd_features(x, y, num_classes=3)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 4\) for num_classes=4, got \[-1, 2\]"):
        ladd_features(x, np.array([0, 1, 2, -1]), num_classes=4)
    with pytest.raises(ValueError, match=r"y must be a 1-D array of 4 labels \(one per image\), got shape \(3,\)"):
        ladd_features(x, y[:3], num_classes=4)
    with pytest.raises(ValueError, match="y must hold integer labels, got dtype float64"):
        ladd_features(x, y.astype(np.float64), num_classes=4)
    with pytest.raises(ValueError, match=r"b=4 is too large for 8x8 images: .* so b <= 3"):
        ladd_features(x, y, num_classes=4, b=4)
    with pytest.raises(ValueError, match="b must be a non-negative integer or None, got -1"):
        ladd_features(x, y, num_classes=4, b=-1)
    with pytest.raises(ValueError, match="images of 2x2 are too small for a LADD window"):
        ladd_features(images(4, 2, 2), y, num_classes=4)
    with pytest.raises(ValueError, match="num_classes must be a positive integer, got 0"):
        ladd_features(x, y, num_classes=0)
    with pytest.raises(ValueError, match="x holds no images"):
        ladd_features(np.zeros((0, 8, 8), np.float32), np.zeros(0, np.int64), num_classes=4)
