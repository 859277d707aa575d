"""``fedsketch-server``: run a federation's server over MQTT.

Settings come from command-line options or a TOML file (``--config run.toml``)
whose keys are those of :class:`server_kit.drivers.config.ServerConfig` plus a
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
could not be reached, an ingest worker could not read its partition, or the
run could not finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

__all__ = ["build_parser", "known_architectures", "known_encoders", "known_strategies", "load_config", "main",
           "parse_params"]

from edge_sdk.cli import parse_params
from edge_sdk.logs import configure_logging
from edge_sdk.protocol import SERVER_ID
from edge_sdk.transport import BrokerConfig

from .cli_options import (
    DEFAULT_COMPRESS_DOWN,
    DEFAULT_COMPRESS_UP,
    build_parser,
    known_architectures,
    known_encoders,
    known_strategies,
)
from .privacy.options import apply_dp, secure_settings

if TYPE_CHECKING:
    pass

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
    from .drivers.config import ServerConfig

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


# -- checks and logging ----------------------------------------------------------


def _check_name(what: str, name: Any, known: Sequence[str]) -> None:
    if name not in known:
        raise ValueError(f"unknown {what} {name!r}; known: {list(known)}")


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


def _configure_logging(verbose: int, fmt: str = "text") -> None:
    configure_logging(fmt, level=logging.INFO - 10 * min(verbose, 1), component="server",
                      text_format="%(asctime)s server %(levelname)s %(name)s: %(message)s")
    paho = logging.getLogger(PAHO_LOGGER)
    for f in [f for f in paho.filters if isinstance(f, _PahoNotConnected)]:
        paho.removeFilter(f)
    paho.addFilter(_PahoNotConnected(verbose))


def _broker_config(args: argparse.Namespace, broker: str) -> Any:
    return BrokerConfig.from_args(args, broker)


def _unreachable(bcfg: Any) -> str | None:
    """Why no broker of the list accepts a TCP connection (None when one does: the transport fails over)."""
    why = []
    for host, port in bcfg.endpoints:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                return None
        except OSError as e:
            why.append(str(e) or type(e).__name__)
    return why[0] if len(why) == 1 else "; ".join(f"{u}: {w}" for u, w in zip(bcfg.urls, why))


def _with_broker(args: argparse.Namespace, config: Any, bcfg: Any, run: Any) -> Any:
    """Connect as the server, ``run(transport)``, close; None (said on stderr) if it could not finish."""
    from edge_sdk.transport import MqttTransport

    why = _unreachable(bcfg)
    if why is not None:
        print(f"fedsketch-server: cannot reach the broker at {bcfg.url}: {why}", file=sys.stderr)
        return None
    from edge_sdk.protocol import Topics, encode_message

    from .drivers.link import server_offline

    signer = None
    will = encode_message(server_offline(config.federation))
    if args.signing_key:
        from edge_sdk.signing import load_signer

        signer = load_signer(args.signing_key)
        will = signer.sign(will)
    # if this process dies, the broker tells the devices that the server is away (not retained: the shipped
    # broker allows no retained message)
    transport = MqttTransport(bcfg, args.username or SERVER_ID, federation=config.federation, root=config.root,
                              will_topic=Topics(config.root, config.federation).server_status(),
                              will_payload=will)
    if signer is not None:
        transport.sign_with(signer)
    else:
        log.warning("no --signing-key: devices cannot tell this server's commands from forged ones; "
                    "only the broker's ACL protects them")
    try:
        transport.connect()
        return run(transport)
    except Exception as e:  # whatever ended the run, in one line (traced with -v); the devices were told
        log.debug("the run could not finish", exc_info=True)
        print(f"fedsketch-server: {e or type(e).__name__}", file=sys.stderr)
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
    from .fedcref.mqtt import FedCRefCoordinator

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
        register_timeout_s=config.register_timeout_s).run())
    if result is None:
        return 3
    summary = {"strategy": "fedcref", "communities": len(result.communities), "iterations": result.iterations,
               "stopped": result.stopped, "clients": len(result.clients), "gone": len(result.gone)}
    if report_dir:
        from .report import write_json

        out = Path(report_dir)
        write_json(out / "results.json", dc.asdict(result))
        if server.community_models_:
            files = export_communities(server.community_models_, str(server.architecture), out / "communities",
                                       members=dict(enumerate(result.communities)))
            summary["exported"] = [str(f) for f in files]
    print(json.dumps(summary))
    return 0


SERVER_KEYS = ("federation", "rounds", "min_clients", "flip_prob", "num_classes", "encoder", "architecture",
               "round_timeout_s", "sketch_timeout_s", "register_timeout_s", "register_quorum", "report_goal",
               "over_select", "straggler_grace", "bench_after", "first_round_timeout_s", "progress_grace_s", "seed", "checkpoint_dir", "model_delivery",
               "eval_fraction", "partial_timeout_s", "decode_updates")


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``fedsketch-server``; returns the exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose, args.log_format)
    from .cores import Role, limit_threads, plan
    from .drivers.orchestrator import Orchestrator
    from .partials.ingest import IngestRefused
    from .partials.scale_out import ScaleOut
    from .report import build_results
    from .report.summary import print_summary
    from .watch.options import WatchError, start_watch

    if args.leave:
        return _send_leave(args)
    try:
        if args.serve_models_from and (args.metrics_port is not None or args.live_port is not None):
            raise ValueError("--metrics-port and --live-port watch a training run; --serve-models-from trains nothing")
        config, strat, name, broker, report_dir = _server_settings(args)
        if args.serve_models_from:
            from .serving.settings import export_settings

            config, strat, name = export_settings(args, strat, SERVER_KEYS)
        truth, robust = _checked_extras(args, name)
        if name == "fedcref":
            return _run_fedcref(args, config, broker, {**strat, **parse_params(args.params)}, report_dir)
        strategy = _build_strategy(args, name, config, strat, robust)
        apply_dp(args, strategy, config.rounds, robust)
        secure = secure_settings(args, strategy)
        bcfg = _broker_config(args, broker)
        if args.signing_key:
            from edge_sdk.signing import load_signer

            load_signer(args.signing_key)  # a missing or wrong key file is refused before connecting
    except (ValueError, TypeError, OSError) as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2
    try:
        scale_out = ScaleOut.from_args(args, bcfg, config, strategy)
        workers = args.ingest_workers or 0  # without workers the server takes every core: said at DEBUG only
        limit_threads(plan(Role.COORDINATOR, workers=workers, override=args.worker_threads),
                      logging.INFO if workers else logging.DEBUG)
    except (ValueError, OSError) as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2
    if args.serve_models_from:
        return _serve_export(args, config, strategy, bcfg)
    try:
        watching = start_watch(args, lambda r: build_results(r, target_accuracy=args.target_accuracy, truth=truth))
    except WatchError as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2

    def run(transport: Any) -> int:
        orch = Orchestrator(strategy, transport, config, secure=secure, **scale_out.orchestrator_args())
        if watching is not None:
            watching.attach(orch)
        result = orch.run(resume=args.resume)
        results = print_summary(result, orch, report_dir, target_accuracy=args.target_accuracy, truth=truth,
                                want_results=watching is not None)
        if watching is not None:
            watching.finish(results, report_dir)
        if args.serve_models:
            orch.serve(args.serve_for)
        return 0

    # RuntimeError: the run cannot go on (every device refused, say); said in one line, traced with -v
    try:
        with scale_out:
            rc = _with_broker(args, config, bcfg, run)
    except IngestRefused as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 3
    finally:
        if watching is not None:
            watching.close()
    return 3 if rc is None else 0


def _serve_export(args: argparse.Namespace, config: Any, strategy: Any, bcfg: Any) -> int:
    """``--serve-models-from DIR``: the export's server state restored, its models served; nothing trained."""
    from .drivers.orchestrator import Orchestrator

    def serve(transport: Any) -> int:
        served = Orchestrator(strategy, transport, config).serve(args.serve_for, from_export=True)
        print(json.dumps({"served": len(served), "models": dict(sorted(served.items()))}))
        return 0

    return 3 if _with_broker(args, config, bcfg, serve) is None else 0


