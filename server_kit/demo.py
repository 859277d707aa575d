"""The main job (``make demo``): a whole federation on this machine.

Starts an MQTT broker on a free port (Mosquitto when it is on PATH, else the
embedded amqtt broker), the server in this process, and one client process
per client on scikit-learn's digits split into four rotation groups (0, 90,
180, 270 degrees; client ``i`` in group ``i mod 4``). The clients sketch
their data with the shipped digits autoencoder through ONNX Runtime (P =
0.1), the server clusters the sketches once, then runs FedAvg per cluster for
the given rounds. Plain FedAvg on the same clients, seeds and settings runs
in the in-process simulator as the baseline.

Prints progress, the adjusted Rand index of the clustering, the accuracy per
round of both, and writes a report folder (``results.json``, ``accuracy.png``,
``threshold_search.png``, ``bytes.png``). The last line of output is JSON with
``ari``, ``clustered_acc``, ``fedavg_acc``, ``seconds``, ``sketch_bytes``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from edge_sdk.compress import Compression
from edge_sdk.compress.update_codec import check_compression_pair

from .cli_options import COMPRESS_FORMS, DEFAULT_COMPRESS_DOWN, DEFAULT_COMPRESS_UP, device_name

if TYPE_CHECKING:
    from edge_sdk.tasks import TrainSettings

    from .drivers.result import RunResult
    from .strategies.fedsketch import SketchClustered

log = logging.getLogger("fedsketch.demo")

ARCH = "digits_cnn_1x8x8_10"


def _spawn_clients(url: str, federation: str, paths: list[tuple[str, Path]], seed: int, log_dir: Path,
                   extra: list[str] | None = None, model_root: Path | None = None) -> list[subprocess.Popen]:
    """One device process per (id, data file); with ``model_root``, each keeps its model in ``model_root/ID``."""
    procs = []
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    for i, (cid, path) in enumerate(paths):
        keep = [] if model_root is None else ["--model-dir", str(model_root / cid)]
        cmd = [sys.executable, "-m", "edge_sdk.client.cli", "--broker", url, "--federation", federation,
               "--client-id", cid, "--data", str(path), "--architecture", ARCH, "--seed", str(seed * 1000 + i),
               "--max-idle", "300", *keep, *(extra or [])]
        out = open(log_dir / f"{cid}.log", "w")
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
    return procs


def run_demo(args: argparse.Namespace) -> dict:
    """Run the federation over MQTT and the FedAvg baseline; print both, write the report, return the summary."""
    from sklearn.metrics import adjusted_rand_score

    from edge_sdk.tasks import TrainSettings

    from .data.partition import load_digits_images, rotation_partition
    from .report import accuracy_per_round

    t0 = time.perf_counter()
    images, labels = load_digits_images()
    clients = rotation_partition(images, labels, args.clients, groups=args.groups, seed=args.seed)
    truth = {c.cid: c.group for c in clients}
    settings = TrainSettings(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size)
    report = Path(args.report_dir)
    report.mkdir(parents=True, exist_ok=True)

    result, strategy = _run_over_mqtt(args, clients, settings, report)
    assignment = result.assignment
    cids = sorted(truth)
    ari = float(adjusted_rand_score([truth[c] for c in cids], [assignment.get(c, -1) for c in cids]))
    # accuracy after round r = what round r+1's clients measured before training; the last from the final evaluation
    clustered = accuracy_per_round(result.to_dict())
    fedavg = _run_baseline(args, clients, settings)
    seconds = time.perf_counter() - t0

    sketch_bytes = result.transport["received"].get("SKETCH", {}).get("bytes", 0) // max(1, len(cids))
    _print_results(args, result, truth, ari, clustered, fedavg)
    summary = {
        "ari": round(ari, 4),
        "clustered_acc": round(float(clustered[-1]), 4),
        "fedavg_acc": round(float(fedavg[-1]), 4),
        "seconds": round(seconds, 1),
        "sketch_bytes": int(sketch_bytes),
        "compress_up": args.compress_up,
        "compress_down": args.compress_down,
        "update_bytes": int(result.transport["received"].get("UPDATE", {}).get("bytes", 0)),
        "model_bytes": int(result.delivered.get("MODEL", 0)),
    }
    _write_report(report, args, result, strategy, truth, clustered, fedavg, summary)
    return summary


def _run_over_mqtt(args: argparse.Namespace, clients: list, settings: TrainSettings,
                   report: Path) -> tuple[dict, SketchClustered]:
    """The clustered federation: a broker, one signed client process per client, the server in this process.

    Returns the orchestrator's result and the fitted :class:`SketchClustered`.
    """
    from edge_sdk.protocol import SERVER_ID
    from edge_sdk.transport import BrokerConfig, MqttTransport

    from .broker import start_broker
    from .data.partition import save_client
    from .drivers import Orchestrator, ServerConfig
    from .strategies.fedsketch import SketchClustered

    federation = "demo"
    with tempfile.TemporaryDirectory(prefix="fedsketch-demo-") as tmp, contextlib.ExitStack() as stack:
        tmpdir = Path(tmp)
        paths = []
        for c in clients:
            p = tmpdir / f"{c.cid}.npz"
            save_client(p, c)
            paths.append((c.cid, p))
        broker = stack.enter_context(start_broker(prefer=args.broker))
        url = broker.url
        print(f"broker: {type(broker).__name__} at {url}")
        log_dir = report / "client-logs"
        log_dir.mkdir(exist_ok=True)
        # the server signs what it sends; each device obeys only that key (enrolment, in small)
        from edge_sdk.signing import load_signer, write_keypair

        write_keypair(tmpdir / "server.key", tmpdir / "server.pub")
        procs = _spawn_clients(url, federation, paths, args.seed, log_dir,
                               ["--server-key", str(tmpdir / "server.pub")], model_root=report / "devices")
        stack.callback(_reap, procs)
        print(f"started {len(procs)} client processes (logs in {log_dir})")

        strategy = SketchClustered(settings=settings, fraction=1.0, seed=args.seed,
                                   min_cluster_size=args.min_cluster_size, compress_up=args.compress_up,
                                   compress_down=args.compress_down)
        transport = MqttTransport(BrokerConfig.from_url(url), SERVER_ID, federation=federation)
        transport.sign_with(load_signer(tmpdir / "server.key"))
        transport.connect()
        stack.callback(transport.close)
        config = ServerConfig(federation=federation, rounds=args.rounds, min_clients=args.clients,
                              register_timeout_s=120, sketch_timeout_s=60, round_timeout_s=120,
                              flip_prob=args.flip_prob, encoder="digits_encoder", architecture=ARCH,
                              seed=args.seed, checkpoint_dir=str(report / "checkpoint"))
        bar = _bar(args.rounds, "clustered FL over MQTT")
        orch = Orchestrator(strategy, transport, config,
                            on_round=lambda rec: _tick(bar, rec))
        result = orch.run()
        _close(bar)
        orch.export_models(report / "models")
        sample = report / "devices" / f"{paths[0][0]}.npz"  # one device's data, for `fedsketch predict`
        sample.parent.mkdir(exist_ok=True)
        shutil.copyfile(paths[0][1], sample)
    return result, strategy


def _run_baseline(args: argparse.Namespace, clients: list, settings: TrainSettings) -> list[float]:
    """Plain FedAvg on the same clients, seeds and settings, in the in-process simulator; its accuracies."""
    from .drivers.simulate import Simulator
    from .strategies.fedavg import FedAvg

    print("\nbaseline: plain FedAvg on the same clients (in-process simulator, same client code)")
    sim = Simulator(FedAvg(settings=settings, fraction=1.0, seed=args.seed), clients, architecture=ARCH,
                    seed=args.seed, progress=True, device=args.device)
    fed = sim.run(args.rounds)
    return fed.accuracies


def _print_results(args: argparse.Namespace, result: RunResult, truth: dict, ari: float, clustered: list,
                   fedavg: list) -> None:
    """Print the clusters found, the accuracy per round of both runs and the bytes at the server."""
    assignment = result.assignment
    cids = sorted(truth)
    per_cluster = result.final.get("per_model", {})
    delivered = result.delivered.get("MODEL", 0)
    print(f"\nclusters found: {len(set(assignment.values()))} for {args.groups} rotation groups; ARI {ari:.3f}")
    for k in sorted(set(assignment.values())):
        members = [c for c in cids if assignment[c] == k]
        acc = per_cluster.get(f"c{k}")
        print(f"  cluster {k}: {len(members)} clients, rotations {sorted({90 * truth[c] for c in members})}"
              + ("" if acc is None else f", final accuracy {acc:.4f}"))
    print("\nround  clustered  fedavg")
    for r, (a, b) in enumerate(zip(clustered, fedavg), start=1):
        print(f"{r:5d}  {a:9.4f}  {b:6.4f}")
    stats = result.transport
    print("\nbytes at the server per message kind (sent / received):")
    for kind in sorted(set(stats["sent"]) | set(stats["received"])):
        s, r = stats["sent"].get(kind, {}), stats["received"].get(kind, {})
        print(f"  {kind:8s} {s.get('bytes', 0):>10,} / {r.get('bytes', 0):>10,}  "
              f"({s.get('messages', 0)} / {r.get('messages', 0)} messages)")
    print(f"  models the devices downloaded: {delivered:,} bytes (each only its own cluster's)")
    _print_saved(args, result)


def _print_saved(args: argparse.Namespace, result: RunResult) -> None:
    """What the compression saved: the bytes of updates and models against whole float32 models."""
    from edge_sdk.protocol import Kind
    from edge_sdk.training.trainer import initial_weights

    from .metrics import weights_message_bytes

    template = initial_weights(ARCH, args.seed)
    ups = result.transport["received"].get("UPDATE", {})
    downloads = sum(h["tasked"] for h in result.history) + int(result.final.get("asked", 0))
    whole_up = weights_message_bytes(Kind.UPDATE, template, {"round": 1, "model_key": "c0", "n_samples": 100,
                                                             "loss": 0.0, "metrics": {}}) * ups.get("messages", 0)
    whole_down = weights_message_bytes(Kind.MODEL, template, {"key": "c0"}) * downloads
    got_up, got_down = ups.get("bytes", 0), result.delivered.get("MODEL", 0)
    print(f"\ncompression up {args.compress_up}, down {args.compress_down}: updates {got_up:,} bytes and models {got_down:,} bytes, against "
          f"{whole_up:,} and {whole_down:,} as whole float32 models")
    if got_up and got_down:
        print(f"  {whole_up / got_up:.1f}x fewer bytes up, {whole_down / got_down:.1f}x fewer down; "
              f"{whole_up + whole_down - got_up - got_down:,} bytes saved")


def _write_report(report: Path, args: argparse.Namespace, result: RunResult, strategy: SketchClustered,
                  truth: dict, clustered: list, fedavg: list, summary: dict) -> None:
    """The report folder: results.json, accuracy.png, threshold_search.png and bytes.png."""
    from .report import plot_accuracy, plot_bytes, plot_threshold_search, write_json

    stats = result.transport
    plot_accuracy(report / "accuracy.png", {"clustered (ours, over MQTT)": clustered, "FedAvg": fedavg})
    plot_bytes(report / "bytes.png", stats)
    plot_threshold_search(strategy, report / "threshold_search.png")
    write_json(report / "results.json", {
        **summary, "clients": args.clients, "rounds": args.rounds, "groups": args.groups,
        "flip_prob": args.flip_prob, "assignment": result.assignment, "truth": truth,
        "clustered_accuracy": clustered, "fedavg_accuracy": fedavg,
        "per_cluster": result.final.get("per_model", {}),
        "history": result.history, "final": result.final, "timings": result.timings,
        "transport": stats, "rejected": result.rejected,
        "threshold": getattr(strategy.model_, "threshold_", None) if strategy.model_ is not None else None,
    })
    print(f"\nreport written to {report}/ (results.json, accuracy.png, threshold_search.png, bytes.png)")
    _print_kept(report, result)


def _print_kept(report: Path, result: RunResult) -> None:
    """Which devices keep their cluster's model, bit for bit the export's (the sha256 of the weights)."""
    from edge_sdk.models.model_folder import ModelFolderError, read_model_folder

    from .serving.export import read_models_json

    try:
        exported = {m["key"]: m["files"][f"{m['key']}/weights.safetensors"]
                    for m in read_models_json(report / "models")["models"]}
    except ValueError as e:
        print(f"models not exported: {e}")
        return
    same = 0
    for cid, k in sorted(result.assignment.items()):
        try:
            entry, _ = read_model_folder((report / "devices" / cid / "current").resolve())
        except ModelFolderError:
            continue
        same += entry.key == f"c{k}" and entry.files["weights.safetensors"] == exported.get(entry.key)
    first = sorted(result.assignment)[0]
    print(f"models: {len(exported)} exported to {report}/models/ (ONNX, safetensors, models.json); "
          f"{same} of {len(result.assignment)} devices keep their cluster's model, the same bytes as the export")
    print(f"  try: fedsketch predict --model {report}/devices/{first} --data {report}/devices/{first}.npz")


def _reap(procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def _bar(total: int, desc: str):
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc)
    except ImportError:  # pragma: no cover
        return None


def _tick(bar, rec: dict) -> None:
    if bar is not None:
        acc = rec.get("acc_before")
        bar.set_postfix(updates=f"{rec['updates']}/{rec['tasked']}", acc_prev="-" if acc is None else f"{acc:.3f}")
        bar.update(1)


def _close(bar) -> None:
    if bar is not None:
        bar.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--flip-prob", type=float, default=0.1)
    ap.add_argument("--min-cluster-size", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", type=device_name, default="auto",
                    help="auto, cpu or cuda: where the in-process baseline trains (auto: CUDA when torch sees it)")
    ap.add_argument("--compress", default=None, help=f"how updates and models travel: {COMPRESS_FORMS}")
    ap.add_argument("--compress-up", default=None, help=f"how updates come up (default: {DEFAULT_COMPRESS_UP})")
    ap.add_argument("--compress-down", default=None, help=f"how models go down (default: {DEFAULT_COMPRESS_DOWN})")
    ap.add_argument("--broker", default="auto", choices=["auto", "mosquitto", "amqtt"])
    ap.add_argument("--report-dir", default="reports/demo")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    args.compress_up = args.compress_up or args.compress or DEFAULT_COMPRESS_UP
    args.compress_down = args.compress_down or args.compress or DEFAULT_COMPRESS_DOWN
    try:  # a pair the strategy would refuse, refused before any process starts
        check_compression_pair(Compression.parse(args.compress_up), Compression.parse(args.compress_down), "the demo")
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_demo(args)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
