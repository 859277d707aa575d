"""Privacy and robustness of the sketches: ARI against P (Figure 4) and reconstruction (Table II).

Two experiments of Prigent et al., Section VI:

**a. Clustering quality against the flip probability P (paper Figure 4a).**
MNIST train (``--data``) split over 100 clients with Dirichlet(10) label
skew in 4 rotation groups (0, 90, 180, 270 degrees;
``server_kit.data.partition.rotation_groups``), each client keeping 80% of
its shard for training. Every client sketches its training split (10 classes
x 20 bits) with two encoders:

* *central*: the shipped ``fmnist_fc_encoder`` (pre-trained on Fashion-MNIST);
* *federated*: the same 784-50-20 autoencoder pre-trained by FedAvg over the
  clients' own training images as the paper does for MNIST (50 clients per
  round, 10 rounds, 3 local epochs, Adam 1e-3, batch 32;
  ``server_kit.pretrain.federated_ae_pretrain``), exported to ONNX with its
  manifest (``export_encoder``) and loaded with ``edge_sdk.OnnxEncoder`` like
  any device would. Its cost is reported: seconds, the bytes of every
  ``MODEL`` / ``UPDATE`` envelope, and the ONNX file each client then needs.

for P = 0, 0.05, ..., 0.5, then clusters them with
``SketchClustering(min_cluster_size=10, random_state=seed)`` and scores the
adjusted Rand index (ARI) against the rotation groups. Each of ``--seeds``
repetitions draws new per-client sketch seeds (flips and absent-class noise);
the partition and the federated encoder stay the same. Within one
repetition a client keeps its seed across P, so its flips are nested (every
bit flipped at P = 0.05 is flipped at 0.10 too). Mean and standard deviation
over the repetitions are printed and plotted (``ari_vs_p.png``).

**b. Reconstruction from a single-sample sketch (paper Table II, Figure 3).**
The worst case: a client holding one image of a class, whose class vector is
that image's encoding. Fashion-MNIST test images (``--attack-data``) are
encoded with the central encoder (ONNX), and the attacker, who knows the
autoencoder, decodes with its decoder (torch, from
``models/fmnist_fc_ae.safetensors``):

* *unperturbed*: the float latent itself;
* *P = 0 ... 20%*: the 20 bits the sketch would carry
  (``edge_sdk.bits.quantize_pack``: min-max over the vector, round, flip
  with P; every image with its own seed, the same across P), mapped back to
  latent values and decoded. Three attacker mappings, all learnt from
  public data only (the Fashion-MNIST *train* encodings):

  - ``condmean`` (the reported ``mse_by_p``): bit b of dimension d -> the
    mean of latent dimension d over the public vectors whose quantised bit
    d (with the same P, which is public) is b: the per-dimension
    least-squares estimate, and the strongest of the three;
  - ``range``: bit b of dimension d -> ``lo_d + b * (hi_d - lo_d)``, lo/hi
    the minimum and maximum of that latent dimension over the public
    encodings (it lands on the extremes of every dimension and does worse
    than an attacker who ignores the sketch);
  - ``raw``: the 0/1 bits decoded as they are.

  ``mse_by_p`` reports the strongest attacker because a privacy figure
  should not rest on a weak one; all three are in ``mse_by_p_attacker``.

We report the per-pixel MSE on [0, 1] images, mean (and standard deviation)
over ``--attack-n`` images, beside the paper's Table II (0.0175 unperturbed,
0.7039 binary, 0.8040 / 0.9075 / 0.9811 / 1.0765 at 5 / 10 / 15 / 20%).
Those were measured on CIFAR-10 with the convolutional autoencoder and their
scale is not ours (an MSE above 1 is impossible for [0, 1] pixels): compare
trends, not values. As a yardstick, the MSE of the public mean image (an
attacker who learns nothing from the sketch) is printed too. The grids
``reconstruction_<attacker>.png`` are laid out like Figure 3: rows original,
unperturbed, P = 0, 5, 10, 15, 20%; one column per class.

Run (from the repository root)::

    .venv/bin/python benchmarks/privacy.py            # full: several minutes
    .venv/bin/python benchmarks/privacy.py --quick    # smoke run, under a minute

Options: ``--data`` (MNIST IDX folder, default ``../shared/data/mnist``
next to the repository), ``--attack-data`` (Fashion-MNIST, default
``../shared/data/fashion-mnist``), ``--out`` (folder for the PNGs, the
exported federated encoder and ``privacy.json``; default
``reports/privacy``), ``--seeds``, ``--clients``, ``--attack-n``,
``--threads``. The last line printed is JSON with ``ari_central`` and
``ari_federated`` (mean ARI per P), ``p_values``, ``mse_unperturbed``,
``mse_by_p`` (condmean attacker, keyed by P), ``pretrain_seconds``,
``pretrain_bytes`` (down + up) and more.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from edge_sdk import OnnxEncoder, Sketcher, stack_sketches  # noqa: E402
from edge_sdk import bits as _bits  # noqa: E402
from edge_sdk.privacy import THREAT_MODEL, sketch_epsilon  # noqa: E402
from server_kit.clustering import SketchClustering  # noqa: E402
from server_kit.data.idx import load_idx_dataset  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
from _cli import csv_list  # noqa: E402
from _privacy_dp import dp_part, plot_dp  # noqa: E402
from _privacy_secure import secure_part  # noqa: E402

#: The benchmark's parts: a and b (the sketches: ARI against P and epsilon, reconstruction), c (DP-FedAvg),
#: d (secure aggregation over Mosquitto).
PARTS = ("sketch", "dp", "secure")

AE_ARCH = "fc_ae_784_50_20"
CENTRAL_ENCODER = "fmnist_fc_encoder"
NUM_CLASSES = 10
#: Paper Table II (CIFAR-10, convolutional AE): None = unperturbed float latent.
PAPER_TABLE_II: dict[Any, float] = {
    None: 0.0175,
    0.0: 0.7039,
    0.05: 0.8040,
    0.10: 0.9075,
    0.15: 0.9811,
    0.20: 1.0765,
}
ATTACK_P = (0.0, 0.05, 0.10, 0.15, 0.20)
ATTACKERS = ("condmean", "range", "raw")
#: The attacker whose MSE is reported as ``mse_by_p``.
PRIMARY_ATTACKER = "condmean"


def pkey(p: float) -> str:
    """A P value as a JSON key: ``0``, ``0.05``, ``0.1``..."""
    return f"{p:g}"


def progress(iterable: Any, desc: str, total: int | None = None) -> Any:
    """A tqdm bar on stderr when tqdm is installed."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, desc=desc, total=total, leave=False)


