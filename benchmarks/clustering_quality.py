"""Clustering quality and its price: every clustered-FL method on the OCFL paper's splits (Table I).

The setting of Zuziak et al., "One-Shot Clustering for Federated Learning"
(IEEE BigData 2024), Table I, on MNIST and Fashion-MNIST: 15 and 30 clients
in three groups holding the classes {0-3}, {4-6} and {7-9}, in four splits
(:data:`server_kit.data.partition.OCFL_SPLITS`):

* ``nonoverlap_balanced``: equal groups, labels uniform inside a client;
* ``nonoverlap_imbalanced``: 20 / 47 / 33 % of the clients per group and
  Dirichlet(1) label skew inside each client's class set;
* ``overlap_balanced`` / ``overlap_imbalanced``: the same with class sets that
  partly overlap ({0-3, 8, 9}, {4-9}, {0-5}: the authors' published configs);

plus ``rotation``: our paper's kind of split, three groups rotated by 0, 90
and 180 degrees, labels alike in every group.

Every method runs in the in-process simulator (the strategy code the MQTT
orchestrator drives) only until it has clustered:

* ours (``fedsketch``) clusters at round 0, before any training, from the
  clients' sketches (the shipped Fashion-MNIST encoder for 28x28 images, P =
  0.1, ``min_cluster_size`` 20 % of the clients as OCFL's HDBSCAN);
* OCFL with HDBSCAN, MeanShift, Affinity Propagation and K-means (K = 3
  known, the paper's "ideal" baseline), Briggs et al., K-means on the weights
  (Bhattacharya and Aridi, K = 3 known) and FLIS-HC (the server's labelled set is
  ``--aux-per-class`` images per class of the test split, which no client
  holds, rotated like the clients in the rotation split) train FedAvg rounds
  until their rule decides (``cluster_round_``), at most
  ``max_warmup_rounds``;
* CFL (Sattler et al.) runs ``--cfl-rounds`` rounds; its clustering is the
  state after its last split (none: it never clustered);
* FLIS-DC re-clusters every round: it runs ``--dynamic-rounds`` rounds and
  its last round's clusters are scored.

OCFL's four algorithms share one warm-up: same seeds, same updates, same
temperature rule, so the same deciding round. The first OCFL variant trains;
the others are fed its recorded updates round by round (their
``_combine``, FedAvg included, so their state is exactly what a run of
their own would reach) and only cluster (``--no-share-warmup`` trains each).

Seeds: the sketch method runs on each of ``--seeds`` (default 0 to 19;
``--quick``: 0 to 2), the methods that train on the first ``--trained-seeds``
of them (default 1: one seed of every method takes hours). Each cell is then
reported as a distribution over its seeds (mean, 5th percentile, worst,
share under 0.95: :class:`server_kit.metrics.SeedSpread`), in a table and in
the JSON's ``cells``; ``ours_min_p5_ari_<dataset>`` is the sketch method's
lowest 5th percentile.

For each (dataset, clients, split, method, seed) it records ARI (the paper's
"RAND"), AMI and completeness against the true groups, the round whose
updates decided the clusters, the bytes in and out of the server until the
end of that round (the simulator's wire-exact ledger; round 0 = sketches
only), and the server's clustering time. Output: a table with the paper's
ARI beside ours, ``ari_heatmap.png`` (methods x scenarios),
``bytes_heatmap.png``, ``results.json``, and a last line of JSON.

Model and training: the paper's MNIST / FMNIST network is a 3-conv "tiny-VGG"
of about 25 M parameters (authors' ``FMNIST_Expanded_CNN``); we use the
closest architecture we ship, LeNet-5 (``lenet5_1x28x28_10``, 2 convolutions,
about 86 K parameters), with the paper's client settings: SGD, lr 0.01, 3
local epochs, batch 32, all clients every round. The paper gives each client
all of its groups' data (about 4,000 MNIST images with 15 clients);
``--samples-per-client`` (default 600) draws that many per client instead,
to keep the run to hours on a CPU (0 = all data, as the paper).

Run: ``.venv/bin/python benchmarks/clustering_quality.py`` (estimated 3 to
3.5 hours on the 2-core development machine: one 15-client MNIST scenario at
the defaults took 344 s, a 30-client one trains twice the samples; ``--datasets
mnist --clients 15 --splits nonoverlap_balanced`` for one scenario;
``--quick`` for the smoke test on scikit-learn's digits). Methods and their
parameters: :data:`METHODS`, chosen with ``--methods`` and overridden with
``--params '{"cfl": {"eps1": 0.2}}'``. A method whose strategy module is not
installed is skipped, and the output says so.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from _cli import add_device_options, csv_list

from server_kit.metrics import SeedSpread

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data"
SPLITS = ("nonoverlap_balanced", "nonoverlap_imbalanced", "overlap_balanced", "overlap_imbalanced", "rotation")

#: Method label -> strategy name of :func:`server_kit.strategies.make_strategy` and its parameters.
#: ``"auto"`` values are filled per federation (see :func:`resolve_params`).
METHODS: dict[str, dict[str, Any]] = {
    "fedsketch": {"strategy": "fedsketch", "params": {"min_cluster_size": "auto"}},
    "ocfl-hdbscan": {"strategy": "ocfl", "params": {"algorithm": "hdbscan"}},
    "ocfl-meanshift": {"strategy": "ocfl", "params": {"algorithm": "meanshift"}},
    "ocfl-affinity": {"strategy": "ocfl", "params": {"algorithm": "affinity"}},
    "ocfl-kmeans": {"strategy": "ocfl", "params": {"algorithm": "kmeans", "k": 3}},
    # CFL's thresholds: from its last_norms_ over 10 rounds of MNIST, 15 clients, 600 samples each, LeNet-5,
    # SGD 0.01 x 3 epochs (mean update norm 0.05 to 0.25, largest 0.08 to 0.63 across the splits); the paper
    # also had to search them per task
    "cfl": {"strategy": "cfl", "params": {"min_cluster_size": "auto", "eps1": 0.12, "eps2": 0.12,
                                          "warmup_rounds": 3}},
    "briggs": {"strategy": "briggs", "params": {}},
    "kmeans-weights": {"strategy": "kmeans-weights", "params": {"k": 3}},
    "flis-hc": {"strategy": "flis-hc", "params": {}},
    "flis-dc": {"strategy": "flis-dc", "params": {}},
}
#: The methods of ``--quick`` (fast ones; those not installed are skipped).
QUICK_METHODS = ("fedsketch", "ocfl-hdbscan", "ocfl-kmeans", "cfl", "briggs", "kmeans-weights", "flis-hc")

#: Table I of the OCFL paper, ARI ("RAND") per split in the order of :data:`SPLITS` (no rotation
#: split there); None: the method formed no clusters ("---" in the paper).
_PAPER_ROWS = {
    ("mnist", 15): {"cfl": (0.44, 0.57, 0.21, 0.29), "briggs": (None,) * 4, "ocfl-kmeans": (0.96,) * 4,
                    "ocfl-affinity": (0.23, 0.13, 0.23, 0.30), "ocfl-meanshift": (0.71, 0.96, 0.87, 0.96),
                    "ocfl-hdbscan": (0.96,) * 4},
    ("mnist", 30): {"cfl": (0.45, 0.57, 0.19, 0.26), "briggs": (None, -0.044, None, None),
                    "ocfl-kmeans": (0.96, 0.96, 0.90, 0.94), "ocfl-affinity": (0.38, 0.66, 0.36, 0.50),
                    "ocfl-meanshift": (0.85, 0.94, 0.87, 0.94), "ocfl-hdbscan": (0.92, 0.98, 0.94, 0.94)},
    ("fmnist", 15): {"cfl": (0.46, 0.55, 0.19, 0.17), "briggs": (-0.14, None, None, None),
                     "ocfl-kmeans": (0.98,) * 4, "ocfl-affinity": (0.23, 0.22, 0.23, 0.30),
                     "ocfl-meanshift": (0.98,) * 4, "ocfl-hdbscan": (0.96, 0.98, 0.96, 0.98)},
    ("fmnist", 30): {"cfl": (0.57, 0.57, 0.42, 0.53), "briggs": (None, None, -0.07, -0.047),
                     "ocfl-kmeans": (0.96, 0.98, 0.96, 0.96), "ocfl-affinity": (0.39, 0.66, 0.37, 0.51),
                     "ocfl-meanshift": (0.85, 0.96, 0.94, 0.98), "ocfl-hdbscan": (0.98, 0.98, 0.94, 0.96)},
}
PAPER_ARI: dict[tuple[str, int, str], dict[str, float | None]] = {
    (ds, n, split): {m: vals[i] for m, vals in rows.items()}
    for (ds, n), rows in _PAPER_ROWS.items() for i, split in enumerate(SPLITS[:4])
}

log = logging.getLogger("clustering_quality")


# ----------------------------------------------------------------------------- data


def load_dataset(name: str, data_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Train images and labels (for the clients) and test ones (for FLIS's server set)."""
    if name == "digits":
        from server_kit.data.partition import load_digits_images

        x, y = load_digits_images()
        rng = np.random.default_rng(12345)
        held = np.concatenate([rng.choice(np.flatnonzero(y == c), 30, replace=False) for c in range(10)])
        mask = np.ones(len(y), dtype=bool)
        mask[held] = False
        return x[mask], y[mask], x[held], y[held]
    from server_kit.data.idx import load_fashion_mnist, load_mnist

    load = {"mnist": load_mnist, "fmnist": load_fashion_mnist}[name]
    x, y = load(data_dir, "train")
    xt, yt = load(data_dir, "test")
    return x, y, xt, yt


