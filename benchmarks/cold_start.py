"""Cold start: devices that never trained get their cluster's model from one sketch, and do as well as its members.

Question: a federation trained ours (fedsketch) and exported its models; a
new device that took no part in training says hello, sends one sketch and
receives one model (its cluster's, by the nearest centroid). Is it placed in
the right cluster, and does its kept model do as well on its own data as the
model does for the devices that trained it? What does it cost the device
(bytes up and down, time from its start to a kept model)?

The scenario is the paper's MNIST one (:mod:`paper_mnist`), shorter: MNIST
from ``--data``, Dirichlet alpha = 10 label skew, device i rotated by
90 * (i mod 4) degrees (train and test), LeNet-5 (its convolutions averaged
over all sampled devices, the rest per cluster), Adam 1e-3, batch 32, 5 local
epochs, half of each cluster per round, P = 0.1, plain FedAvg, the shipped
Fashion-MNIST encoder; but ``--clients`` 40 training devices (the paper:
100) and ``--rounds`` 10 (the paper: 50), with ``--per-device`` 600 training
images each (the paper's shard size). Before partitioning, MNIST's training
images are shuffled and split into a pool for the training devices and a
pool for the new ones, and so are its test images (in proportion to the
device counts): the new devices' images, training and test, were never seen
by the federation. The new devices (``--new-per-group``, default 10 per
rotation group) are partitioned from their pools as the training devices are
from theirs: each its own Dirichlet shard, rotated as its group, and its own
test shard.

Steps:

1. ours (SketchClustered, the paper's defaults as :mod:`paper_mnist` runs
   them) and FedAvg trained on the same training devices in the in-process
   simulator (:class:`server_kit.drivers.simulate.Simulator`);
2. ours exported to ``OUT/models`` (:func:`server_kit.serving.export.export_models`),
   with the server state to serve from (a checkpoint:
   :func:`server_kit.drivers.checkpoint.write_checkpoint`);
3. a real broker (Mosquitto when installed, else the embedded amqtt one), an
   :class:`~server_kit.drivers.Orchestrator` serving the export
   (``serve(from_export=True)``, a fresh strategy restored from
   ``OUT/models/server-state``), and the new devices started ``--batch`` at a
   time (real :class:`edge_sdk.client.EdgeClient` threads over MQTT,
   ``get_model``: each leaves once it keeps its model in
   ``OUT/devices/ID``), so that each one's time is its own and not a queue's;
4. each new device's kept model (:class:`edge_sdk.LocalModel`, ONNX Runtime)
   scored on its own test shard, and compared with the FedAvg model and
   with the next group's cluster model on the same shard, and with the
   trained devices of its cluster (their final accuracy with ours, each on
   its own test shard, as the simulator evaluates them).

``--quick`` runs the same on scikit-learn's digits (12 training devices, 3
new ones per group, 3 rounds of 5 epochs, every device each round, lr 1e-2,
batch 16, equal shards; each device's test split is 20 % of its shard; the
shipped ``digits_encoder`` and ``digits_cnn_1x8x8_10``): the smoke test,
about 15 s. The full run takes about 4 minutes on 2 cores, nearly all
of it training.

Reported, per group and overall: the new devices' served cluster against
their true group (ARI), their accuracy with the kept model, the trained
devices' accuracy, the FedAvg model's and the wrong cluster's on the new
devices, bytes up and down per new device (its transport's counters: MQTT
payload bytes) beside the size of one exported weights file, and the time
from a device's start (before it connects) to its kept model (median and
max). ``OUT/results.json`` holds every device's row, ``OUT/cold_start.png``
the accuracies per group. The run fails (exit 1) unless every new device
kept a model. The last line is JSON.

Run: ``.venv/bin/python benchmarks/cold_start.py [--data DIR] [--out DIR]`` (``--quick``: digits).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _cli import add_device_options

from edge_sdk.models.keeping import ModelKeeper

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "mnist"
FED = "coldstart"
GROUPS = 4

log = logging.getLogger("cold_start")


# --------------------------------------------------------------------------- data


def _pool_split(n: int, share: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A random split of ``range(n)``: ``share`` of it, and the rest."""
    perm = rng.permutation(n)
    cut = int(round(n * share))
    return np.sort(perm[:cut]), np.sort(perm[cut:])