def load_unit(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """An IDX split as float32 (N, 28, 28) images in [0, 1] and int64 labels."""
    x, y = load_idx_dataset(directory, split)
    return (x.astype(np.float32) / 255.0), y.astype(np.int64)


# --------------------------------------------------------------------------- a. ARI vs P


def make_clients(args: argparse.Namespace) -> tuple[list[Any], str]:
    """The MNIST rotation scenario; returns the clients and a description of the split."""
    from server_kit.data import partition

    x, y = load_unit(Path(args.data), "train")
    if args.max_images and args.max_images < len(x):
        keep = np.random.default_rng(args.partition_seed).permutation(len(x))[: args.max_images]
        x, y = x[keep], y[keep]
    if hasattr(partition, "rotation_groups"):
        clients = partition.rotation_groups(
            x, y, args.clients, groups=4, alpha=10.0, seed=args.partition_seed
        )
        how = f"rotation_groups: Dirichlet(alpha=10) label skew, 4 rotation groups, {len(x)} images"
    else:  # pragma: no cover - older checkouts
        clients = partition.rotation_partition(x, y, args.clients, groups=4, seed=args.partition_seed)
        how = f"rotation_partition: equal random shards, 4 rotation groups, {len(x)} images"
    return clients, how


def pretrain_federated(clients: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """Federated AE pre-training on the clients' training images, exported to ONNX."""
    from server_kit.pretrain import export_encoder, federated_ae_pretrain

    images = [c.x_train for c in clients]
    res = federated_ae_pretrain(
        images,
        architecture=AE_ARCH,
        rounds=args.pretrain_rounds,
        clients_per_round=min(args.pretrain_clients, len(images)),
        epochs=args.pretrain_epochs,
        lr=1e-3,
        batch_size=32,
        seed=args.partition_seed,
        progress=True,
        threads=args.threads,
    )
    settings = {
        "rounds": args.pretrain_rounds,
        "clients_per_round": min(args.pretrain_clients, len(images)),
        "local_epochs": args.pretrain_epochs,
        "lr": 1e-3,
        "batch_size": 32,
        "seed": args.partition_seed,
    }
    exported = export_encoder(
        res.weights,
        AE_ARCH,
        Path(args.out) / "models",
        name="fed_ae_encoder",
        metadata={
            "training_data": (
                f"federated pre-training over the training splits of {len(images)} MNIST "
                "rotation-scenario clients (benchmarks/privacy.py)"
            ),
            "training": settings,
            "final_round_train_mse": res.history[-1]["loss"],
        },
    )
    n_clients = len(images)
    return {
        "result": res,
        "exported": exported,
        "settings": settings,
        "encoder_bytes_per_client": exported.nbytes,
        "encoder_distribution_bytes": exported.nbytes * n_clients,
        "round_losses": [h["loss"] for h in res.history],
    }


def client_test_mse(clients: list[Any], fed_weights: dict[str, np.ndarray]) -> dict[str, float]:
    """Reconstruction MSE per pixel of both autoencoders on the clients' held-out images."""
    import torch

    from server_kit.export import evaluate_mse
    from server_kit.nets import build_model

    x = np.concatenate([c.x_test for c in clients]).reshape(-1, 784)
    fed = build_model(AE_ARCH)
    fed.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in fed_weights.items()})
    central = load_decoder(full=True)
    return {"central": evaluate_mse(central, x), "federated": evaluate_mse(fed.eval(), x)}