def aux_set(x: np.ndarray, y: np.ndarray, per_class: int, *, rotations: int, seed: int):
    """``per_class`` labelled images per class for FLIS; part ``k`` of ``rotations`` turned by ``90 k``."""
    rng = np.random.default_rng([seed, 7])
    idx = np.concatenate([rng.choice(np.flatnonzero(y == c), min(per_class, int((y == c).sum())), replace=False)
                          for c in np.unique(y)])
    idx = rng.permutation(idx)
    ax, ay = x[idx].copy(), y[idx].copy()
    for k in range(1, rotations):
        ax[k::rotations] = np.rot90(ax[k::rotations], k=k, axes=(1, 2))
    return ax.astype(np.float32), ay.astype(np.int64)


def build_clients(split: str, x: np.ndarray, y: np.ndarray, n: int, spc: int | None, seed: int):
    """The federation of one scenario (seeded)."""
    from server_kit.data.partition import OCFL_SPLITS, class_set_groups, rotation_groups

    if split == "rotation":
        if spc:
            pick = np.random.default_rng([seed, 3]).choice(len(y), size=min(len(y), n * spc), replace=False)
            x, y = x[pick], y[pick]
        return rotation_groups(x, y, n, groups=3, seed=seed)
    return class_set_groups(x, y, n, samples_per_client=spc or None, seed=seed, **OCFL_SPLITS[split])