def _partition(x, y, n: int, args, *, seed: int, prefix: str, test_fraction: float):
    from server_kit.data.partition import rotation_groups

    skew = dict(alpha=args.alpha, min_size=10) if args.alpha else {}
    return rotation_groups(x, y, n, groups=GROUPS, seed=seed, test_fraction=test_fraction, prefix=prefix, **skew)


def build_devices(args) -> tuple[list, list]:
    """The training devices and the new ones, from disjoint pools of images (see the module docstring)."""
    from server_kit.data.clients import ClientData, load_digits_images
    from server_kit.data.idx import load_mnist

    n_new = GROUPS * args.new_per_group
    share = args.clients / (args.clients + n_new)
    rng = np.random.default_rng(args.seed)
    if args.dataset == "digits":  # one pool of images; each device's test split is 20 % of its shard
        x, y = load_digits_images()
        old, new = _pool_split(len(y), share, rng)
        return (_partition(x[old], y[old], args.clients, args, seed=args.seed, prefix="c", test_fraction=0.2),
                _partition(x[new], y[new], n_new, args, seed=args.seed + 1, prefix="new", test_fraction=0.2))
    x, y = load_mnist(args.data, "train")
    tx, ty = load_mnist(args.data, "test")
    need = args.per_device * (args.clients + n_new)
    if need > len(y):
        raise ValueError(f"--per-device {args.per_device} x {args.clients + n_new} devices needs {need} training "
                         f"images, MNIST has {len(y)}")
    perm = rng.permutation(len(y))
    old, new = perm[:args.per_device * args.clients], perm[args.per_device * args.clients:need]
    old_t, new_t = _pool_split(len(ty), share, rng)

    def devices(train_idx, test_idx, n, seed, prefix):
        train = _partition(x[train_idx], y[train_idx], n, args, seed=seed, prefix=prefix, test_fraction=0.0)
        # an independent draw over the test images; device i is in group i mod 4 in both
        test = _partition(tx[test_idx], ty[test_idx], n, args, seed=seed + 10_000, prefix=prefix,
                          test_fraction=0.0)
        return [ClientData(tr.cid, tr.x_train, tr.y_train, te.x_train, te.y_train, tr.group)
                for tr, te in zip(train, test)]

    return devices(old, old_t, args.clients, args.seed, "c"), devices(new, new_t, n_new, args.seed + 1, "new")


# --------------------------------------------------------------------------- training and export


def _ours_class():
    from server_kit.strategies.fedsketch import SketchClustered

    class Ours(SketchClustered):
        """SketchClustered that keeps the sketches it clustered (the checkpoint holds them)."""

        def on_sketches(self, sketches):
            self.sketches_ = dict(sketches)
            return super().on_sketches(sketches)

    return Ours