def sketch_all(
    encoder: OnnxEncoder, clients: list[Any], p_values: list[float], seed: int
) -> dict[float, np.ndarray]:
    """Packed sketches of every client for every P; one seed per client, shared across P."""
    client_seeds = np.random.default_rng([seed, 0x5EED]).integers(0, 2**63, size=len(clients))
    out: dict[float, list[bytes]] = {p: [] for p in p_values}
    for c, s in zip(clients, client_seeds.tolist()):
        vectors, _ = Sketcher(encoder, NUM_CLASSES, 0.0, seed=s).class_means(c.x_train, c.y_train)
        for p in p_values:
            out[p].append(Sketcher(encoder, NUM_CLASSES, p, seed=s).sketch_vectors(vectors))
    return {p: stack_sketches(sk) for p, sk in out.items()}


def ari_sweep(
    encoders: dict[str, OnnxEncoder], clients: list[Any], p_values: list[float], seeds: int
) -> dict[str, dict[str, Any]]:
    """ARI and cluster counts per encoder, P and seed."""
    from sklearn.metrics import adjusted_rand_score

    truth = np.array([c.group for c in clients])
    n_bits = NUM_CLASSES * 20
    res: dict[str, dict[str, Any]] = {}
    jobs = [(name, s) for name in encoders for s in range(seeds)]
    bar = progress(None, "ARI vs P (clusterings)", total=len(jobs) * len(p_values))
    for name in encoders:
        res[name] = {"ari": np.zeros((seeds, len(p_values))), "k": np.zeros((seeds, len(p_values)))}
    for name, s in jobs:
        packed = sketch_all(encoders[name], clients, p_values, seed=s)
        for j, p in enumerate(p_values):
            model = SketchClustering(min_cluster_size=10, random_state=s).fit(packed[p], n_bits)
            res[name]["ari"][s, j] = adjusted_rand_score(truth, model.labels_)
            res[name]["k"][s, j] = model.n_clusters_
            if hasattr(bar, "update"):
                bar.update(1)
                bar.set_postfix(encoder=name, seed=s, P=p)
    if hasattr(bar, "close"):
        bar.close()
    return res