# ----------------------------------------------------------------------------- methods


def available(strategy: str) -> str | None:
    """None if ``strategy`` can be built here, else why not (its module is missing)."""
    from server_kit.strategies import REGISTRY

    if strategy not in REGISTRY:
        return f"unknown strategy {strategy!r}"
    module, attr = REGISTRY[strategy]
    try:
        getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        return f"{module}.{attr} not available ({e.__class__.__name__}: {e})"
    return None


def resolve_params(params: dict[str, Any], n_clients: int) -> dict[str, Any]:
    """Fill ``"auto"`` values: ``min_cluster_size`` is 20 % of the clients (OCFL's HDBSCAN rule), at least 2."""
    out = dict(params)
    for k, v in params.items():
        if v == "auto":
            if k == "min_cluster_size":
                out[k] = max(2, int(0.2 * n_clients))
            else:
                raise ValueError(f"no automatic value for parameter {k!r}")
    return out


def make_method(label: str, spec: dict[str, Any], *, n_clients: int, settings, seed: int, architecture: str,
                aux: tuple[np.ndarray, np.ndarray]):
    """The strategy of one method for one federation."""
    from server_kit.strategies import make_strategy

    params = resolve_params(spec.get("params", {}), n_clients)
    if spec["strategy"].startswith("flis"):
        params.setdefault("aux_x", aux[0])
        params.setdefault("aux_y", aux[1])
    return make_strategy(spec["strategy"], settings=settings, seed=seed, architecture=architecture, **params)


def kind_of(strategy) -> str:
    """How a method clusters: ``"sketch"`` (before training), ``"one-shot"`` (once, from a round's
    updates: ``cluster_round_``), ``"splits"`` (CFL's recursive splits) or ``"dynamic"`` (re-clusters
    every round, as FLIS-DC)."""
    if strategy.capabilities.needs_sketches:
        return "sketch"
    if hasattr(strategy, "cluster_round_"):
        return "one-shot"
    if hasattr(strategy, "split_history_"):
        return "splits"
    return "dynamic"