def make_strategy(args, name: str):
    """``fedsketch`` (ours, as :mod:`paper_mnist` runs it) or ``fedavg``, with the paper's plain FedAvg."""
    from edge_sdk.tasks import TrainSettings
    from edge_sdk.training.nets import BASE_LAYERS
    from server_kit.strategies.fedavg import FedAvg

    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
    common = dict(settings=settings, fraction=args.fraction, seed=args.seed, norm_bound=None, refuse_above=None)
    if name == "fedavg":
        return FedAvg(**common)
    return _ours_class()(min_cluster_size=max(3, args.clients // 10),
                         shared_prefixes=BASE_LAYERS.get(args.arch, ()), **common)


def train(args, clients) -> dict[str, Any]:
    """Ours and FedAvg in the simulator; each training device's final accuracy with its model of ours."""
    from edge_sdk import OnnxEncoder
    from server_kit.drivers.simulate import Simulator

    out: dict[str, Any] = {}
    for name in ("fedsketch", "fedavg"):
        t0 = time.perf_counter()
        strategy = make_strategy(args, name)
        sim = Simulator(strategy, clients, architecture=args.arch, encoder=OnnxEncoder(args.encoder),
                        flip_prob=args.flip_prob, seed=args.seed, progress=args.progress,
                        device=args.device, batched=args.batched, step=args.step)
        res = sim.run(args.rounds)
        final = {c.cid: float(sim.workers[c.cid].evaluate(strategy.models[strategy.model_key_for(c.cid)])["accuracy"])
                 for c in clients}  # every training device, its final model, its own test shard
        out[name] = {"strategy": strategy, "sim": sim, "result": res, "final": final,
                     "seconds": time.perf_counter() - t0}
        log.info("%s trained: %d rounds, accuracy per round %s, ARI %.3f, final mean over the %d devices %.4f "
                 "(%.0f s)", name, args.rounds, [round(a, 4) for a in res.accuracies], res.ari, len(final),
                 np.mean(list(final.values())), out[name]["seconds"])
    return out


def export(args, out: Path, trained: dict[str, Any], clients) -> Any:
    """Ours exported to ``out/models`` with its server state; the :class:`~server_kit.serving.export.ExportedRun`."""
    from server_kit.drivers import ServerConfig
    from server_kit.drivers.checkpoint import write_checkpoint
    from server_kit.drivers.link import new_run_id
    from server_kit.serving.export import export_models
    from server_kit.serving.offers import model_offers
    from server_kit.strategies.base import ClientInfo

    ours = trained["fedsketch"]
    strategy, sim = ours["strategy"], ours["sim"]
    infos = {c.cid: ClientInfo(c.cid, **{k: v for k, v in sim.workers[c.cid].hello().items()
                                         if k in ("n_samples", "classes_present")}) for c in clients}
    per_model: dict[str, list[float]] = {}
    for cid, acc in ours["final"].items():
        per_model.setdefault(strategy.model_key_for(cid), []).append(acc)
    accuracy = {k: (float(np.mean(v)), len(v)) for k, v in per_model.items()}
    offers = model_offers(strategy, rnd=args.rounds, clients=infos, accuracy=accuracy)
    sketches = strategy.sketches_
    config = ServerConfig(federation=FED, rounds=args.rounds, num_classes=10, flip_prob=args.flip_prob,
                          encoder=args.encoder, architecture=args.arch, seed=args.seed)
    run_id = new_run_id()
    history = [{"round": r.round, "accuracy": r.accuracy, "sampled": r.sampled} for r in ours["result"].rounds]

    def write_state(folder: Path) -> None:
        write_checkpoint(folder, args.rounds, strategy, history=history, timings={}, clients=infos,
                         sketches=sketches, config=config, encoder=args.encoder, architecture=args.arch,
                         latent_dim=next(iter(sketches.values())).latent_dim, pretrain_history=[], run_id=run_id)

    exported = export_models(out / "models", strategy, offers, run_id=run_id, architecture=args.arch,
                             rnd=args.rounds, final=True, write_state=write_state)
    log.info("exported %d model(s) of run %s to %s", len(offers), run_id, exported.folder)
    return exported


# --------------------------------------------------------------------------- cold start over a broker


class TimedKeeper(ModelKeeper):
    """A device's model folder that notes when its model was kept (the end of its cold start)."""

    kept_at: float | None = None

    def offer(self, entry, weights, evaluate):
        decision = super().offer(entry, weights, evaluate)
        if decision.current is not None:
            self.kept_at = time.perf_counter()
        return decision


@dataclass
class NewDevice:
    """One new device's client, its thread and its clock."""

    data: Any
    client: Any
    keeper: TimedKeeper
    thread: threading.Thread
    started: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _start_device(url: str, c, i: int, args, out: Path) -> NewDevice:
    from edge_sdk.client import EdgeClient
    from edge_sdk.transport import BrokerConfig, MqttTransport
    from edge_sdk.worker import LocalWorker

    worker = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=args.arch, seed=1000 + i)
    transport = MqttTransport(BrokerConfig.from_url(url, reconnect_min_s=0.1), c.cid, federation=FED)
    keeper = TimedKeeper(out / "devices" / c.cid)
    client = EdgeClient(transport, worker, federation=FED, seed=1000 + i, model_timeout_s=30, keeper=keeper,
                        get_model=True)
    dev = NewDevice(c, client, keeper, threading.Thread(target=client.run, kwargs={"max_idle_s": 60}, daemon=True))
    dev.started = time.perf_counter()
    dev.thread.start()
    return dev


