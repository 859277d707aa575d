"""The federation's data: rotation groups of scikit-learn's digits (default) or of MNIST from a folder.

Both apps build the same partition from the run config and the number of
nodes, once per process: a node takes its share by its ``partition-id``; the
server reads only the true groups, to score the clusters it finds.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

DIGITS = ("digits_cnn_1x8x8_10", "digits_encoder")
MNIST = ("lenet5_1x28x28_10", "fmnist_fc_encoder")


def setup(run_config: dict[str, Any]) -> tuple[str, str]:
    """(architecture, encoder) for the run config's data: digits when ``data`` is empty, MNIST otherwise."""
    return MNIST if run_config.get("data") else DIGITS


@lru_cache(maxsize=2)
def partition(data: str, n: int, groups: int, alpha: float, seed: int) -> tuple:
    """The ``n`` nodes' data (``server_kit.data.ClientData``), rotation group ``i mod groups`` for node ``i``."""
    from server_kit.data.partition import load_digits_images, rotation_groups

    if data:
        from server_kit.data.idx import load_mnist

        images, labels = load_mnist(data, "train")
    else:
        images, labels = load_digits_images()
    skew = {"alpha": float(alpha), "min_size": 10} if alpha > 0 else {}
    return tuple(rotation_groups(images, labels, n, groups=groups, seed=seed, **skew))


def nodes(run_config: dict[str, Any], n: int) -> tuple:
    return partition(str(run_config.get("data", "")), int(n), int(run_config.get("groups", 4)),
                     float(run_config.get("alpha", 0.0)), int(run_config.get("seed", 0)))
