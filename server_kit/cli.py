"""``fedsketch-server``: run a federation's server over MQTT.

Settings come from command-line options or a TOML file (``--config run.toml``)
whose keys are those of :class:`server_kit.orchestrator.ServerConfig` plus a
``[strategy]`` table; unknown keys are refused, and so are unknown strategy,
architecture and encoder names, before connecting.

    fedsketch-server --broker mqtt://127.0.0.1:1883 --federation lab --strategy fedsketch \\
        --min-clients 20 --rounds 10 --checkpoint-dir ckpt/ --report-dir reports/lab
    fedsketch-server ... --resume          # continue a killed server from its last round

With ``--report-dir`` a run writes its report there (:mod:`server_kit.report`):
``results.json``, ``accuracy.png``, ``threshold_search.png`` (sketch
strategies), ``bytes.png`` and ``report.html``; with ``--truth`` (client id ->
true group, as ``fedsketch-data split`` writes it) the clustering is scored.

Exit status: 0 done, 2 a bad setting (nothing was connected), 3 the broker
could not be reached or the run could not finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import logging
import socket
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["build_parser", "known_architectures", "known_encoders", "known_strategies", "load_config", "main",
           "parse_params"]

from edge_sdk.cli import parse_params
from edge_sdk.protocol import SERVER_ID
from edge_sdk.transport import BrokerConfig

log = logging.getLogger(__name__)

#: The logger paho writes to through ``enable_logger`` (see :class:`edge_sdk.transport.MqttTransport`).
PAHO_LOGGER = "edge_sdk.transport.paho"

#: Seconds the broker's address gets to accept a TCP connection before the server connects for real.
PROBE_TIMEOUT_S = 5.0


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


# -- the names a user can pick ----------------------------------------------------


def known_strategies() -> list[str]:
    """Every ``--strategy`` name: those of :func:`server_kit.strategy.strategy_names` and ``fedcref``."""
    from .strategy import strategy_names

    return sorted({*strategy_names(), "fedcref"})


@functools.lru_cache(maxsize=1)
def _classifiers() -> tuple[str, ...]:
    from edge_sdk.nets import ARCHITECTURES, build_model

    names = []
    for name in ARCHITECTURES:
        model = build_model(name)
        if hasattr(model, "num_classes") and hasattr(model, "input_shape"):
            names.append(name)
    return tuple(sorted(names))


def known_architectures() -> list[str]:
    """Every ``--architecture``: the classifiers of :data:`edge_sdk.nets.ARCHITECTURES` the clients train.

    An architecture is a classifier when its model declares ``num_classes``
    and ``input_shape`` (what :mod:`edge_sdk.trainer` trains); the
    autoencoders are left out.
    """
    return list(_classifiers())


def known_encoders() -> list[str]:
    """Every ``--encoder``: the shipped artifacts of role ``encoder`` (:func:`edge_sdk.artifacts.load_manifest`)."""
    from edge_sdk.artifacts import load_manifest

    return sorted(name for name, spec in load_manifest().items() if spec.role == "encoder")


def _check_name(what: str, name: Any, known: Sequence[str]) -> None:
    if name not in known:
        raise ValueError(f"unknown {what} {name!r}; known: {list(known)}")


# -- the command line -------------------------------------------------------------


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help at spaces only: names such as ``fedsketch-fedae`` stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _defaults() -> dict[str, Any]:
    """Every option's default as --help shows it (those of ServerConfig, TrainSettings and the strategies)."""
    from edge_sdk.worker import TrainSettings

    from .orchestrator import ServerConfig
    from .robust import DEFAULT_NORM_BOUND, DEFAULT_REFUSE_ABOVE, DEFAULT_TRIM_FRACTION
    from .strategy import PRETRAIN_DEFAULTS, SketchClustered, Strategy

    d: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    d.update({f"train_{f.name}": f.default for f in dataclasses.fields(TrainSettings)})
    d.update({f"ae_{k}": v for k, v in PRETRAIN_DEFAULTS.items()})
    d["fraction"] = inspect.signature(Strategy.__init__).parameters["fraction"].default
    d["min_cluster_size"] = inspect.signature(SketchClustered.__init__).parameters["min_cluster_size"].default
    d.update(norm_bound=DEFAULT_NORM_BOUND, refuse_above=DEFAULT_REFUSE_ABOVE, trim_fraction=DEFAULT_TRIM_FRACTION)
    return d


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsketch-server`` options; their help gives every default and the names to choose from."""
    d = _defaults()

    def dflt(key: str, none: str = "none") -> str:
        v = d[key]
        return f"(default: {none if v is None else v})"

    def one_of(names: Sequence[str]) -> str:
        return "one of: " + ", ".join(names)

    p = argparse.ArgumentParser(prog="fedsketch-server", description=__doc__.splitlines()[0],
                                formatter_class=_HelpFormatter)
    p.add_argument("--config", metavar="TOML",
                   help="TOML run config: ServerConfig keys plus a [strategy] table; options given here override "
                        "it (default: none)")
    p.add_argument("--broker", default=None, metavar="URL",
                   help="mqtt://host:port or mqtts://host:port (default: mqtt://127.0.0.1:1883)")
    p.add_argument("--federation", default=None, metavar="NAME",
                   help=f"the federation's name, in every topic {dflt('federation')}")
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help=f"{one_of(known_strategies())}. fedsketch is ours, fedsketch-fedae ours with federated AE "
                        "pre-training; fedcref for unlabelled clients (fedsketch-client --fedcref; --set "
                        "theta=0.2 --set community_rounds=15 ...) (default: fedsketch)")
    p.add_argument("--k", type=int, default=None,
                   help="number of clusters for ifca, ladd and kmeans-weights (default: 4 for ifca and ladd; "
                        "kmeans-weights chooses it)")
    p.add_argument("--aggregator", choices=["fedavg", "trimmed-mean", "median"], default=None,
                   help="how each model's updates are combined: weighted FedAvg, or the unweighted "
                        "coordinate-wise trimmed mean or median (robust to a few hostile devices; they hold a "
                        "cluster's updates in memory) (default: fedavg)")
    p.add_argument("--norm-bound", type=float, default=None, metavar="X",
                   help="clip every update whose change exceeds X times the round's median update norm, refuse "
                        f"non-finite ones; 0 = off, with --refuse-above {dflt('norm_bound')}")
    p.add_argument("--refuse-above", type=float, default=None, metavar="R",
                   help="with --norm-bound on, refuse every update whose change exceeds R times the round's "
                        f"median update norm; 0 = clip it instead {dflt('refuse_above')}")
    p.add_argument("--trim-fraction", type=float, default=None, metavar="B",
                   help="fraction cut at each end of every coordinate by --aggregator trimmed-mean, in (0, 0.5) "
                        f"{dflt('trim_fraction')}")
    p.add_argument("--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy parameter, the value in TOML syntax (repeatable): --set algorithm=hdbscan "
                        "--set eps1=0.4 (default: the strategy's own)")
    p.add_argument("--rounds", type=int, help=f"training rounds {dflt('rounds')}")
    p.add_argument("--min-clients", type=int, help=f"clients registration waits for {dflt('min_clients')}")
    p.add_argument("--flip-prob", type=float,
                   help=f"probability the clients flip each sketch bit (privacy) {dflt('flip_prob')}")
    p.add_argument("--num-classes", type=int, help=f"classes of the clients' labels {dflt('num_classes')}")
    p.add_argument("--encoder", metavar="NAME",
                   help=f"shipped encoder the clients sketch with; {one_of(known_encoders())} "
                        f"{dflt('encoder', 'chosen from the fleet')}")
    p.add_argument("--architecture", metavar="NAME",
                   help=f"classifier the clients train; {one_of(known_architectures())} "
                        f"{dflt('architecture', 'chosen from the fleet')}")
    p.add_argument("--epochs", type=int, default=None, help=f"local epochs per round {dflt('train_epochs')}")
    p.add_argument("--lr", type=float, default=None, help=f"local learning rate {dflt('train_lr')}")
    p.add_argument("--batch-size", type=int, default=None, help=f"local batch size {dflt('train_batch_size')}")
    p.add_argument("--fraction", type=float, default=None,
                   help=f"fraction of each cluster sampled per round {dflt('fraction')}")
    p.add_argument("--min-cluster-size", type=int, default=None,
                   help=f"smallest cluster the sketch clustering accepts (fedsketch) {dflt('min_cluster_size')}")
    p.add_argument("--ae-rounds", type=int, default=None,
                   help=f"federated AE pre-training rounds (fedsketch-fedae) {dflt('ae_rounds')}")
    p.add_argument("--ae-epochs", type=int, default=None,
                   help=f"local epochs per AE pre-training round (fedsketch-fedae) {dflt('ae_epochs')}")
    p.add_argument("--shared-base", action="store_true",
                   help="average the architecture's base layers (its convolutions) over all clients, "
                        "the rest per cluster (the paper's LeNet-5 setting) (default: off)")
    p.add_argument("--round-timeout", type=float, dest="round_timeout_s", metavar="S",
                   help=f"seconds a round waits for its updates {dflt('round_timeout_s')}")
    p.add_argument("--sketch-timeout", type=float, dest="sketch_timeout_s", metavar="S",
                   help=f"seconds the server waits for the sketches {dflt('sketch_timeout_s')}")
    p.add_argument("--register-timeout", type=float, dest="register_timeout_s", metavar="S",
                   help=f"seconds registration waits for --min-clients {dflt('register_timeout_s')}")
    p.add_argument("--register-quorum", type=float, metavar="Q",
                   help="at the registration deadline, start if this fraction of --min-clients was admitted "
                        f"{dflt('register_quorum')}")
    p.add_argument("--first-round-timeout", type=float, dest="first_round_timeout_s", metavar="S",
                   help="deadline of round 1, which includes every device's start-up (default: 3 x --round-timeout)")
    p.add_argument("--progress-grace", type=float, dest="progress_grace_s", metavar="S",
                   help="past its deadline, a round waits on while a device said this recently that it still "
                        f"trains {dflt('progress_grace_s')}")
    p.add_argument("--round-quorum", type=float, metavar="Q",
                   help=f"fraction of a round's clients whose updates close it early {dflt('round_quorum')}")
    p.add_argument("--model-delivery", choices=["auto", "client", "cluster"], default=None,
                   help="models per client on its own topic (each device downloads only its models), once per "
                        "cluster topic (every device downloads all), or auto: broadcast only when every client "
                        f"needs every model {dflt('model_delivery')}")
    p.add_argument("--eval-fraction", type=float, dest="eval_fraction", metavar="F",
                   help="share of the assigned devices the final evaluation asks, in (0, 1]: a seeded sample, at "
                        f"least one device per cluster {dflt('eval_fraction')}")
    p.add_argument("--seed", type=int, help=f"seed of the initial models and of client sampling {dflt('seed')}")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write the state after every round here (default: none, no checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint's last round (default: off)")
    p.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write results.json, accuracy.png, threshold_search.png (sketch strategies), bytes.png "
                        "and report.html here (default: none)")
    p.add_argument("--truth", default=None, metavar="JSON",
                   help="a JSON object client id -> true group (fedsketch-data split writes one): the final "
                        "clustering's ARI, AMI, completeness and homogeneity against it (default: none)")
    p.add_argument("--target-accuracy", type=float, default=0.8, metavar="A",
                   help="the report's rounds_to_target is the first round reaching it (default: %(default)s)")
    BrokerConfig.add_arguments(p, defaults_in_help=True)  # the same broker options as fedsketch-client
    p.add_argument("--signing-key", default=None, metavar="PEM",
                   help="sign everything sent to devices with this Ed25519 private key (fedsketch keygen, "
                        "deploy/make_passwords.sh); devices given its public half (--server-key) obey nothing "
                        "else (default: none)")
    p.add_argument("-v", "--verbose", action="count", default=0, help="debug logging (default: info)")
    return p


class _PahoNotConnected(logging.Filter):
    """paho's "Client is not connected" ERROR, logged while it retries a connection: debug, not an error.

    The server says itself when the broker cannot be reached; that line from
    paho's loop would only mislead. It is kept, as DEBUG, with ``-v``.
    """

    def __init__(self, verbose: int) -> None:
        super().__init__()
        self.verbose = verbose

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith("Client is not connected"):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return self.verbose > 0


def _configure_logging(verbose: int) -> None:
    logging.basicConfig(level=logging.INFO - 10 * min(verbose, 1),
                        format="%(asctime)s server %(levelname)s %(name)s: %(message)s")
    paho = logging.getLogger(PAHO_LOGGER)
    for f in [f for f in paho.filters if isinstance(f, _PahoNotConnected)]:
        paho.removeFilter(f)
    paho.addFilter(_PahoNotConnected(verbose))


def _broker_config(args: argparse.Namespace, broker: str) -> Any:
    return BrokerConfig.from_args(args, broker)


def _unreachable(bcfg: Any) -> str | None:
    """Why the broker's address accepts no TCP connection (None when it does)."""
    try:
        with socket.create_connection((bcfg.host, bcfg.port), timeout=PROBE_TIMEOUT_S):
            return None
    except OSError as e:
        return str(e) or type(e).__name__