def _broker():
    from server_kit.broker import EmbeddedBroker, MosquittoBroker, find_mosquitto

    if find_mosquitto() is not None:
        return MosquittoBroker(), "mosquitto"
    return EmbeddedBroker(), "amqtt (embedded)"


def cold_start(args, out: Path, new) -> tuple[list[NewDevice], dict[str, str], str, float]:
    """Serve the export over a real broker to the new devices, ``args.batch`` at a time.

    Returns the devices, what the server says it served (device -> model key), the broker's name and the
    seconds the whole serving took.
    """
    from edge_sdk.transport import BrokerConfig, MqttTransport
    from server_kit.drivers import Orchestrator, ServerConfig
    from server_kit.drivers.phase import Phase
    from server_kit.report import progress_bar

    broker, broker_name = _broker()
    devices: list[NewDevice] = []
    done = threading.Event()
    served: dict[str, str] = {}
    with broker:
        server = MqttTransport(BrokerConfig.from_url(broker.url), "server", federation=FED)
        server.connect(timeout=10)
        config = ServerConfig(federation=FED, rounds=args.rounds, num_classes=10, flip_prob=args.flip_prob,
                              encoder=args.encoder, architecture=args.arch, seed=args.seed,
                              checkpoint_dir=str(out / "models" / "server-state"))
        orch = Orchestrator(make_strategy(args, "fedsketch"), server, config)
        serving = threading.Thread(target=lambda: served.update(
            orch.serve(args.serve_timeout, from_export=True, until=done.is_set)), daemon=True)
        t0 = time.perf_counter()
        serving.start()
        while orch.intake.phase is not Phase.SERVE and serving.is_alive():
            time.sleep(0.02)
        if orch.intake.phase is not Phase.SERVE:
            server.close()
            raise RuntimeError("the server did not start serving the export (see the error above)")
        log.info("the server serves %d model(s) over %s at %s; %d new device(s), %d at a time",
                 len(orch.service.offers), broker_name, broker.url, len(new), args.batch)
        bar = progress_bar(len(new), "cold start", args.progress)
        try:
            for first in range(0, len(new), args.batch):
                batch = [_start_device(broker.url, c, first + j, args, out)
                         for j, c in enumerate(new[first:first + args.batch])]
                for dev in batch:
                    dev.thread.join(timeout=args.device_timeout)
                    if bar is not None:
                        bar.update(1)
                devices += batch
        finally:
            done.set()
            serving.join(timeout=30)
            server.close()
            if bar is not None:
                bar.close()
        seconds = time.perf_counter() - t0
    log.info("served %d of %d new device(s) in %.1f s", len(served), len(new), seconds)
    return devices, served, broker_name, seconds


# --------------------------------------------------------------------------- scores


def _accuracy(predict, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(predict(x) == y))


def _group_keys(trained: dict[str, Any], clients) -> dict[int, str]:
    """Each rotation group's model key of ours: the cluster most of its training devices are in."""
    strategy = trained["fedsketch"]["strategy"]
    keys: dict[int, str] = {}
    for g in range(GROUPS):
        members = [strategy.model_key_for(c.cid) for c in clients if c.group == g]
        keys[g] = max(sorted(set(members)), key=members.count)
    return keys