def _send_leave(args: argparse.Namespace) -> int:
    """``--leave ID...``: a signed leave to each device named (or, with ``all``, one broadcast); no run."""
    from edge_sdk.protocol import Topics, check_id
    from edge_sdk.protocol.commands import Op

    from .drivers.link import ServerLink

    try:
        config, _, _, broker, _ = _server_settings(args)
        everyone = "all" in args.leave
        targets = [] if everyone else [check_id(c, "--leave") for c in args.leave]
        bcfg = _broker_config(args, broker)
    except (ValueError, TypeError, OSError) as e:
        print(f"fedsketch-server: error: {e}", file=sys.stderr)
        return 2

    def send(transport: Any) -> int:
        link = ServerLink(transport, Topics(config.root, config.federation), config.federation,
                          handler=lambda topic, msg: None, rejections=lambda *a: None)
        reason = "the fleet's owner retired this device"
        if everyone:
            link.broadcast(Op.LEAVE, reason=reason)
        for cid in targets:
            link.command(cid, Op.LEAVE, reason=reason)
        # closing the connection waits for the broker's acknowledgements
        print(f"fedsketch-server: leave sent to {'every device' if everyone else ', '.join(targets)}")
        return 0

    return 0 if _with_broker(args, config, bcfg, send) == 0 else 3