def rounds_for(strategy, args) -> tuple[int, Any]:
    """How many rounds to run at most, and the early-stop rule."""
    kind = kind_of(strategy)
    if kind == "sketch":
        return 0, None  # clusters before round 1
    if kind == "one-shot":
        return int(getattr(strategy, "max_warmup_rounds", args.max_rounds)), \
            lambda s, rec: s.cluster_round_ is not None
    return (args.cfl_rounds if kind == "splits" else args.dynamic_rounds), None


def clustering_round(strategy, rounds_run: int) -> int | None:
    """The round whose updates (0: sketches) produced the clustering that is scored; None if none formed."""
    kind = kind_of(strategy)
    if kind == "sketch":
        return 0
    if kind == "one-shot":
        r = strategy.cluster_round_
        return None if r is None else int(r)
    if kind == "splits":
        hist = strategy.split_history_
        return int(hist[-1]["round"]) if hist else None
    return rounds_run or None


def _truth_scores(strategy, clients) -> tuple[dict[str, float], int]:
    from server_kit.metrics import clustering_scores

    cids = sorted(c.cid for c in clients)
    truth = {c.cid: c.group for c in clients}
    got = strategy.clusters()
    return clustering_scores([truth[c] for c in cids], [got.get(c, 0) for c in cids]), len(set(got.values()))


def run_one(label: str, spec: dict[str, Any], clients, aux, args, architecture: str, encoder,
            record: list | None = None) -> dict[str, Any]:
    """One method on one federation, until it has clustered.

    With ``record`` (a list), every round's updates are appended to it, so
    that :func:`replay_one` can replay the same warm-up for another variant.
    """
    from edge_sdk.tasks import TrainSettings
    from server_kit.drivers.simulate import Simulator

    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, optimizer=args.optimizer)
    t0 = time.perf_counter()
    strategy = make_method(label, spec, n_clients=len(clients), settings=settings, seed=args.seed,
                           architecture=architecture, aux=aux)
    timed = {"seconds": None}
    if strategy.capabilities.needs_sketches:  # the server's clustering time, without the clients' sketching
        inner = strategy.on_sketches

        def on_sketches(sketches):
            t = time.perf_counter()
            out = inner(sketches)
            timed["seconds"] = time.perf_counter() - t
            return out

        strategy.on_sketches = on_sketches
    if record is not None:
        aggregate = strategy._combine

        def recording(rnd, updates):
            record.append((rnd, list(updates)))
            return aggregate(rnd, updates)

        strategy._combine = recording
    rounds, stop = rounds_for(strategy, args)
    sim = Simulator(strategy, clients, architecture=architecture, encoder=encoder if strategy.capabilities.needs_sketches else None,
                    flip_prob=args.flip_prob, seed=args.seed, progress=False,
                    device=args.device, batched=args.batched, step=args.step)
    res = sim.run(rounds, stop=stop)
    ran = res.rounds[-1].round if res.rounds else 0
    rnd = clustering_round(strategy, ran)
    seconds = timed["seconds"] if strategy.capabilities.needs_sketches else getattr(strategy, "clustering_seconds_", None)
    hist = getattr(strategy, "split_history_", None)
    return {
        **{k: float(v) for k, v in res.scores.items()},
        "clusters": len(set(res.assignment.values())),
        "kind": kind_of(strategy),
        "cluster_round": rnd,
        "first_split_round": int(hist[0]["round"]) if hist else None,
        "rounds_run": ran,
        # until the clustering; a method that never clustered spent all its rounds for nothing
        "bytes_until_clustering": res.bytes_until(rnd) if rnd is not None else res.bytes_until(ran),
        "bytes_per_round": [r.bytes_total for r in res.rounds],
        "clustered": rnd is not None,
        "clustering_seconds": seconds,
        "seconds": time.perf_counter() - t0,
        "bytes_by_kind": res.ledger.as_dict(),
        "assignment": dict(sorted(res.assignment.items())),
    }