def device_rows(args, out: Path, devices: list[NewDevice], trained: dict[str, Any], clients) -> list[dict]:
    """One row per new device: its group, the model it kept and its accuracy, the others' on its data, costs."""
    from edge_sdk import LocalModel
    from edge_sdk.training.evaluation import evaluate

    group_key = _group_keys(trained, clients)
    keys = sorted(trained["fedsketch"]["strategy"].models)
    exported = {k: LocalModel.load(out / "models" / k) for k in keys}
    fedavg = trained["fedavg"]["strategy"]
    global_w = fedavg.models[fedavg.default_key]
    rows = []
    for dev in devices:
        c, client = dev.data, dev.client
        stats = client.transport.stats()
        kept = dev.keeper.kept()
        row: dict[str, Any] = {
            "cid": c.cid, "group": c.group, "n_train": len(c.y_train), "n_test": len(c.y_test),
            "exit_code": client.exit_code, "key": None if kept is None else kept.key,
            "group_key": group_key[c.group],
            "bytes_up": sum(v["bytes"] for v in stats["sent"].values()),
            "bytes_down": sum(v["bytes"] for v in stats["received"].values()),
            "sent": {k: v["messages"] for k, v in stats["sent"].items()},
            "received": {k: v["messages"] for k, v in stats["received"].items()},
            "ms": None if dev.keeper.kept_at is None else (dev.keeper.kept_at - dev.started) * 1000.0,
        }
        wrong = next((k for k in (group_key[(c.group + s) % GROUPS] for s in range(1, GROUPS))
                     if k != row["key"]), next((k for k in keys if k != row["key"]), None))
        row["wrong_key"] = wrong
        if kept is not None:
            row["acc"] = _accuracy(LocalModel.load(out / "devices" / c.cid).predict, c.x_test, c.y_test)
            row["device_accuracy"] = kept.device_accuracy  # what the keeper measured on the device
        row["global_acc"] = float(evaluate(args.arch, global_w, c.x_test, c.y_test, force_onnx=True).accuracy)
        row["wrong_acc"] = None if wrong is None else _accuracy(exported[wrong].predict, c.x_test, c.y_test)
        rows.append(row)
    return rows


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def group_rows(rows: list[dict], trained: dict[str, Any], clients) -> list[dict]:
    """Per group and overall ("all"): the new devices' figures and the trained devices' of the same clusters."""
    strategy = trained["fedsketch"]["strategy"]
    final = trained["fedsketch"]["final"]
    key_of = {c.cid: strategy.model_key_for(c.cid) for c in clients}

    def trained_acc(keys: set) -> float | None:
        return _mean([final[cid] for cid, k in key_of.items() if k in keys])

    out = []
    for g in [*range(GROUPS), "all"]:
        mine = [r for r in rows if g == "all" or r["group"] == g]
        keys = {r["key"] for r in mine if r["key"] is not None}
        ms = [r["ms"] for r in mine if r["ms"] is not None]
        out.append({
            "group": g, "rotation": None if g == "all" else 90 * g, "devices": len(mine),
            "served": sum(r["key"] is not None for r in mine), "keys": sorted(keys),
            "right_cluster": sum(r["key"] == r["group_key"] for r in mine),
            "cold_start_acc": _mean(r.get("acc") for r in mine), "trained_acc": trained_acc(keys),
            "trained_devices": sum(k in keys for k in key_of.values()),
            "global_acc": _mean(r["global_acc"] for r in mine), "wrong_cluster_acc": _mean(r["wrong_acc"] for r in mine),
            "ms_median": float(np.median(ms)) if ms else None, "ms_max": max(ms) if ms else None,
        })
    return out


# --------------------------------------------------------------------------- report


