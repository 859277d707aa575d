"""``fedsketch-server``: run a federation's server over MQTT.

Settings come from command-line options or a TOML file (``--config run.toml``)
whose keys are those of :class:`server_kit.orchestrator.ServerConfig` plus a
``[strategy]`` table; unknown keys are refused.

    fedsketch-server --broker mqtt://127.0.0.1:1883 --federation lab --strategy fedsketch \\
        --min-clients 20 --rounds 10 --checkpoint-dir ckpt/ --report-dir reports/lab
    fedsketch-server ... --resume          # continue a killed server from its last round
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "load_config", "main", "parse_params"]

from edge_sdk.cli import parse_params

log = logging.getLogger(__name__)


def load_config(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a TOML run config: (server settings, strategy settings), validated."""
    try:
        import tomllib  # Python 3.11+
    except ImportError:  # pragma: no cover
        import tomli as tomllib  # type: ignore[no-redef]
    from .orchestrator import ServerConfig

    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"cannot read config {path}: {e}") from e
    strategy = raw.pop("strategy", {})
    if not isinstance(strategy, dict):
        raise ValueError("config: [strategy] must be a table")
    known = {f.name for f in dataclasses.fields(ServerConfig)} | {"broker", "report_dir"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"config {path}: unknown keys {unknown}; known keys: {sorted(known)}")
    return raw, strategy


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedsketch-server", description=__doc__.splitlines()[0])
    p.add_argument("--config", help="TOML run config (options given here override it)")
    p.add_argument("--broker", default=None, help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--federation", default=None)
    p.add_argument("--strategy", default=None,
                   help="fedsketch (ours), fedsketch-fedae (ours with federated AE pre-training), fedavg, ifca, "
                        "ladd, ocfl, cfl, briggs, kmeans-weights, flis-hc, flis-dc, or fedcref (unlabelled "
                        "clients: fedsketch-client --fedcref; --set theta=0.2 --set community_rounds=15 ...)")
    p.add_argument("--k", type=int, default=None, help="number of clusters for ifca, ladd and kmeans-weights")
    p.add_argument("--aggregator", choices=["fedavg", "trimmed-mean", "median"], default=None,
                   help="how each model's updates are combined: weighted FedAvg (default), or the unweighted "
                        "coordinate-wise trimmed mean or median (robust to a few hostile devices; they hold a "
                        "cluster's updates in memory)")
    p.add_argument("--norm-bound", type=float, default=None, metavar="X",
                   help="clip every update whose change exceeds X times the round's median update norm, refuse "
                        "non-finite ones (default 2; 0 = off, with --refuse-above)")
    p.add_argument("--refuse-above", type=float, default=None, metavar="R",
                   help="with --norm-bound on, refuse every update whose change exceeds R times the round's "
                        "median update norm (default 20; 0 = clip it instead)")
    p.add_argument("--trim-fraction", type=float, default=None, metavar="B",
                   help="fraction cut at each end of every coordinate by --aggregator trimmed-mean, in (0, 0.5) "
                        "(default 0.1)")
    p.add_argument("--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy parameter, the value in TOML syntax (repeatable): --set algorithm=hdbscan "
                        "--set eps1=0.4")
    p.add_argument("--rounds", type=int)
    p.add_argument("--min-clients", type=int)
    p.add_argument("--flip-prob", type=float)
    p.add_argument("--num-classes", type=int)
    p.add_argument("--encoder")
    p.add_argument("--architecture")
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--fraction", type=float, default=None, help="fraction of each cluster sampled per round")
    p.add_argument("--min-cluster-size", type=int, default=None)
    p.add_argument("--ae-rounds", type=int, default=None,
                   help="federated AE pre-training rounds (fedsketch-fedae; default 3)")
    p.add_argument("--ae-epochs", type=int, default=None,
                   help="local epochs per AE pre-training round (fedsketch-fedae; default 2)")
    p.add_argument("--shared-base", action="store_true",
                   help="average the architecture's base layers (its convolutions) over all clients, "
                        "the rest per cluster (the paper's LeNet-5 setting)")
    p.add_argument("--round-timeout", type=float, dest="round_timeout_s")
    p.add_argument("--sketch-timeout", type=float, dest="sketch_timeout_s")
    p.add_argument("--register-timeout", type=float, dest="register_timeout_s")
    p.add_argument("--round-quorum", type=float)
    p.add_argument("--model-delivery", choices=["auto", "client", "cluster"], default=None,
                   help="models per client on its own topic (each device downloads only its models), once per "
                        "cluster topic (every device downloads all), or auto (default: broadcast only when every "
                        "client needs every model)")
    p.add_argument("--seed", type=int)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint's last round")
    p.add_argument("--report-dir", default=None, help="write results.json and plots here")
    p.add_argument("--username")
    p.add_argument("--password-file")
    p.add_argument("--ca-certs")
    p.add_argument("--protocol", default="3.1.1", choices=["3.1.1", "5"])
    p.add_argument("--max-payload", type=int, default=1_000_000)
    p.add_argument("--signing-key", default=None, metavar="PEM",
                   help="sign everything sent to devices with this Ed25519 private key (fedsketch keygen, "
                        "deploy/make_passwords.sh); devices given its public half (--server-key) obey nothing else")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _broker_config(args: argparse.Namespace, broker: str) -> Any:
    from edge_sdk.transport import BrokerConfig

    password = Path(args.password_file).read_text().strip() if args.password_file else None
    return BrokerConfig.from_url(broker, username=args.username, password=password, ca_certs=args.ca_certs,
                                 protocol=args.protocol, max_payload=args.max_payload)


def _with_broker(args: argparse.Namespace, config: Any, bcfg: Any, run: Any, *errors: type[BaseException]) -> Any:
    """Connect as the server, ``run(transport)``, close; None (said on stderr) if it could not finish."""
    from edge_sdk.transport import MqttTransport

    transport = MqttTransport(bcfg, args.username or "server", federation=config.federation, root=config.root)
    if args.signing_key:
        from edge_sdk.signing import load_signer

        transport.sign_with(load_signer(args.signing_key))
    else:
        log.warning("no --signing-key: devices cannot tell this server's commands from forged ones; "
                    "only the broker's ACL protects them")
    try:
        transport.connect()
        return run(transport)
    except (ConnectionError, TimeoutError, *errors) as e:
        print(f"fedsketch-server: {e}", file=sys.stderr)
        return None
    finally:
        transport.close()


def _run_fedcref(args: argparse.Namespace, config: Any, broker: str, params: dict[str, Any],
                 report_dir: str | None) -> int:
    """``--strategy fedcref``: a FedCRef federation of ``fedsketch-client --fedcref`` devices.

    Registration waits ``register_timeout_s`` for ``min_clients``; each phase
    waits ``round_timeout_s`` for the devices' answers. With ``--report-dir``:
    ``results.json`` and the community autoencoders in ONNX
    (``communities/``, read by :class:`edge_sdk.fedcref.OnnxCommunityLabeler`).
    """
    import dataclasses as dc

    from .fedcref import FedCRefServer, export_communities
    from .fedcref_mqtt import FedCRefCoordinator

    if args.resume or config.checkpoint_dir:
        print("fedsketch-server: error: fedcref has no checkpoint or resume", file=sys.stderr)
        return 2
    try:
        server = FedCRefServer(**params)
        bcfg = _broker_config(args, broker)
    except (ValueError, TypeError, OSError) as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2
    result = _with_broker(args, config, bcfg, lambda t: FedCRefCoordinator(
        server, t, min_clients=config.min_clients, timeout_s=config.round_timeout_s,
        register_timeout_s=config.register_timeout_s).run(), RuntimeError)
    if result is None:
        return 3
    summary = {"strategy": "fedcref", "communities": len(result.communities), "iterations": result.iterations,
               "stopped": result.stopped, "clients": len(result.clients), "gone": len(result.gone)}
    if report_dir:
        from .report import write_json

        out = Path(report_dir)
        write_json(out / "results.json", dc.asdict(result))
        if server.community_models_:
            files = export_communities(server.community_models_, str(server._architecture), out / "communities",
                                       members=dict(enumerate(result.communities)))
            summary["exported"] = [str(f) for f in files]
    print(json.dumps(summary))
    return 0


SERVER_KEYS = ("federation", "rounds", "min_clients", "flip_prob", "num_classes", "encoder", "architecture",
               "round_timeout_s", "sketch_timeout_s", "register_timeout_s", "round_quorum", "seed",
               "checkpoint_dir", "model_delivery")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO - 10 * min(args.verbose, 1),
                        format="%(asctime)s server %(levelname)s %(name)s: %(message)s")
    from edge_sdk.worker import TrainSettings

    from .orchestrator import Orchestrator, ServerConfig
    from .strategy import make_strategy

    try:
        conf, strat = load_config(args.config) if args.config else ({}, {})
        for key in SERVER_KEYS:
            v = getattr(args, key, None)
            if v is not None:
                conf[key] = v
        broker = args.broker or conf.pop("broker", "mqtt://127.0.0.1:1883")
        report_dir = args.report_dir or conf.pop("report_dir", None)
        conf.pop("broker", None)
        conf.pop("report_dir", None)
        config = ServerConfig(**conf)
        name = args.strategy or strat.pop("name", "fedsketch")
        robust = {"aggregator": args.aggregator, "norm_bound": args.norm_bound,
                  "trim_fraction": args.trim_fraction, "refuse_above": args.refuse_above}
        if name == "fedcref" and any(v is not None for v in robust.values()):
            raise ValueError("--aggregator, --norm-bound, --refuse-above and --trim-fraction apply to the "
                             "model-averaging strategies, not fedcref")
        if name == "fedcref":
            return _run_fedcref(args, config, broker, {**strat, **parse_params(args.params)}, report_dir)
        settings = TrainSettings(
            epochs=args.epochs or strat.pop("epochs", 1), lr=args.lr or strat.pop("lr", 1e-3),
            batch_size=args.batch_size or strat.pop("batch_size", 32),
        )
        if args.fraction is not None:
            strat["fraction"] = args.fraction
        if args.min_cluster_size is not None:
            strat["min_cluster_size"] = args.min_cluster_size
        if args.k is not None:
            strat["k"] = args.k
        strat.update({key: v for key, v in robust.items() if v is not None})
        strat.update(parse_params(args.params))
        for opt, key in ((args.ae_rounds, "rounds"), (args.ae_epochs, "epochs")):
            if opt is not None:
                if name != "fedsketch-fedae":
                    raise ValueError("--ae-rounds and --ae-epochs apply to --strategy fedsketch-fedae")
                pre = strat.get("pretrain") or {}
                if not isinstance(pre, dict):
                    raise ValueError("config: [strategy.pretrain] must be a table")
                strat["pretrain"] = {**pre, key: opt}
        if args.shared_base or strat.pop("shared_base", False):
            from edge_sdk.nets import BASE_LAYERS

            if name == "fedavg":
                raise ValueError("--shared-base applies to clustered strategies; fedavg has one model")
            if config.architecture not in BASE_LAYERS:
                raise ValueError(f"--shared-base: architecture {config.architecture!r} declares no base layers")
            strat["shared_prefixes"] = BASE_LAYERS[config.architecture]
        strategy = make_strategy(name, settings=settings, seed=config.seed, architecture=config.architecture,
                                 **strat)
        if getattr(strategy, "pretrain", None) is not None:
            from .strategy import pretrain_config

            pretrain_config(strategy.pretrain, config.encoder)  # refuse a bad setting before connecting
        bcfg = _broker_config(args, broker)
        if args.signing_key:
            from edge_sdk.signing import load_signer

            load_signer(args.signing_key)  # a missing or wrong key file is refused before connecting
    except (ValueError, TypeError, OSError) as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2
    result = _with_broker(args, config, bcfg, lambda t: Orchestrator(strategy, t, config).run(resume=args.resume),
                          FileNotFoundError)
    if result is None:
        return 3
    if report_dir:
        from .report import plot_bytes, write_json

        out = Path(report_dir)
        write_json(out / "results.json", result)
        plot_bytes(out / "bytes.png", result["transport"])
    print(json.dumps({"strategy": result["strategy"], "final_accuracy": result["final"]["accuracy"],
                      "clusters": len(set(result["assignment"].values())), "rounds": len(result["history"])}))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