def plot_ari(res: dict[str, dict[str, Any]], p_values: list[float], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    styles = {"central": ("tab:blue", "o", "central AE (Fashion-MNIST)"),
              "federated": ("tab:orange", "s", "federated AE (client data)")}
    ps = np.array(p_values)
    for name, r in res.items():
        color, marker, label = styles.get(name, ("k", "x", name))
        mean, std = r["ari"].mean(axis=0), r["ari"].std(axis=0)
        ax.plot(ps, mean, marker=marker, color=color, label=label)
        ax.fill_between(ps, mean - std, mean + std, color=color, alpha=0.2)
        kmean = r["k"].mean(axis=0)
        for x, y, k in zip(ps, mean, kmean):
            ax.annotate(f"c={k:.3g}", (x, y), textcoords="offset points",
                        xytext=(0, 6 if name == "central" else -12), ha="center",
                        fontsize=6, color=color)
    ax.set_xlabel("flip probability P")
    ax.set_ylabel("adjusted Rand index (mean ± std)")
    ax.set_ylim(-0.1, 1.1)
    ax.set_xticks(ps)
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- b. reconstruction


def plot_ari_epsilon(ari: dict[str, tuple[list[float], list[float]]], p_values: list[float], path: Path,
                     title: str) -> Path:
    """ARI (mean, std per P, by encoder) against the sketch's epsilon per device and per image, log axis; P = 0
    (no privacy: infinite) and P = 0.5 (epsilon 0: the bits are coins) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keep = [j for j, p in enumerate(p_values) if 0 < p < 0.5]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, level in zip(axes, ("per_device", "per_image")):
        xs = [getattr(sketch_epsilon(p_values[j], NUM_CLASSES, 20), level) for j in keep]
        for name, style in (("central", "o-"), ("federated", "s--")):
            mean, std = (np.asarray(v)[keep] for v in ari[name])
            ax.errorbar(xs, mean, yerr=std, fmt=style, capsize=3, label=f"{name} AE")
        for j, x in zip(keep, xs):
            ax.annotate(f"P={p_values[j]:g}", (x, np.asarray(ari["central"][0])[j]), fontsize=6,
                        textcoords="offset points", xytext=(2, 4))
        ax.set_xscale("log")
        ax.set_xticks(xs, [f"{x:.3g}" for x in xs], fontsize=7, rotation=60)
        ax.minorticks_off()
        ax.set_xlabel(f"sketch epsilon {level.replace('_', ' ')} ({'user level' if level == 'per_device' else 'one image'})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("ARI against the rotation groups")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_decoder(full: bool = False) -> Any:
    """The central autoencoder's torch decoder (or whole AE), from the shipped safetensors."""
    from edge_sdk.models.artifacts import load_manifest, models_dir
    from server_kit.export import load_weights

    spec = load_manifest()["fmnist_fc_ae"]
    model = load_weights(models_dir() / spec.extra["weights"]["file"], AE_ARCH)
    return model.eval() if full else model.decoder.eval()


def decode(decoder: Any, z: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return decoder(torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32))).numpy()


def quantise(z: np.ndarray, p: float, seeds: np.ndarray) -> np.ndarray:
    """The sketch's bits of each single-image class vector, one seed per vector: (n, latent)."""
    out = np.empty(z.shape, dtype=np.uint8)
    d = z.shape[1]
    for i in range(z.shape[0]):
        packed = _bits.quantize_pack(z[i : i + 1].astype(np.float64), p, int(seeds[i]))
        out[i] = _bits.unpack_bits(packed, d)
    return out


def attack(args: argparse.Namespace) -> dict[str, Any]:
    """Reconstruction MSE from single-image sketches, per attacker and P."""
    data = Path(args.attack_data)
    x_pub, _ = load_unit(data, "train")
    x_test, y_test = load_unit(data, "test")
    enc = OnnxEncoder(CENTRAL_ENCODER)
    decoder = load_decoder()
    z_pub = enc.encode(x_pub)  # the attacker's public data
    lo, hi = z_pub.min(axis=0), z_pub.max(axis=0)
    mean_image = x_pub.reshape(len(x_pub), -1).mean(axis=0)

    rng = np.random.default_rng(args.attack_seed)
    firsts = [int(np.flatnonzero(y_test == c)[0]) for c in range(NUM_CLASSES)]
    rest = np.setdiff1d(np.arange(len(x_test)), firsts)
    n_other = max(0, min(args.attack_n, len(x_test)) - len(firsts))
    idx = np.concatenate([firsts, rng.choice(rest, size=n_other, replace=False)]).astype(np.intp)
    x = x_test[idx].reshape(len(idx), -1)
    z = enc.encode(x)
    seeds = rng.integers(0, 2**63, size=len(idx))
    pub_seeds = rng.integers(0, 2**63, size=len(x_pub))

    def mse(rec: np.ndarray) -> np.ndarray:
        return ((rec - x) ** 2).mean(axis=1)

    per_image: dict[str, np.ndarray] = {
        "unperturbed": mse(decode(decoder, z)),
        "mean_image": mse(np.broadcast_to(mean_image, x.shape)),
    }
    recon: dict[str, dict[str, np.ndarray]] = {a: {} for a in ATTACKERS}
    recon["unperturbed"] = {"": decode(decoder, z[: NUM_CLASSES])}
    for p in progress(ATTACK_P, "reconstruction attack (P values)"):
        b = quantise(z, p, seeds).astype(np.float32)
        # condmean: E[z_d | observed bit_d] on the public data quantised with the same P
        b_pub = quantise(z_pub, p, pub_seeds).astype(bool)
        overall = z_pub.mean(axis=0)
        cond = np.empty((2, z.shape[1]), dtype=np.float64)
        for bit in (0, 1):
            mask = b_pub == bool(bit)
            counts = mask.sum(axis=0)
            sums = np.where(mask, z_pub, 0.0).sum(axis=0, dtype=np.float64)
            cond[bit] = np.where(counts > 0, sums / np.maximum(counts, 1), overall)
        latents = {
            "range": lo + b * (hi - lo),
            "condmean": np.where(b > 0, cond[1], cond[0]),
            "raw": b,
        }
        for name, lat in latents.items():
            rec = decode(decoder, lat)
            per_image[f"{name}@{pkey(p)}"] = mse(rec)
            recon[name][pkey(p)] = rec[:NUM_CLASSES]
    out_dir = Path(args.out)
    grids = [
        plot_grid(x[:NUM_CLASSES], recon, name, out_dir / f"reconstruction_{name}.png")
        for name in ATTACKERS
    ]
    return {
        "n_images": len(idx),
        "per_image": per_image,
        "grids": [str(g) for g in grids],
        "latent_range": {"lo": lo.tolist(), "hi": hi.tolist()},
    }