def _fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def print_table(groups: list[dict], summary: dict[str, Any]) -> None:
    print(f"\n{'group':>6} {'rot':>4} {'new':>4} {'served':>6} {'right':>5} {'model':>6} {'cold start':>10} "
          f"{'trained':>8} {'(n)':>4} {'FedAvg':>7} {'wrong':>7} {'ms med':>7} {'ms max':>7}")
    for g in groups:
        rot = "" if g["rotation"] is None else f"{g['rotation']}"
        print(f"{g['group']!s:>6} {rot:>4} {g['devices']:>4} {g['served']:>6} {g['right_cluster']:>5} "
              f"{','.join(g['keys']) if len(g['keys']) < 3 else str(len(g['keys'])) + ' keys':>6} "
              f"{_fmt(g['cold_start_acc']):>10} {_fmt(g['trained_acc']):>8} {g['trained_devices']:>4} "
              f"{_fmt(g['global_acc']):>7} {_fmt(g['wrong_cluster_acc']):>7} {_fmt(g['ms_median'], '.0f'):>7} "
              f"{_fmt(g['ms_max'], '.0f'):>7}")
    print(f"\nper new device: {summary['cold_start_bytes_up']:.0f} bytes up, {summary['cold_start_bytes_down']:.0f} "
          f"bytes down (one exported weights file: {summary['model_bytes']} bytes; down / model = "
          f"{summary['cold_start_bytes_down'] / summary['model_bytes']:.4f}); ARI of the served clusters against "
          f"the groups {summary['cold_start_ari']:.3f}; {summary['served']} of {summary['new_devices']} kept a model")
    print(f"training ({summary['data']}): {summary['clients']} devices, {summary['rounds']} rounds x "
          f"{summary['epochs']} epochs; ours ARI {summary['train_ari']:.3f}, FedAvg final {summary['fedavg_acc']:.4f}; "
          f"broker {summary['broker']}")


def plot(path: Path, groups: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("cold start (kept model)", "cold_start_acc"), ("trained devices, same cluster", "trained_acc"),
              ("FedAvg global model", "global_acc"), ("wrong cluster's model", "wrong_cluster_acc")]
    labels = [f"{g['rotation']}°" if g["rotation"] is not None else "all" for g in groups]
    x = np.arange(len(groups))
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (name, key) in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, [g[key] or 0.0 for g in groups], width, label=name)
    ax.set_xticks(x, labels)
    ax.set_xlabel("rotation group of the new devices")
    ax.set_ylabel("accuracy (each device on its own test shard)")
    ax.set_ylim(0, 1.0)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(series), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summarize(args, rows, groups, trained, served, exported, seconds: dict[str, float], broker: str) -> dict:
    from sklearn.metrics import adjusted_rand_score

    overall = groups[-1]
    ms = [r["ms"] for r in rows if r["ms"] is not None]
    key0 = sorted(trained["fedsketch"]["strategy"].models)[0]
    placed = [r for r in rows if r["key"] is not None]
    return {
        "cold_start_ari": float(adjusted_rand_score([r["group"] for r in rows], [r["key"] or "-" for r in rows])),
        "cold_start_acc": overall["cold_start_acc"], "trained_acc": overall["trained_acc"],
        "global_acc": overall["global_acc"], "wrong_cluster_acc": overall["wrong_cluster_acc"],
        "cold_start_bytes_up": _mean(r["bytes_up"] for r in placed) or 0.0,
        "cold_start_bytes_down": _mean(r["bytes_down"] for r in placed) or 0.0,
        "model_bytes": (exported.folder / key0 / "weights.safetensors").stat().st_size,
        "cold_start_ms": float(np.median(ms)) if ms else None, "cold_start_ms_max": max(ms) if ms else None,
        "new_devices": len(rows), "served": sum(r["key"] is not None and r["exit_code"] == 0 for r in rows),
        "server_served": len(served), "models": len(trained["fedsketch"]["strategy"].models),
        "train_ari": trained["fedsketch"]["result"].ari,
        "fedavg_acc": _mean(trained["fedavg"]["final"].values()),
        "rounds": args.rounds, "clients": args.clients, "epochs": args.epochs, "new_per_group": args.new_per_group,
        "batch": args.batch, "data": args.dataset, "architecture": args.arch, "encoder": args.encoder,
        "seed": args.seed, "broker": broker, **{f"seconds_{k}": round(v, 1) for k, v in seconds.items()},
    }


