"""How few images per node ours can cluster: the Flower example's digits split over more and more nodes.

The partition of ``examples/flower`` (scikit-learn's 1,797 digits in 4
rotation groups, node ``i`` in group ``i mod 4``, 20 % of each node's images
held out), sketched by each node's own :class:`edge_sdk.Sketcher` through the
shipped ``digits_encoder`` on ONNX Runtime (P = 0.1), clustered as the server
does (``min_cluster_size`` 2, the example's default), with the class blocks
clipped (the default) and with plain Hamming distances. For each node count:
the training images per node, and the ARI against the rotation groups, mean,
worst and the number of seeds at 0.95 or more.

Run: ``.venv/bin/python benchmarks/thin_nodes.py`` (about 5 minutes on 2 cores;
``--nodes 40,100 --seeds 0,1,2`` for fewer). Prints a table; the last line
is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from _cli import csv_list  # noqa: E402

from edge_sdk.encoder import OnnxEncoder  # noqa: E402
from edge_sdk.sketch import Sketcher  # noqa: E402
from server_kit.clustering import SketchClustering  # noqa: E402
from server_kit.data.partition import load_digits_images, rotation_groups  # noqa: E402

#: The clustering's readings: the server's default (class blocks of the digits encoder's 20 bits) and plain Hamming.
READINGS = {"default": {"block_bits": 20}, "hamming": {}}


def main(argv: list[str] | None = None) -> int:
    from sklearn.metrics import adjusted_rand_score

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=csv_list(int), default=[20, 30, 40, 50, 60, 80, 100])
    ap.add_argument("--seeds", type=csv_list(int), default=list(range(10)))
    ap.add_argument("--flip-prob", type=float, default=0.1)
    args = ap.parse_args(argv)
    x, y = load_digits_images()
    encoder = OnnxEncoder("digits_encoder")
    rows = []
    print(f"{'nodes':>6} {'images':>7} {'reading':<8} {'mean ARI':>9} {'worst':>6} {'>= 0.95':>8}")
    for n in args.nodes:
        aris: dict[str, list[float]] = {r: [] for r in READINGS}
        images = []
        for seed in args.seeds:
            nodes = rotation_groups(x, y, n, groups=4, seed=seed)
            images.append(np.mean([c.x_train.shape[0] for c in nodes]))
            packed = np.stack([np.frombuffer(Sketcher(encoder, 10, args.flip_prob, seed=seed * 1000 + i)
                                             .sketch(c.x_train, c.y_train).bits, dtype=np.uint8)
                               for i, c in enumerate(nodes)])
            truth = [c.group for c in nodes]
            for reading, kw in READINGS.items():
                model = SketchClustering(min_cluster_size=2, random_state=seed, **kw).fit(packed, 200)
                aris[reading].append(float(adjusted_rand_score(truth, model.labels_)))
        for reading, values in aris.items():
            row = {"nodes": n, "images_per_node": round(float(np.mean(images)), 1), "reading": reading,
                   "mean_ari": round(float(np.mean(values)), 3), "worst_ari": round(min(values), 3),
                   "seeds_at_0.95": sum(a >= 0.95 for a in values), "seeds": len(values)}
            rows.append(row)
            print(f"{n:>6} {row['images_per_node']:>7} {reading:<8} {row['mean_ari']:>9.3f} {row['worst_ari']:>6.3f} "
                  f"{row['seeds_at_0.95']:>4} of {len(values)}", flush=True)
    default = [r for r in rows if r["reading"] == "default"]
    right = [r["nodes"] for r in default if r["mean_ari"] >= 0.95]
    print(json.dumps({"rows": rows, "max_nodes_mean_ari_0.95": max(right, default=None)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
