"""The ``fedsketch-client`` command: a device's options, its data, its transport, one :class:`EdgeClient` served.

Exit codes: 0 when the server finishes (in service mode, ``--serve``: on
SIGTERM or the server's signed leave), 2 for bad arguments or data, 3 when
the broker cannot be reached, 4 when the server refuses the device, 5 when
the server could not finish the run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..logs import add_log_format_argument, configure_logging, log_context
from ..models.keeping import DEFAULT_MARGIN, KeepPolicy, ModelKeeper
from ..protocol import Kind, Message, Topics
from ..transport import BrokerConfig
from ..worker import LocalWorker
from .edge_client import EdgeClient

__all__ = ["build_parser", "main", "private_tmp"]

# the device's log keeps its one name: these lines were the client's and still are
log = logging.getLogger("edge_sdk.client")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedsketch-client", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="A FedSketch edge client over MQTT. It learns the model, encoder, classes and training "
                    "settings from the server; exits 0 when the server finishes (with --serve: on SIGTERM or the "
                    "server's leave), 4 when it refuses this device, 5 when the server could not finish the run "
                    "(the reason is logged), 3 when the broker cannot be reached, 2 for bad arguments or data.")
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", metavar="URL[,URL...]",
                   help="mqtt://host:port or mqtts://host:port; a comma-separated list (a cluster's nodes, this "
                        "device's own first) is failed over in turn: each lost connection moves to the next")
    p.add_argument("--federation", default="default", help="the federation's id (the server's --federation)")
    p.add_argument("--root", default="fedsketch", help="topic root")
    p.add_argument("--client-id", required=True, help="this device's id (its broker user name)")
    p.add_argument("--data", required=True, help=".npz with x, y (and x_test, y_test); read without pickle")
    p.add_argument("--architecture", default=None,
                   help="classifier architecture; default: the one the server says (recommended)")
    p.add_argument("--num-classes", type=int, default=None, help="default: the number the server says")
    p.add_argument("--seed", type=int, default=None, help="sketch and training seed (default: OS)")
    BrokerConfig.add_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads for local training")
    p.add_argument("--bench", default=None, metavar="FILE",
                   help="send the figures of this device's own benchmark (fedsketch bench --json FILE) with its "
                        "hello: the server's report lists each device's speed")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="a folder kept across restarts: what the device has not sent yet of its compressed "
                        "updates (its error feedback) is saved there")
    p.add_argument("--model-dir", default=None, metavar="DIR",
                   help="keep the model of each run here (DIR/current, DIR/previous; read by `fedsketch predict` "
                        "and edge_sdk.LocalModel); default: STATE_DIR/model with --state-dir; with --serve, "
                        "$STATE_DIRECTORY/model under systemd, else ~/.local/state/fedsketch/CLIENT_ID/model; "
                        "otherwise not kept")
    p.add_argument("--keep-model", choices=[p_.value for p_ in KeepPolicy], default=KeepPolicy.BEST.value,
                   help="best: a run's model replaces the kept one unless it is worse on this device's own test "
                        "split (x_test, y_test) by more than --keep-margin; latest: always")
    p.add_argument("--keep-margin", type=float, default=DEFAULT_MARGIN, metavar="ACC",
                   help="with --keep-model best: how much lower an accuracy (in [0, 1]) still replaces the kept model")
    p.add_argument("--get-model", action="store_true",
                   help="cold start: say hello, get this device's model from a server that serves its trained models "
                        "(fedsketch-server --serve-models), keep it in --model-dir and exit 0 (6: no model kept)")
    p.add_argument("--max-idle", type=float, default=None, help="leave after this many idle seconds")
    p.add_argument("--hello-jitter", type=float, default=3.0, metavar="S",
                   help="say hello after a random wait of up to S seconds after every (re)connection, so that a "
                        "fleet booting at once (or back after a broker restart) does not reach the broker in one "
                        "instant; 0: at once")
    p.add_argument("--serve", "--stay", dest="stay", action="store_true",
                   help="service mode (the systemd unit's): serve run after run. The device joins each run the "
                        "server announces, stays through its stop, a failed run or a refusal, waits while the "
                        "server is away, and leaves only on SIGTERM or a leave the server sends")
    p.add_argument("--server-key", default=None, metavar="PEM",
                   help="the server's Ed25519 public key (given at enrolment): obey only messages it signed")
    p.add_argument("--max-sketch-epsilon", type=float, default=None, metavar="EPS",
                   help="the most this device's sketches may give away, local DP epsilon per device (user level, "
                        "all its sketches added up); a sketch past it is not sent and the server is told. "
                        "Each sketch's epsilon is logged: 10 classes x 20 bits at P = 0.1 are 439 per device, "
                        "43.9 per image (default: no limit)")
    p.add_argument("--fedcref", action="store_true",
                   help="take part in a FedCRef federation (fedsketch-server --strategy fedcref): unlabelled data, "
                        "only x is read from --data")
    p.add_argument("--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="with --fedcref: a FedCRefClient parameter, the value in TOML syntax (repeatable), "
                        "for example --set n_clusters=3 --set epochs=10")
    p.add_argument("--labels-out", default=None,
                   help="with --fedcref: write the final local cluster of each sample here (.npz, 'labels')")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: debug logs")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    add_log_format_argument(p)
    return p


@contextlib.contextmanager
def private_tmp(cid: str) -> Iterator[Path]:
    """A temporary-files folder of this device process's own, removed when it ends.

    What the libraries write there (ONNX Runtime's session file, torch's
    kernel cache) and the encoders received go with the process, instead of
    piling up in ``/tmp`` over months of runs and restarts.
    """
    folder = Path(tempfile.mkdtemp(prefix=f"fedsketch-{re.sub(r'[^A-Za-z0-9_.-]', '_', cid)[:64]}-"))
    before = (os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        if before[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[0]
        tempfile.tempdir = before[1]
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with private_tmp(args.client_id):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    level = logging.WARNING if args.quiet else logging.INFO - 10 * min(args.verbose, 1)
    configure_logging(args.log_format, level=level, component="device",
                      text_format=f"%(asctime)s {args.client_id} %(levelname)s %(name)s: %(message)s")
    log_context.set(device=args.client_id)
    # paho's own lines ("Client is not connected" while it reconnects) repeat what the transport says
    logging.getLogger("edge_sdk.transport.paho").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    if args.fedcref:
        return _run_fedcref(args)
    if args.params or args.labels_out:
        print("fedsketch-client: error: --set and --labels-out go with --fedcref", file=sys.stderr)
        return 2
    try:
        with np.load(args.data, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
            x_test = f["x_test"] if "x_test" in f.files else None
            y_test = f["y_test"] if "y_test" in f.files else None
        bench = _bench_fields(args)
        cfg = _broker_config(args)
        worker = LocalWorker(args.client_id, x, y, x_test, y_test, architecture=args.architecture,
                             num_classes=args.num_classes or 10, seed=args.seed)
        transport = _transport(args, cfg)
    except (OSError, KeyError, ValueError) as e:
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        pass
    else:
        from ..cpu import torch_threads

        threads = torch_threads(args.threads or None)  # 1 on a CPU without LSE atomics (Pi 4)
        if threads:
            torch.set_num_threads(threads)
    if args.max_sketch_epsilon is not None and not args.max_sketch_epsilon >= 0:
        print(f"fedsketch-client: error: --max-sketch-epsilon must be >= 0, got {args.max_sketch_epsilon:g}",
              file=sys.stderr)
        return 2
    if not args.hello_jitter >= 0:
        print(f"fedsketch-client: error: --hello-jitter must be >= 0 seconds, got {args.hello_jitter:g}",
              file=sys.stderr)
        return 2
    try:
        keeper = _keeper(args)
    except ValueError as e:
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    client = EdgeClient(transport, worker, federation=args.federation, root=args.root, seed=args.seed,
                        stay=args.stay, hello_jitter_s=args.hello_jitter, bench=bench, state_dir=args.state_dir,
                        keeper=keeper, get_model=args.get_model, max_sketch_epsilon=args.max_sketch_epsilon)
    _stop_on_sigterm(client.stop)
    rc = _serve(args, lambda: client.run(max_idle_s=args.max_idle))
    return client.exit_code if rc == 0 else rc


def default_model_dir(args: argparse.Namespace) -> str | None:
    """Where a device keeps its models without ``--model-dir``: ``STATE_DIR/model`` with ``--state-dir``; in
    service mode, ``$STATE_DIRECTORY/model`` under systemd (the unit's ``StateDirectory``), else
    ``~/.local/state/fedsketch/CLIENT_ID/model``; otherwise nowhere (None)."""
    if args.state_dir:
        return str(Path(args.state_dir) / "model")
    if not args.stay:
        return None
    systemd = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    if systemd:
        return str(Path(systemd) / "model")
    home = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return str(home / "fedsketch" / re.sub(r"[^A-Za-z0-9_.-]", "_", args.client_id)[:64] / "model")


def _keeper(args: argparse.Namespace) -> ModelKeeper | None:
    """The device's model folder (``--model-dir`` or :func:`default_model_dir`); None (said once) without one."""
    folder = args.model_dir or default_model_dir(args)
    if folder is None:
        if args.get_model:
            raise ValueError("--get-model needs --model-dir (or --state-dir): the folder the model is kept in")
        log.info("no --model-dir: the models of the runs are not kept on this device")
        return None
    keeper = ModelKeeper(folder, args.keep_model, args.keep_margin)
    kept = keeper.kept()
    log.info("model folder %s (keep policy %s, margin %g): %s", folder, keeper.policy.value, keeper.margin,
             f"keeps model {kept.key} of run {kept.run}" if kept else "no model kept yet")
    return keeper


def _bench_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``--bench FILE``: the hello fields of that ``fedsketch bench --json`` file (ValueError, OSError if unfit)."""
    if not args.bench:
        return {}
    from ..bench.summary import hello_fields, load_bench_summary

    return hello_fields(load_bench_summary(args.bench, architecture=args.architecture))


def _broker_config(args: argparse.Namespace) -> Any:
    return BrokerConfig.from_args(args, args.broker)


def _transport(args: argparse.Namespace, cfg: Any) -> Any:
    """The device's MQTT transport, with an "offline" last will on its status topic."""
    from ..protocol import encode_message
    from ..transport import MqttTransport

    topics = Topics(args.root, args.federation)
    offline = Message(Kind.STATUS, args.federation, args.client_id, 0, {"state": "offline"})
    transport = MqttTransport(cfg, args.client_id, federation=args.federation, root=args.root,
                              will_topic=topics.status(args.client_id), will_payload=encode_message(offline))
    if args.server_key:
        from ..signing import load_verifier

        transport.verify_with(load_verifier(args.server_key))
    else:
        log.warning("no --server-key: this device obeys any message whose sender says 'server'; "
                    "only the broker's ACL protects it")
    return transport


def _stop_on_sigterm(stop: Any) -> None:
    """SIGTERM (systemd's stop) ends the device's loop cleanly: it disconnects and removes its files, exit 0."""
    def on_term(signum: int, frame: Any) -> None:
        log.info("SIGTERM: leaving")
        stop()

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread (a test calling main): the caller's own handling stays
        pass


def _serve(args: argparse.Namespace, run: Any) -> int:
    try:
        run()
    except ConnectionError as e:
        print(f"fedsketch-client: cannot connect to {args.broker}: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


def _run_fedcref(args: argparse.Namespace) -> int:
    """``--fedcref``: this device in a FedCRef federation (unlabelled ``x`` from ``--data``)."""
    from ..cli import parse_params
    from ..fedcref import FedCRefClient
    from ..fedcref.mqtt import FedCRefEdge

    try:
        with np.load(args.data, allow_pickle=False) as f:
            x = f["x"]
        params = parse_params(args.params)
        if str(params.get("encoder", "")).lower() == "none":  # TOML has no null: K-means or Ward on the pixels
            params["encoder"] = None
        from ..cpu import torch_threads

        params["threads"] = torch_threads(params.get("threads", args.threads or None))  # 1 on a Pi 4
        if args.seed is not None:
            params.setdefault("seed", args.seed)
        fc = FedCRefClient(args.client_id, x, **params)
        cfg = _broker_config(args)
        edge = FedCRefEdge(fc, _transport(args, cfg))
    except (OSError, KeyError, ValueError, TypeError, ImportError) as e:
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    try:
        rc = _serve(args, lambda: edge.run(max_idle_s=args.max_idle))
    except (KeyError, ValueError, FileNotFoundError) as e:  # e.g. an unknown encoder, met at initialisation
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    if rc == 0 and args.labels_out:
        np.savez(args.labels_out, labels=np.asarray(fc.labels_, dtype=np.int64))
        log.warning("final local clusters of %d samples written to %s", len(fc.labels_), args.labels_out)
    return rc


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