def _with_broker(args: argparse.Namespace, config: Any, bcfg: Any, run: Any, *errors: type[BaseException]) -> Any:
    """Connect as the server, ``run(transport)``, close; None (said on stderr) if it could not finish."""
    from edge_sdk.transport import MqttTransport

    why = _unreachable(bcfg)
    if why is not None:
        print(f"fedsketch-server: cannot reach the broker at {bcfg.url}: {why}", file=sys.stderr)
        return None
    transport = MqttTransport(bcfg, args.username or SERVER_ID, federation=config.federation, root=config.root)
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
        log.debug("the run could not finish", exc_info=True)
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
               "round_timeout_s", "sketch_timeout_s", "register_timeout_s", "register_quorum", "round_quorum",
               "first_round_timeout_s", "progress_grace_s", "seed", "checkpoint_dir", "model_delivery",
               "eval_fraction")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedsketch-server``; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    from edge_sdk.worker import TrainSettings

    from .orchestrator import Orchestrator, ServerConfig
    from .report import clustering_against_truth, load_truth
    from .strategy import make_strategy

    try:
        if args.eval_fraction is not None and not 0.0 < args.eval_fraction <= 1.0:
            raise ValueError(f"--eval-fraction must be in (0, 1], got {args.eval_fraction:g}")
        conf, strat = load_config(args.config) if args.config else ({}, {})
        for key in SERVER_KEYS:
            v = getattr(args, key, None)
            if v is not None:
                conf[key] = v
        broker = args.broker or conf.pop("broker", "mqtt://127.0.0.1:1883")
        report_dir = args.report_dir or conf.pop("report_dir", None)
        conf.pop("broker", None)
        conf.pop("report_dir", None)
        name = args.strategy or strat.pop("name", "fedsketch")
        _check_name("strategy", name, known_strategies())
        config = ServerConfig(**conf)
        if config.architecture is not None:
            _check_name("architecture", config.architecture, known_architectures())
        if config.encoder is not None:
            _check_name("encoder", config.encoder, known_encoders())
        if not 0.0 < args.target_accuracy <= 1.0:
            raise ValueError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy:g}")
        truth = load_truth(args.truth) if args.truth else None
        robust = {"aggregator": args.aggregator, "norm_bound": args.norm_bound,
                  "trim_fraction": args.trim_fraction, "refuse_above": args.refuse_above}
        if name == "fedcref" and any(v is not None for v in robust.values()):
            raise ValueError("--aggregator, --norm-bound, --refuse-above and --trim-fraction apply to the "
                             "model-averaging strategies, not fedcref")
        if name == "fedcref" and truth is not None:
            raise ValueError("--truth applies to the model-averaging strategies, not fedcref")
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
            if config.architecture is None:
                raise ValueError("--shared-base needs --architecture (its base layers are the architecture's)")
            if config.architecture not in BASE_LAYERS:
                raise ValueError(f"--shared-base: architecture {config.architecture!r} declares no base layers")
            strat["shared_prefixes"] = BASE_LAYERS[config.architecture]
        strategy = make_strategy(name, settings=settings, seed=config.seed, architecture=config.architecture,
                                 **strat)
        if getattr(strategy, "pretrain", None) is not None:
            from .strategy import pretrain_config

            if config.encoder is not None or strategy.pretrain.get("architecture"):
                pretrain_config(strategy.pretrain, config.encoder)  # refuse a bad setting before connecting
        bcfg = _broker_config(args, broker)
        if args.signing_key:
            from edge_sdk.signing import load_signer

            load_signer(args.signing_key)  # a missing or wrong key file is refused before connecting
    except (ValueError, TypeError, OSError) as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2
    # RuntimeError: the run cannot go on (every device refused, say); said in one line, traced with -v
    result = _with_broker(args, config, bcfg, lambda t: Orchestrator(strategy, t, config).run(resume=args.resume),
                          FileNotFoundError, RuntimeError)
    if result is None:
        return 3
    from .metrics import final_accuracy
    from .report import accuracy_per_round

    # the same figures, under the same names, as results.json's (see its "definitions")
    summary = {"strategy": result["strategy"], "final_accuracy": _round(final_accuracy(accuracy_per_round(result))),
               "final_evaluation": _round(result["final"]["accuracy"]),
               "clusters": len(set(result["assignment"].values())), "rounds": len(result["history"])}
    if report_dir:
        from .report import build_results, write_report

        results = build_results(result, target_accuracy=args.target_accuracy, truth=truth)
        files = write_report(report_dir, results, strategy=strategy)
        print(f"report: {files['report.html']}")
        if truth is not None:
            summary["ari"] = _round(results["clustering"]["ari"])
    elif truth is not None:
        summary["ari"] = _round(clustering_against_truth(result["assignment"], truth)["ari"])
    print(json.dumps(summary))
    return 0


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 4)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
