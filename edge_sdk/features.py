"""Client summaries other than sketches: what a device computes for the server to cluster.

A strategy that clusters before training names the kind of summary it wants
(``Strategy.capabilities.summary_kind``); the client computes it with
``SUMMARIES[kind](x, y, num_classes=..., **summary_params)`` and sends the
array. Sketches (``"sketch"``) live in :mod:`edge_sdk.sketch`; this module
holds the array-valued summaries, numpy only.

* ``"ladd"``: :func:`ladd_features`, the per-class low-frequency Fourier
  amplitudes of LADD, as compared in the FedSketch paper.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

__all__ = ["SUMMARIES", "default_ladd_b", "ladd_features"]


def default_ladd_b(height: int, width: int) -> int:
    """LADD's half-width ``b = floor(0.1 * min(H, W))``, at least 1.

    Images smaller than 10x10 (scikit-learn's 8x8 digits) would get ``b = 0``,
    the DC term alone; they get ``b = 1`` (a 3x3 window) instead.

    Parameters
    ----------
    height, width : int
        Image size.

    Returns
    -------
    int
        The half-width of the centred window: 2 for 28x28 images (a 5x5
        window), 1 for 8x8 (3x3).
    """
    return max(1, int(np.floor(0.1 * min(int(height), int(width)))))


def _check_images(x: Any) -> np.ndarray:
    """Images as float64 ``(N, H, W)``; accepts ``(N, H, W)`` or ``(N, 1, H, W)``."""
    a = np.asarray(x)
    if a.ndim == 4:
        if a.shape[1] != 1:
            raise ValueError(
                f"x must be (N, H, W) or (N, 1, H, W) single-channel images, got shape {a.shape}"
            )
        a = a[:, 0]
    if a.ndim != 3:
        raise ValueError(
            f"x must be (N, H, W) or (N, 1, H, W) single-channel images, got shape {a.shape}"
        )
    if a.shape[0] == 0:
        raise ValueError("x holds no images")
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"x must hold real numbers, got dtype {a.dtype}")
    a = a.astype(np.float64, copy=False)
    if not np.isfinite(a).all():
        raise ValueError("x contains NaN or Inf")
    return a


def _check_labels(y: Any, n: int, num_classes: int) -> np.ndarray:
    a = np.asarray(y)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"y must be a 1-D array of {n} labels (one per image), got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"y must hold integer labels, got dtype {a.dtype}")
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= num_classes:
        raise ValueError(
            f"labels must be in [0, {num_classes}) for num_classes={num_classes}, got [{lo}, {hi}]"
        )
    return a.astype(np.int64, copy=False)


def ladd_features(
    x: np.ndarray, y: np.ndarray, *, num_classes: int, b: Optional[int] = None
) -> np.ndarray:
    """LADD's client summary: per-class mean of the central Fourier amplitudes.

    Per image: the amplitude of its 2-D discrete Fourier transform
    (``abs(fft2(img))``), shifted so the DC term is at the centre
    (``fftshift``), then the centred ``(2b+1) x (2b+1)`` window, flattened in
    row-major order. The windows are averaged over the images of each class.

    The amplitude does not change when an image is rotated by 180 degrees
    (for a real image ``|F(-u, -v)| = |F(u, v)|``), so clients that differ
    only by that rotation get the same summary.

    Parameters
    ----------
    x : numpy.ndarray
        Images ``(N, H, W)`` or ``(N, 1, H, W)``, real and finite.
    y : numpy.ndarray
        Integer labels ``(N,)`` in ``[0, num_classes)``.
    num_classes : int
        Number of classes of the federation (rows of the result).
    b : int, optional
        Half-width of the window, ``0 <= b <= (min(H, W) - 1) // 2``. Default
        :func:`default_ladd_b`: ``floor(0.1 * min(H, W))`` (2 for 28x28: a
        5x5 window, 25 values per class), at least 1 (3x3 for 8x8 digits).

    Returns
    -------
    numpy.ndarray
        float32 ``(num_classes, (2b+1)**2)``. A class with no local image gets
        a row of zeros (the LADD paper does not say what to do with absent
        classes; zeros keep the shape fixed and are far from any real
        amplitude row, whose DC term is the image's pixel sum).

    Raises
    ------
    ValueError
        On images of the wrong shape or with NaN or Inf, labels of the wrong
        shape or out of range, a bad ``num_classes``, or a ``b`` that is
        negative or too large for the images.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    num_classes = int(num_classes)
    imgs = _check_images(x)
    labels = _check_labels(y, imgs.shape[0], num_classes)
    h, w = imgs.shape[1:]
    b_max = (min(h, w) - 1) // 2
    if b is None:
        b = default_ladd_b(h, w)
        if b > b_max:
            raise ValueError(f"images of {h}x{w} are too small for a LADD window (need at least 3x3)")
    elif isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 0:
        raise ValueError(f"b must be a non-negative integer or None, got {b!r}")
    elif b > b_max:
        raise ValueError(
            f"b={b} is too large for {h}x{w} images: the (2b+1)x(2b+1) window must fit, "
            f"so b <= {b_max}"
        )
    b = int(b)
    amp = np.fft.fftshift(np.abs(np.fft.fft2(imgs)), axes=(-2, -1))
    ch, cw = h // 2, w // 2  # where fftshift puts the DC term, for even and odd sizes
    win = amp[:, ch - b : ch + b + 1, cw - b : cw + b + 1].reshape(imgs.shape[0], -1)
    sums = np.zeros((num_classes, win.shape[1]), dtype=np.float64)
    np.add.at(sums, labels, win)
    counts = np.bincount(labels, minlength=num_classes).astype(np.float64)
    out = np.divide(sums, counts[:, None], out=np.zeros_like(sums), where=counts[:, None] > 0)
    return out.astype(np.float32)


#: Summary kinds a client can compute: ``SUMMARIES[kind](x, y, num_classes=..., **params)``.
SUMMARIES: dict[str, Callable[..., np.ndarray]] = {"ladd": ladd_features}