def _server_settings(args: argparse.Namespace) -> tuple[Any, dict[str, Any], str, str, str | None]:
    """The run's ServerConfig, ``[strategy]`` table, strategy name, broker URL and report folder, checked.

    Options given on the command line override the ``--config`` file's keys.
    """
    from .drivers.config import ServerConfig

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
    if args.resume and not config.checkpoint_dir and name != "fedcref":
        raise ValueError("--resume needs --checkpoint-dir: the folder the interrupted run wrote its checkpoints to")
    if config.architecture is not None:
        _check_name("architecture", config.architecture, known_architectures())
    if config.encoder is not None:
        _check_name("encoder", config.encoder, known_encoders())
    return config, strat, name, broker, report_dir


def _checked_extras(args: argparse.Namespace, name: str) -> tuple[Any, dict[str, Any]]:
    """The ``--truth`` file (or None) and the robust-aggregation options, checked against strategy ``name``."""
    from .report import load_truth

    if not 0.0 < args.target_accuracy <= 1.0:
        raise ValueError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy:g}")
    if args.metrics_port is not None or args.live_port is not None:
        if name == "fedcref":
            raise ValueError("--metrics-port and --live-port watch the model-averaging strategies' runs, not fedcref")
    truth = load_truth(args.truth) if args.truth else None
    robust = {"aggregator": args.aggregator, "norm_bound": args.norm_bound,
              "trim_fraction": args.trim_fraction, "refuse_above": args.refuse_above}
    if name == "fedcref" and any(v is not None for v in robust.values()):
        raise ValueError("--aggregator, --norm-bound, --refuse-above and --trim-fraction apply to the "
                         "model-averaging strategies, not fedcref")
    if name == "fedcref" and truth is not None:
        raise ValueError("--truth applies to the model-averaging strategies, not fedcref")
    return truth, robust


def _build_strategy(args: argparse.Namespace, name: str, config: Any, strat: dict[str, Any],
                    robust: dict[str, Any]) -> Any:
    """The strategy ``name`` with the ``[strategy]`` table and the options; a bad setting raises here."""
    from edge_sdk.tasks import TrainSettings

    from .strategies import make_strategy

    settings = TrainSettings(
        epochs=args.epochs or strat.pop("epochs", 1), lr=args.lr or strat.pop("lr", 1e-3),
        batch_size=args.batch_size or strat.pop("batch_size", 32),
    )
    _apply_strategy_options(args, name, strat, robust)
    if strat.get("follow_drift") or strat.get("resketch_every") is not None:
        strat.setdefault("flip_prob", config.flip_prob)  # the noise a fresh sketch is judged against
    if args.shared_base or strat.pop("shared_base", False):
        strat["shared_prefixes"] = _shared_prefixes(name, config.architecture)
    strategy = make_strategy(name, settings=settings, seed=config.seed, architecture=config.architecture,
                             **strat)
    if strategy.capabilities.pretrain is not None:
        from .pretrain.settings import pretrain_config

        if config.encoder is not None or strategy.capabilities.pretrain.get("architecture"):
            pretrain_config(strategy.capabilities.pretrain, config.encoder)  # refuse a bad setting before connecting
    return strategy