def _rounded(d: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def run(args) -> tuple[dict[str, Any], bool]:
    """The whole benchmark; the summary, and whether every new device kept a model."""
    from server_kit.report import write_json

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "devices", ignore_errors=True)  # a model kept by an earlier run would compete
    t0 = time.perf_counter()
    clients, new = build_devices(args)
    log.info("%d training devices, %d new ones (%s; %d per group), images of the two never shared",
             len(clients), len(new), args.dataset, args.new_per_group)
    trained = train(args, clients)
    t1 = time.perf_counter()
    exported = export(args, out, trained, clients)
    devices, served, broker, serve_s = cold_start(args, out, new)
    t2 = time.perf_counter()
    rows = device_rows(args, out, devices, trained, clients)
    groups = group_rows(rows, trained, clients)
    seconds = {"training": t1 - t0, "serving": serve_s, "total": time.perf_counter() - t0}
    summary = summarize(args, rows, groups, trained, served, exported, seconds, broker)
    print_table(groups, summary)
    plot(out / "cold_start.png", groups, f"{args.dataset}: cold start of {len(rows)} new devices from an export of "
         f"{args.clients} devices' training ({args.rounds} rounds x {args.epochs} epochs)")
    write_json(out / "results.json", {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                                      "summary": summary, "groups": groups, "devices": rows,
                                      "trained": {n: trained[n]["final"] for n in trained},
                                      "accuracy_per_round": {n: trained[n]["result"].accuracies for n in trained},
                                      "served_by_server": served})
    log.info("report: %s/results.json, %s/cold_start.png, models in %s, kept models in %s/devices (%.0f s to serve "
             "after %.0f s of training)", out, out, exported.link, out, t2 - t1, t1 - t0)
    ok = summary["served"] == summary["new_devices"] == summary["server_served"]
    return _rounded(summary), ok


#: The settings of the full run (MNIST) and of ``--quick`` (digits); an option given on the command line wins.
FULL = dict(dataset="mnist", clients=40, new_per_group=10, rounds=10, epochs=5, fraction=0.5, alpha=10.0, lr=1e-3,
            batch_size=32, out="reports/cold_start")
QUICK = dict(dataset="digits", clients=12, new_per_group=3, rounds=3, epochs=5, fraction=1.0, alpha=0.0, lr=1e-2,
             batch_size=16, out="reports/cold_start_quick")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_options(ap)
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with the MNIST IDX files")
    ap.add_argument("--clients", type=int, help=f"training devices (default {FULL['clients']})")
    ap.add_argument("--new-per-group", type=int,
                    help=f"new devices per rotation group, 4 groups (default {FULL['new_per_group']})")
    ap.add_argument("--per-device", type=int, default=600,
                    help="MNIST training images per device, new ones too (digits: the images split evenly)")
    ap.add_argument("--rounds", type=int, help=f"default {FULL['rounds']} (the paper: 50)")
    ap.add_argument("--epochs", type=int, help=f"local epochs per round (default {FULL['epochs']}, as the paper)")
    ap.add_argument("--fraction", type=float, help="devices per round, of each cluster (default 0.5)")
    ap.add_argument("--alpha", type=float, help="Dirichlet label skew (0: equal shards; default 10)")
    ap.add_argument("--lr", type=float, help="default 1e-3")
    ap.add_argument("--batch-size", type=int, help="default 32")
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=4, help="new devices started at once (each batch waits for the last)")
    ap.add_argument("--device-timeout", type=float, default=60.0, help="seconds a new device may take")
    ap.add_argument("--serve-timeout", type=float, default=1800.0, help="seconds the server serves at most")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--out", help=f"default {FULL['out']} ({QUICK['out']} with --quick)")
    ap.add_argument("--quick", action="store_true",
                    help="digits, 12 training devices, 3 new per group, 3 rounds x 5 epochs: the smoke test")
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for name in ("clients", "new_per_group", "per_device", "rounds", "epochs", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.arch = "digits_cnn_1x8x8_10" if args.dataset == "digits" else "lenet5_1x28x28_10"
    args.encoder = "digits_encoder" if args.dataset == "digits" else "fmnist_fc_encoder"
    if args.dataset == "mnist" and not Path(args.data).is_dir():
        print(f"MNIST not found in {args.data}: pass --data DIR, or --quick for the digits version", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    log.setLevel(logging.INFO)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    summary, ok = run(args)
    if not ok:
        print(f"cold start incomplete: {summary['served']} of {summary['new_devices']} new devices kept a model "
              f"(the server served {summary['server_served']})", file=sys.stderr)
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
