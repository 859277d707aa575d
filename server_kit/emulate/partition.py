"""The emulated fleet's data: devices with a few dozen digits each, in rotation groups."""

from __future__ import annotations

import numpy as np

from ..data.partition import ClientData, load_digits_images

__all__ = ["fleet_partition"]


def fleet_partition(
    n_clients: int,
    *,
    min_samples: int = 30,
    max_samples: int = 60,
    groups: int = 4,
    test_fraction: float = 0.2,
    seed: int = 0,
    prefix: str = "d",
    images: np.ndarray | None = None,
    labels: np.ndarray | None = None,
) -> list[ClientData]:
    """Devices with ``min_samples`` to ``max_samples`` training digits each, in rotation groups.

    Each device draws its training samples (and ``test_fraction`` as many
    test samples, at least one, disjoint from them) from scikit-learn's 1,797
    digits without replacement; devices draw independently, so a large fleet
    reuses the digits. Device ``i`` is rotated by ``90 * (i mod groups)``
    degrees (its ``group``), ids are ``f"{prefix}{i:05d}"``.
    """
    if n_clients < 1:
        raise ValueError(f"n_clients must be positive, got {n_clients}")
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"min_samples and max_samples must satisfy 1 <= min <= max, got {min_samples}, "
                         f"{max_samples}")
    if not 1 <= groups <= 4:
        raise ValueError(f"groups must be between 1 and 4 rotations, got {groups}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if images is None or labels is None:
        images, labels = load_digits_images()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_clients):
        n = int(rng.integers(min_samples, max_samples + 1))
        n_test = max(1, int(round(test_fraction * n)))
        if n + n_test > len(images):
            raise ValueError(f"{n + n_test} samples per device, the data has {len(images)}")
        idx = rng.choice(len(images), size=n + n_test, replace=False)
        g = i % groups
        x = np.rot90(images[idx], k=g, axes=(1, 2)).astype(np.float32)
        y = labels[idx]
        out.append(ClientData(f"{prefix}{i:05d}", x[n_test:], y[n_test:], x[:n_test], y[:n_test], g))
    return out
