"""The sketch pipeline end to end on scikit-learn's digits (``python -m server_kit.sketch_demo``).

Splits the 1,797 digits over clients in four rotation groups (0, 90, 180 and
270 degrees; client ``i`` in group ``i mod 4``), sketches every client with the
shipped digits autoencoder through ONNX Runtime (P = 0.1), prints each sketch,
the pairwise Hamming distances, and a Ward clustering of the sketches scored
against the true groups. The last line of output is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import numpy as np

from edge_sdk import BACKEND, OnnxEncoder, Sketcher, hamming_pdist, stack_sketches

log = logging.getLogger(__name__)


def rotation_clients(
    n_clients: int, groups: int = 4, seed: int = 0
) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """Digits split into ``n_clients`` disjoint shards; client ``i`` rotated by 90 * (i mod groups)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    images = (d.images / 16.0).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(images))
    out = []
    for i, shard in enumerate(np.array_split(order, n_clients)):
        g = i % groups
        out.append((np.rot90(images[shard], k=g, axes=(1, 2)).copy(), d.target[shard], g))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from scipy.cluster.hierarchy import fcluster, linkage
    from scipy.spatial.distance import squareform
    from sklearn.metrics import adjusted_rand_score

    t0 = time.perf_counter()
    clients = rotation_clients(args.clients, seed=args.seed)
    encoder = OnnxEncoder("digits_encoder")
    sketches, truth = [], []
    for i, (x, y, g) in enumerate(clients):
        sk = Sketcher(encoder, num_classes=10, flip_prob=args.flip_prob, seed=args.seed * 1000 + i)
        s = sk.sketch(x, y)
        sketches.append(s)
        truth.append(g)
        print(f"client {i:2d}  rotation {90 * g:3d}  {len(y):3d} samples  sketch {s.hex()}")
    n_bits = sketches[0].n_bits
    dist = hamming_pdist(stack_sketches(sketches), n_bits)
    square = squareform(dist)
    print(f"\npairwise Hamming distances ({n_bits} bits = {sketches[0].nbytes} bytes per sketch, "
          f"kernel {BACKEND}):")
    print("      " + " ".join(f"{j:4d}" for j in range(len(sketches))))
    for i, row in enumerate(square):
        print(f"{i:4d}  " + " ".join(f"{v:4d}" for v in row))
    truth_a = np.array(truth)
    same = truth_a[:, None] == truth_a[None, :]
    off = ~np.eye(len(truth_a), dtype=bool)
    within = float(square[same & off].mean())
    between = float(square[~same].mean())
    labels = fcluster(linkage(dist.astype(float), method="ward"), t=4, criterion="maxclust")
    ari = float(adjusted_rand_score(truth_a, labels))
    print(f"\nmean distance within a rotation group {within:.1f} bits, between groups {between:.1f} bits")
    print(f"Ward clustering into 4 groups: labels {labels.tolist()}, ARI {ari:.3f}")
    print(json.dumps({
        "clients": len(sketches), "n_bits": n_bits, "sketch_bytes": sketches[0].nbytes,
        "within_group_bits": round(within, 2), "between_group_bits": round(between, 2),
        "ari": round(ari, 4), "kernel": BACKEND, "seconds": round(time.perf_counter() - t0, 2),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