def replay_one(label: str, spec: dict[str, Any], clients, aux, args, architecture: str, source: str,
               record: list, source_row: dict[str, Any]) -> dict[str, Any] | None:
    """An OCFL variant fed the warm-up updates another variant's run recorded, without training again.

    OCFL's warm-up does not depend on its clustering algorithm: the same seeds
    give the same global model and the same updates each round, and the
    temperature rule picks the same round. Feeding the recorded rounds to
    ``_combine`` reproduces the strategy's state exactly (its FedAvg
    of the same updates gives the next round's reference), so only the
    clustering is new; the bytes are those of the recorded run up to that
    round. Returns None (run it for real) if it has not clustered by the
    last recorded round.
    """
    from edge_sdk.tasks import TrainSettings
    from edge_sdk.training.trainer import initial_weights
    from server_kit.strategies.base import ClientInfo

    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, optimizer=args.optimizer)
    t0 = time.perf_counter()
    strategy = make_method(label, spec, n_clients=len(clients), settings=settings, seed=args.seed,
                           architecture=architecture, aux=aux)
    strategy.setup([ClientInfo(c.cid, len(c.y_train)) for c in clients], initial_weights(architecture, args.seed))
    for rnd, updates in record:
        strategy._combine(rnd, updates)
        if strategy.cluster_round_ is not None:
            break
    rnd = strategy.cluster_round_
    if rnd is None:
        return None
    scores, k = _truth_scores(strategy, clients)
    per_round = source_row["bytes_per_round"]
    return {
        **scores, "clusters": k, "kind": kind_of(strategy), "cluster_round": int(rnd), "first_split_round": None,
        "rounds_run": int(rnd), "bytes_until_clustering": per_round[rnd - 1], "bytes_per_round": per_round[:rnd],
        "clustered": True, "clustering_seconds": strategy.clustering_seconds_,
        # the training is the source run's; only the replay and the clustering are this row's own
        "seconds": source_row["seconds"], "replay_seconds": time.perf_counter() - t0, "replayed_from": source,
        "bytes_by_kind": source_row["bytes_by_kind"] if rnd == source_row["rounds_run"] else None,
        "assignment": dict(sorted(strategy.clusters().items())),
    }


# ----------------------------------------------------------------------------- report


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _fmt(v: float | None, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"\n{'dataset':7s} {'n':>3s} {'split':22s} {'method':15s} {'ARI':>6s} {'AMI':>6s} {'COM':>6s} "
          f"{'k':>3s} {'round':>5s} {'bytes until':>12s} {'cluster s':>9s} {'wall s':>7s} | {'paper ARI':>9s}")
    for r in rows:
        paper = PAPER_ARI.get((r["dataset"], r["clients"], r["split"]), {})
        p = "n/a" if r["method"] not in paper else ("none" if paper[r["method"]] is None else
                                                      f"{paper[r['method']]:.2f}")
        rnd = r["cluster_round"] if r["clustered"] else f"-({r['rounds_run']})"
        print(f"{r['dataset']:7s} {r['clients']:3d} {r['split']:22s} {r['method']:15s} {r['ari']:6.3f} "
              f"{r['ami']:6.3f} {r['completeness']:6.3f} {r['clusters']:3d} {str(rnd):>5s} "
              f"{human_bytes(r['bytes_until_clustering']):>12s} {_fmt(r['clustering_seconds'], '9.3f'):>9s} "
              f"{r['seconds']:7.1f} | {p:>9s}")


def print_spread(cells: dict[str, dict[str, float]]) -> None:
    """ARI over the seeds per (method, dataset, clients, split): mean, 5th percentile, worst, share under 0.95."""
    print(f"\n{'method dataset clients split':<52s} {'seeds':>5s} {'mean':>6s} {'p5':>6s} {'min':>6s} {'< 0.95':>6s}")
    for key, c in cells.items():
        print(f"{key:<52s} {c['seeds']:>5d} {c['mean']:6.3f} {c['p5']:6.3f} {c['min']:6.3f} {c['below_0.95']:>6.0%}")