def plot_grid(originals: np.ndarray, recon: dict[str, dict[str, np.ndarray]], attacker: str,
              path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [("original", originals), ("unperturbed", recon["unperturbed"][""])]
    rows += [(f"P = {100 * p:g}%", recon[attacker][pkey(p)]) for p in ATTACK_P]
    n_cols = originals.shape[0]
    fig, axes = plt.subplots(len(rows), n_cols, figsize=(1.0 * n_cols + 0.9, 1.0 * len(rows)))
    for r, (label, imgs) in enumerate(rows):
        for c in range(n_cols):
            ax = axes[r, c]
            ax.imshow(imgs[c].reshape(28, 28), cmap="gray", vmin=0.0, vmax=1.0)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel(label, fontsize=7)
    fig.suptitle(
        f"Reconstruction from single-image sketches (central FC AE, attacker mapping '{attacker}')",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    default_shared = REPO.parent / "shared" / "data"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="small smoke run: 40 clients on 12,000 images, 3 pre-training rounds "
                        "of 10 clients, 1 seed, P in {0, 0.1, 0.2, 0.3}, 200 attack images")
    p.add_argument("--data", default=str(default_shared / "mnist"), help="MNIST IDX folder")
    p.add_argument("--attack-data", default=str(default_shared / "fashion-mnist"),
                   help="Fashion-MNIST IDX folder (public data and attacked test images)")
    p.add_argument("--out", default=str(REPO / "reports" / "privacy"),
                   help="folder for the PNGs, the federated encoder and privacy.json")
    p.add_argument("--seeds", type=int, default=None, help="sketch-seed repetitions (default 3)")
    p.add_argument("--clients", type=int, default=None, help="clients (default 100)")
    p.add_argument("--attack-n", type=int, default=None, help="attacked images (default 1000)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the local pre-training (default 1, fastest here)")
    p.add_argument("--partition-seed", type=int, default=0,
                   help="seed of the partition and of the federated pre-training")
    p.add_argument("--attack-seed", type=int, default=0, help="seed of the attack's image choice and flips")
    p.add_argument("--parts", type=csv_list(str, PARTS), default=list(PARTS),
                   help=f"which parts to run, of {','.join(PARTS)} (default: all)")
    p.add_argument("--dp-epsilons", type=csv_list(float), default=None,
                   help="the budgets of part c (default 1,2,4,8,16; --quick: 8)")
    p.add_argument("--dp-delta", type=float, default=1e-5)
    p.add_argument("--dp-clip", type=float, default=None, help="default 1.0 (--quick: 5.0)")
    p.add_argument("--dp-rounds", type=int, default=None, help="default 5 (--quick: 3)")
    p.add_argument("--dp-epochs", type=int, default=None, help="local epochs (default 5, the paper's; --quick: 2)")
    p.add_argument("--dp-lr", type=float, default=None, help="default 1e-3 (--quick: 1e-2)")
    p.add_argument("--dp-fraction", type=float, default=0.5, help="devices asked per cluster round")
    p.add_argument("--dp-seed", type=int, default=0)
    p.add_argument("--dp-cohorts", type=csv_list(int), default=None,
                   help="devices a cluster round whose noise part c tries at --dp-cohort-epsilon (default "
                        "100,1000,10000; --quick: 1000)")
    p.add_argument("--dp-cohort-epsilon", type=float, default=8.0)
    p.add_argument("--jobs", type=int, default=2, help="part c's runs at a time, each in its own process")
    p.add_argument("--dp-tolerance", type=float, default=0.03, help="accuracy within this of the non-private run")
    p.add_argument("--secure-devices", type=int, default=None, help="devices of part d (default 50; --quick: 16)")
    p.add_argument("--secure-rounds", type=int, default=None, help="default 3 (--quick: 2)")
    p.add_argument("--secure-clip", type=float, default=5.0)
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    quick = args.quick
    args.seeds = args.seeds if args.seeds is not None else (1 if quick else 3)
    args.clients = args.clients if args.clients is not None else (40 if quick else 100)
    args.attack_n = args.attack_n if args.attack_n is not None else (200 if quick else 1000)
    args.max_images = 12_000 if quick else 0
    args.pretrain_rounds = 3 if quick else 10
    args.pretrain_clients = 10 if quick else 50
    args.pretrain_epochs = 3
    args.p_values = [0.0, 0.1, 0.2, 0.3] if quick else [round(0.05 * i, 2) for i in range(11)]
    args.dp_epsilons = args.dp_epsilons or ([8.0] if quick else [1.0, 2.0, 4.0, 8.0, 16.0])
    args.dp_clip = args.dp_clip if args.dp_clip is not None else (5.0 if quick else 1.0)
    args.dp_rounds = args.dp_rounds or (3 if quick else 5)
    args.dp_epochs = args.dp_epochs or (2 if quick else 5)
    args.dp_lr = args.dp_lr or (1e-2 if quick else 1e-3)
    args.dp_cohorts = args.dp_cohorts or ([1000] if quick else [100, 1000, 10000])
    args.secure_devices = args.secure_devices or (16 if quick else 50)
    args.secure_rounds = args.secure_rounds or (2 if quick else 3)
    for name in ("seeds", "clients", "attack_n", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    if args.clients < 20:
        raise SystemExit("--clients must be at least 20 (min_cluster_size 10, 4 groups)")
    for d in (args.data, args.attack_data) if "sketch" in args.parts or ("dp" in args.parts and not quick) else ():
        if not Path(d).is_dir():
            raise SystemExit(f"dataset folder {d} does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    args = resolve(build_parser().parse_args(argv))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    print(f"privacy benchmark: {platform.platform()}, {os.cpu_count()} CPUs, python "
          f"{platform.python_version()}{' (quick)' if args.quick else ''}; parts {','.join(args.parts)}", flush=True)
    summary: dict[str, Any] = {}
    if "sketch" in args.parts:
        summary.update(sketch_parts(args, out))
    eps = sketch_epsilon(0.1, 10, 20)  # the default sketch: 10 classes x 20 bits at P = 0.1
    summary.update({"sketch_epsilon": eps.per_device, "sketch_epsilon_per_image": eps.per_image,
                    "sketch_epsilon_threat_model": THREAT_MODEL})
    if "dp" in args.parts:
        t0 = time.perf_counter()
        print(f"\n[c] DP-FedAvg per cluster: {'digits, 12 clients' if args.quick else 'MNIST, 100 clients'}, "
              f"{args.dp_rounds} rounds, delta {args.dp_delta:g}, clip {args.dp_clip:g}", flush=True)
        dp = dp_part(args)
        plot_dp(dp, out / "accuracy_vs_epsilon.png")
        at = dp["by_epsilon"].get(f"{args.dp_cohort_epsilon:g}")
        summary.update({"dp": dp, "dp_epsilon": None if at is None else at["epsilon_spent"],
                        "dp_accuracy_gap": dp["gap_at_cohort_epsilon"], "dp_clients_needed": dp["clients_needed"]})
        print(f"figure: {out / 'accuracy_vs_epsilon.png'} ({time.perf_counter() - t0:.0f} s for part c)", flush=True)
    if "secure" in args.parts:
        t0 = time.perf_counter()
        print(f"\n[d] secure aggregation over Mosquitto: {args.secure_devices} devices, 4 clusters, a tenth dropping "
              f"mid-round, {args.secure_rounds} rounds, plain then secure", flush=True)
        sec = secure_part(args, out)
        summary.update({"secure": sec, "secure_sum_equals_plain": sec["secure_sum_equals_plain"],
                        "secure_rounds_closed_with_dropout": sec["secure_rounds_closed_with_dropout"]})
        print(f"  sums equal to the plain sums: {sec['groups_equal']} of {sec['groups']} cluster rounds; rounds closed "
              f"at their goal with {len(sec['dropping'])} dropping: {sec['close_reasons']['secure']}")
        print(f"  bytes per device per round: int4 update {sec['update_bytes_int4']:,.0f}, secure "
              f"{sec['secure_bytes_per_device_round']:,.0f} (extra {sec['extra_bytes_over_int4_update'] or 0:.2f}x "
              f"the update); round seconds plain {np.mean(sec['round_seconds']['plain']):.2f}, secure "
              f"{np.mean(sec['round_seconds']['secure']):.2f} ({sec['round_time_ratio'] or 0:.2f}x); accuracy plain "
              f"{sec['accuracy']['plain']:.4f}, secure {sec['accuracy']['secure']:.4f} "
              f"({time.perf_counter() - t0:.0f} s for part d)", flush=True)
    summary.update({"seconds": time.perf_counter() - t_all, "quick": bool(args.quick), "parts": args.parts})
    (out / "privacy.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary))
    return 0


def sketch_parts(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Parts a (ARI against P, and against the sketch's epsilon) and b (reconstruction): their summary."""
    t_all = time.perf_counter()

    # ---- a. ARI vs P
    t0 = time.perf_counter()
    clients, how = make_clients(args)
    sizes = [len(c.x_train) for c in clients]
    print(f"\n[a] ARI vs P: {len(clients)} clients ({how}); train samples per client "
          f"{min(sizes)}-{max(sizes)}; groups {np.bincount([c.group for c in clients]).tolist()}",
          flush=True)
    fed = pretrain_federated(clients, args)
    res_pt = fed["result"]
    st = fed["settings"]
    print(f"federated AE pre-training: {st['rounds']} rounds x {st['clients_per_round']} clients "
          f"x {st['local_epochs']} epochs in {res_pt.seconds:.1f} s; train MSE per round "
          f"{', '.join(f'{v:.4f}' for v in fed['round_losses'])}")
    print(f"  bytes on the wire: down {res_pt.bytes_down:,} (MODEL envelopes), up "
          f"{res_pt.bytes_up:,} (UPDATE envelopes), total {res_pt.bytes_total:,}; "
          f"then the ONNX encoder ({fed['encoder_bytes_per_client']:,} bytes) to each of "
          f"{len(clients)} clients = {fed['encoder_distribution_bytes']:,} bytes", flush=True)
    test_mse = client_test_mse(clients, res_pt.weights)
    print(f"  reconstruction MSE on the clients' held-out images: central AE "
          f"{test_mse['central']:.4f}, federated AE {test_mse['federated']:.4f}", flush=True)
    encoders = {
        "central": OnnxEncoder(CENTRAL_ENCODER),
        "federated": OnnxEncoder("fed_ae_encoder", models_dir=fed["exported"].models_dir),
    }
    sweep = ari_sweep(encoders, clients, args.p_values, args.seeds)
    ari_seconds = time.perf_counter() - t0
    print(f"\nARI against the 4 rotation groups, mean ± std over {args.seeds} sketch seed(s); "
          "k = mean number of clusters found")
    print(f"{'P':>5} | {'central AE ARI':>16} {'k':>5} | {'federated AE ARI':>16} {'k':>5}")
    for j, p in enumerate(args.p_values):
        cells = []
        for name in ("central", "federated"):
            a, k = sweep[name]["ari"][:, j], sweep[name]["k"][:, j]
            cells.append(f"{a.mean():7.3f} ± {a.std():6.3f} {k.mean():5.2f}")
        print(f"{p:5.2f} | {cells[0]:>22} | {cells[1]:>22}")
    ari_png = plot_ari(
        sweep, args.p_values, out / "ari_vs_p.png",
        f"MNIST rotations, {len(clients)} clients, 4 groups: ARI vs P "
        f"({args.seeds} seed{'s' if args.seeds > 1 else ''})",
    )
    by_encoder = {n: (sweep[n]["ari"].mean(axis=0).tolist(), sweep[n]["ari"].std(axis=0).tolist())
                  for n in ("central", "federated")}
    eps_png = plot_ari_epsilon(by_encoder, args.p_values, out / "ari_vs_epsilon.png",
                               f"MNIST rotations, {len(clients)} clients: ARI against the sketch's epsilon")
    print(f"figures: {ari_png}, {eps_png} ({ari_seconds:.0f} s for part a)", flush=True)

    # ---- b. reconstruction attack
    t1 = time.perf_counter()
    att = attack(args)
    per = att["per_image"]
    print(f"\n[b] reconstruction from single-image sketches: {att['n_images']} Fashion-MNIST test "
          "images, central FC AE; per-pixel MSE on [0, 1] images, mean ± std over images")
    print(f"{'setting':>14} | {'condmean':>15} | {'range':>15} | {'raw bits':>15} | paper Table II*")
    u = per["unperturbed"]
    print(f"{'unperturbed':>14} | {u.mean():8.4f} ± {u.std():.3f} | {'':>15} | {'':>15} | "
          f"{PAPER_TABLE_II[None]:.4f}")
    for p in ATTACK_P:
        cells = [f"{per[f'{a}@{pkey(p)}'].mean():8.4f} ± {per[f'{a}@{pkey(p)}'].std():.3f}"
                 for a in ATTACKERS]
        print(f"{'P = ' + format(100 * p, 'g') + '%':>14} | {cells[0]} | {cells[1]} | {cells[2]} | "
              f"{PAPER_TABLE_II[p]:.4f}")
    mi = per["mean_image"]
    print(f"{'mean image':>14} | {mi.mean():8.4f} ± {mi.std():.3f} (no information: the public "
          "mean image)")
    print("* paper: CIFAR-10 with the convolutional AE, another MSE scale (values above 1 cannot "
          "be per-pixel MSEs of [0, 1] images): compare trends only")
    print(f"figures: {', '.join(att['grids'])} ({time.perf_counter() - t1:.0f} s for part b)")

    mse_by_p = {pkey(p): float(per[f"{PRIMARY_ATTACKER}@{pkey(p)}"].mean()) for p in ATTACK_P}
    summary = {
        "p_values": [float(p) for p in args.p_values],
        "ari_central": [float(v) for v in sweep["central"]["ari"].mean(axis=0)],
        "ari_federated": [float(v) for v in sweep["federated"]["ari"].mean(axis=0)],
        "ari_central_std": [float(v) for v in sweep["central"]["ari"].std(axis=0)],
        "ari_federated_std": [float(v) for v in sweep["federated"]["ari"].std(axis=0)],
        "clusters_central": [float(v) for v in sweep["central"]["k"].mean(axis=0)],
        "clusters_federated": [float(v) for v in sweep["federated"]["k"].mean(axis=0)],
        "seeds": args.seeds,
        "clients": len(clients),
        "partition": how,
        "mse_unperturbed": float(u.mean()),
        "mse_by_p": mse_by_p,
        "mse_attacker": PRIMARY_ATTACKER,
        "mse_by_p_attacker": {
            a: {pkey(p): float(per[f"{a}@{pkey(p)}"].mean()) for p in ATTACK_P} for a in ATTACKERS
        },
        "mse_mean_image": float(mi.mean()),
        "attack_images": att["n_images"],
        "pretrain_seconds": float(res_pt.seconds),
        "pretrain_bytes": int(res_pt.bytes_total),
        "pretrain_bytes_down": int(res_pt.bytes_down),
        "pretrain_bytes_up": int(res_pt.bytes_up),
        "pretrain_round_mse": [float(v) for v in fed["round_losses"]],
        "pretrain_settings": st,
        "client_test_mse": test_mse,
        "encoder_onnx_bytes": int(fed["encoder_bytes_per_client"]),
        "encoder_distribution_bytes": int(fed["encoder_distribution_bytes"]),
        "epsilon_by_p": {pkey(p): sketch_epsilon(p, 10, 20).to_dict() for p in args.p_values},
        "figures": [str(ari_png), str(eps_png), *att["grids"]],
        "sketch_seconds": time.perf_counter() - t_all,
    }
    return summary


if __name__ == "__main__":
    sys.exit(main())