def _apply_compression(args: argparse.Namespace, name: str, strat: dict[str, Any]) -> None:
    """``--compress``, ``--compress-up`` and ``--compress-down`` (or the ``[strategy]`` table's keys) into ``strat``.

    Each direction takes its own option, else ``--compress``, else its
    default (:data:`DEFAULT_COMPRESS_UP`, :data:`DEFAULT_COMPRESS_DOWN`).
    Asked for a method that cannot take it, the strategy refuses at its
    start; by default, such a method sends whole updates (said in the log).
    """
    from edge_sdk.compress import Compression
    from edge_sdk.compress.update_codec import compression_for

    from .strategies import strategy_class

    def asked(option: str) -> Any:
        given = getattr(args, option, None)
        return given if given is not None else strat.pop(option, None)

    both, up, down = asked("compress"), asked("compress_up"), asked("compress_down")
    if name == "fedcref":
        if (both, up, down) != (None, None, None):
            raise ValueError("--compress, --compress-up and --compress-down apply to the model-averaging "
                             "strategies, not fedcref")
        return
    refuses = strategy_class(name).capabilities.refuses_compression
    for direction, given, default in (("up", up, DEFAULT_COMPRESS_UP), ("down", down, DEFAULT_COMPRESS_DOWN)):
        given = given if given is not None else both
        comp = Compression.parse(given if given is not None else default)
        settled = compression_for(comp, refuses, f"strategy {name!r}", asked=given is not None)
        if settled != comp:
            log.info("strategy %s sends whole models %s: %s", name, direction, refuses)
        strat[f"compress_{direction}"] = settled


def _apply_strategy_options(args: argparse.Namespace, name: str, strat: dict[str, Any],
                            robust: dict[str, Any]) -> None:
    """Put the strategy's command-line options (and every ``--set``) into ``strat``."""
    if args.fraction is not None:
        strat["fraction"] = args.fraction
    if args.min_cluster_size is not None:
        strat["min_cluster_size"] = args.min_cluster_size
    if args.k is not None:
        strat["k"] = args.k
    strat.update({key: v for key, v in robust.items() if v is not None})
    _apply_compression(args, name, strat)
    if args.follow_drift or args.resketch_every is not None:
        if name not in ("fedsketch", "fedsketch-fedae"):
            raise ValueError("--follow-drift and --resketch-every apply to --strategy fedsketch and fedsketch-fedae")
        strat["follow_drift"] = True
        if args.resketch_every is not None:
            strat["resketch_every"] = args.resketch_every
    strat.update(parse_params(args.params))
    for opt, key in ((args.ae_rounds, "rounds"), (args.ae_epochs, "epochs")):
        if opt is not None:
            if name != "fedsketch-fedae":
                raise ValueError("--ae-rounds and --ae-epochs apply to --strategy fedsketch-fedae")
            pre = strat.get("pretrain") or {}
            if not isinstance(pre, dict):
                raise ValueError("config: [strategy.pretrain] must be a table")
            strat["pretrain"] = {**pre, key: opt}


def _shared_prefixes(name: str, architecture: str | None) -> Any:
    """``--shared-base``: the base layers of ``architecture``, which every cluster shares."""
    from edge_sdk.training.nets import BASE_LAYERS

    if name == "fedavg":
        raise ValueError("--shared-base applies to clustered strategies; fedavg has one model")
    if architecture is None:
        raise ValueError("--shared-base needs --architecture (its base layers are the architecture's)")
    if architecture not in BASE_LAYERS:
        raise ValueError(f"--shared-base: architecture {architecture!r} declares no base layers")
    return BASE_LAYERS[architecture]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