def heatmap(path: Path, rows: list[dict[str, Any]], key: str, *, title: str, log10: bool = False) -> None:
    """Methods x scenarios grid of ``key`` (ARI, or log10 bytes; the mean over seeds), values written in the cells."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    scen = list(dict.fromkeys(f"{r['dataset']}-{r['clients']}\n{r['split']}" for r in rows))
    grid = np.full((len(methods), len(scen)), np.nan)
    values: dict[tuple[int, int], list[float]] = {}
    for r in rows:
        if r[key] is not None:
            at = (methods.index(r["method"]), scen.index(f"{r['dataset']}-{r['clients']}\n{r['split']}"))
            values.setdefault(at, []).append(r[key])
    for at, vs in values.items():
        v = float(np.mean(vs))
        grid[at] = math.log10(max(v, 1)) if log10 else v
    fig, ax = plt.subplots(figsize=(max(6.0, 2.2 + 1.05 * len(scen)), 1.6 + 0.45 * len(methods)))
    im = ax.imshow(grid, cmap="viridis" if log10 else "RdYlGn", vmin=None if log10 else -0.2,
                   vmax=None if log10 else 1.0, aspect="auto")
    for i in range(len(methods)):
        for j in range(len(scen)):
            if np.isfinite(grid[i, j]):
                r, g, b, _ = im.cmap(im.norm(grid[i, j]))
                ax.text(j, i, human_bytes(10 ** grid[i, j]) if log10 else f"{grid[i, j]:.2f}",
                        ha="center", va="center", fontsize=6.5 if log10 else 8,
                        color="white" if 0.299 * r + 0.587 * g + 0.114 * b < 0.5 else "black")
    ax.set_xticks(range(len(scen)))
    ax.set_xticklabels(scen, fontsize=6.5, rotation=45, ha="right")
    ax.set_yticks(range(len(methods)))
    ax.set_yticklabels(methods, fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.03, label="log10 bytes" if log10 else "ARI")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(rows: list[dict[str, Any]], skipped: dict[str, str]) -> dict[str, Any]:
    """The final JSON line."""
    def pick(method: str, dataset: str, split: str) -> float | None:
        cands = sorted((r["clients"], r["ari"]) for r in rows
                       if r["method"] == method and r["dataset"] == dataset and r["split"] == split)
        match15 = [a for n, a in cands if n == 15]  # several seeds: the lowest
        return round(match15[0], 4) if match15 else (round(cands[0][1], 4) if cands else None)

    out: dict[str, Any] = {
        "ocfl_hdbscan_ari_mnist_nonoverlap_balanced": pick("ocfl-hdbscan", "mnist", "nonoverlap_balanced"),
    }
    for dataset in ("mnist", "fmnist"):
        ours = [r["ari"] for r in rows if r["method"] == "fedsketch" and r["dataset"] == dataset]
        out[f"ours_min_ari_{dataset}"] = round(min(ours), 4) if ours else None
    for m in dict.fromkeys(r["method"] for r in rows):
        vals = [r["ari"] for r in rows if r["method"] == m]
        out[f"{m.replace('-', '_')}_mean_ari"] = round(float(np.mean(vals)), 4)
    ours_bytes = [r["bytes_until_clustering"] for r in rows if r["method"] == "fedsketch"]
    others = [r["bytes_until_clustering"] for r in rows if r["method"] != "fedsketch"]
    out["ours_max_bytes_until_clustering"] = max(ours_bytes) if ours_bytes else None
    out["others_min_bytes_until_clustering"] = min(others) if others else None
    if ours_bytes and others:
        out["others_min_over_ours_max_bytes"] = round(min(others) / max(ours_bytes), 1)
    cells: dict[str, list[float]] = {}
    for r in rows:
        cells.setdefault(f"{r['method']} {r['dataset']} {r['clients']} {r['split']}", []).append(r["ari"])
    out["cells"] = {k: SeedSpread.of(v).as_dict() for k, v in cells.items()}
    for dataset in ("mnist", "fmnist", "digits"):
        p5 = [c["p5"] for k, c in out["cells"].items() if k.startswith(f"fedsketch {dataset} ")]
        out[f"ours_min_p5_ari_{dataset}"] = min(p5) if p5 else None
    out["skipped"] = sorted(skipped)
    return out


# ----------------------------------------------------------------------------- main


def run(args) -> dict[str, Any]:
    import torch

    from server_kit.report import write_json

    torch.set_num_threads(args.threads)  # small models: one thread is fastest, and never oversubscribes
    t_all = time.perf_counter()
    specs = copy.deepcopy(METHODS)
    for label, over in args.params.items():
        if label not in specs:
            raise SystemExit(f"--params names unknown method {label!r}; known: {sorted(specs)}")
        specs[label].setdefault("params", {}).update(over)
    skipped: dict[str, str] = {}
    methods = []
    for label in args.methods:
        why = available(specs[label]["strategy"])
        if why:
            skipped[label] = why
        else:
            methods.append(label)
    for label, why in skipped.items():
        print(f"skipped {label}: {why}", flush=True)
    rows: list[dict[str, Any]] = []
    scenarios = [(ds, n, split) for ds in args.datasets for n in args.clients for split in args.splits]
    trained = [m for m in methods if m != "fedsketch"]
    runs = len(args.seeds) * (len(methods) - len(trained)) + min(args.trained_seeds, len(args.seeds)) * len(trained)
    bar = _progress(len(scenarios) * runs, args.progress)
    for ds in args.datasets:
        x, y, xt, yt = load_dataset(ds, args.data_dir)
        digits = ds == "digits"
        architecture = "digits_cnn_1x8x8_10" if digits else "lenet5_1x28x28_10"
        from edge_sdk import OnnxEncoder

        encoder = OnnxEncoder("digits_encoder" if digits else args.encoder)
        for n in args.clients:
            for split, (i, seed) in ((sp, s) for sp in args.splits for s in enumerate(args.seeds)):
                seed_args = copy.copy(args)
                seed_args.seed = seed
                clients = build_clients(split, x, y, n, args.samples_per_client, seed)
                aux = aux_set(xt, yt, args.aux_per_class, rotations=3 if split == "rotation" else 1, seed=seed)
                sizes = np.bincount([c.group for c in clients]).tolist()
                print(f"\n{ds} {n} clients {split} seed {seed}: groups {sizes}, "
                      f"{sum(len(c.y_train) for c in clients)} training samples", flush=True)
                shared: dict[tuple, tuple[str, list, dict[str, Any]]] = {}  # OCFL warm-ups, by settings
                # the sketch method clusters at round 0 and runs on every seed; the others train
                for label in [m for m in methods if m == "fedsketch" or i < args.trained_seeds]:
                    spec = specs[label]
                    key = ("ocfl", json.dumps({k: v for k, v in spec.get("params", {}).items()
                                               if k in ("max_warmup_rounds", "warmup_fraction")}, sort_keys=True))
                    try:
                        r = None
                        if spec["strategy"] == "ocfl" and args.share_warmup and key in shared:
                            r = replay_one(label, spec, clients, aux, seed_args, architecture, *shared[key])
                        if r is None:
                            record = [] if spec["strategy"] == "ocfl" and args.share_warmup else None
                            r = run_one(label, spec, clients, aux, seed_args, architecture, encoder, record)
                            if record is not None and r["clustered"]:
                                shared.setdefault(key, (label, record, r))
                    except Exception as e:  # a method's failure is a result, not the end of the benchmark
                        if args.strict:
                            raise
                        log.exception("%s failed on %s-%d-%s", label, ds, n, split)
                        print(f"  {label:15s} FAILED: {e.__class__.__name__}: {e}", flush=True)
                        bar.update(1)
                        continue
                    r = {"dataset": ds, "clients": n, "split": split, "method": label, "seed": seed, **r,
                         "truth": {c.cid: int(c.group) for c in clients}}
                    rows.append(r)
                    bar.update(1)
                    rnd = r["cluster_round"] if r["clustered"] else "never"
                    via = f" (warm-up of {r['replayed_from']})" if r.get("replayed_from") else ""
                    print(f"  {label:15s} ARI {r['ari']:6.3f}  AMI {r['ami']:6.3f}  COM {r['completeness']:6.3f}  "
                          f"k={r['clusters']}  round {rnd}  {human_bytes(r['bytes_until_clustering'])}  "
                          f"{r['seconds']:.1f} s{via}", flush=True)
    bar.close()
    print_table(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if rows:
        heatmap(out / "ari_heatmap.png", rows, "ari",
                title="ARI against the true groups (method x scenario, mean over seeds)")
        heatmap(out / "bytes_heatmap.png", rows, "bytes_until_clustering", log10=True,
                title="Bytes in and out of the server until clustering")
    seconds = time.perf_counter() - t_all
    summary = summarize(rows, skipped)
    summary["seconds"] = round(seconds, 1)
    print_spread(summary["cells"])
    write_json(out / "results.json", {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                      "methods": {m: specs[m] for m in methods}, "skipped": skipped,
                                      "rows": rows, "paper_ari": {f"{d}-{n}-{s}": v for (d, n, s), v in
                                                                  PAPER_ARI.items()},
                                      "summary": summary})
    print(f"\nreport: {out}/results.json, {out}/ari_heatmap.png, {out}/bytes_heatmap.png; {seconds:.0f} s in all")
    return summary


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return _NoBar()
    return tqdm(total=total, desc="runs", leave=False, file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_options(ap)
    ap.add_argument("--datasets", type=csv_list(str, {"mnist", "fmnist", "digits"}), default=["mnist", "fmnist"])
    ap.add_argument("--clients", type=csv_list(int), default=[15, 30])
    ap.add_argument("--splits", type=csv_list(str, set(SPLITS)), default=list(SPLITS))
    ap.add_argument("--methods", type=csv_list(str, set(METHODS)), default=None,
                    help=f"comma-separated, of {', '.join(METHODS)} (default: all; --quick: the fast ones)")
    ap.add_argument("--params", type=json.loads, default={},
                    help='JSON overrides of method parameters, e.g. \'{"cfl": {"eps1": 0.2}}\'')
    ap.add_argument("--data-dir", type=Path, default=DEFAULT_DATA,
                    help="folder with mnist/ and fashion-mnist/ IDX files")
    ap.add_argument("--samples-per-client", type=int, default=600,
                    help="samples (train + test) per client; 0: all of the group's data, as the paper")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--cfl-rounds", type=int, default=20, help="rounds CFL runs (it has no one-shot rule)")
    ap.add_argument("--dynamic-rounds", type=int, default=3,
                    help="rounds a method that re-clusters every round (FLIS-DC) runs; its last clustering counts")
    ap.add_argument("--max-rounds", type=int, default=10,
                    help="rounds at most for an update-based method without max_warmup_rounds")
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--aux-per-class", type=int, default=250, help="FLIS server set, images per class")
    ap.add_argument("--encoder", default="fmnist_fc_encoder", help="sketch encoder for 28x28 images")
    ap.add_argument("--seeds", type=csv_list(int), default=list(range(20)),
                    help="partitions, sketches and training, one run each (default 0 to 19; --quick: 0, 1, 2)")
    ap.add_argument("--trained-seeds", type=int, default=1,
                    help="the methods that train run on this many of the seeds, the first ones (one seed of "
                         "every method is about 3 hours on 2 cores); the sketch method runs on all")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (LeNet-5 on a CPU: 1 is fastest)")
    ap.add_argument("--out", default="reports/clustering_quality")
    ap.add_argument("--no-share-warmup", dest="share_warmup", action="store_false",
                    help="train OCFL's warm-up again for each of its algorithms (default: replay the first one's)")
    ap.add_argument("--strict", action="store_true", help="stop at the first failing method")
    ap.add_argument("--quick", action="store_true",
                    help="digits, 12 clients, rotation and non-overlapping balanced splits, fast methods")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    if args.quick:
        args.datasets, args.clients = ["digits"], [12]
        # --splits given: kept (one split for a check that needs no other)
        args.splits = args.splits if args.splits != list(SPLITS) else ["rotation", "nonoverlap_balanced"]
        args.samples_per_client, args.aux_per_class, args.cfl_rounds = 0, 30, 4
        args.seeds = args.seeds if args.seeds != list(range(20)) else [0, 1, 2]
        args.methods = args.methods or list(QUICK_METHODS)
        args.progress = False
        args.out = args.out if args.out != "reports/clustering_quality" else "reports/clustering_quality_quick"
        # the digits CNN's updates are smaller than LeNet-5's (mean norm about 0.01, largest 0.03 to 0.08)
        args.params = {"cfl": {"eps1": 0.02, "eps2": 0.02, "warmup_rounds": 2}, **args.params}
    args.methods = args.methods or list(METHODS)
    if args.trained_seeds < 0:
        ap.error(f"--trained-seeds must be >= 0, got {args.trained_seeds}")
    if args.samples_per_client < 0:
        ap.error(f"--samples-per-client must be >= 0, got {args.samples_per_client}")
    for ds in args.datasets:
        sub = {"mnist": "mnist", "fmnist": "fashion-mnist"}.get(ds)
        if sub and not ((args.data_dir / sub).is_dir() or any(args.data_dir.glob("train-images*"))):
            print(f"{ds} not found in {args.data_dir}: pass --data-dir DIR, or --quick for the digits version",
                  file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(json.dumps(run(args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
