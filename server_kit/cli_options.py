"""The ``fedsketch-server`` command line's options: the parser, the defaults its help shows, the names to pick."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

from edge_sdk.logs import add_log_format_argument
from edge_sdk.transport import BrokerConfig

from .privacy.options import add_privacy_arguments
from .watch.options import add_watch_options

__all__ = ["DEFAULT_COMPRESS_DOWN", "DEFAULT_COMPRESS_UP", "DESCRIPTION", "build_parser", "device_name", "known_architectures", "known_encoders", "known_strategies"]

#: ``--compress-up`` and ``--compress-down`` when not given: the pair ``benchmarks/compression.py`` picked (README).
DEFAULT_COMPRESS_UP = "int4"
DEFAULT_COMPRESS_DOWN = "int4"
#: The ``--compress`` forms, for the help texts.
COMPRESS_FORMS = ("none (whole float32 models), int8, int4, sign (1 bit), rsign, rtern, rint2 (rotated: 1, 1.6 "
                  "and 2 bits), topk[:FRACTION] or stc[:FRACTION]")
#: The first line of ``fedsketch-server --help``.
DESCRIPTION = "``fedsketch-server``: run a federation's server over MQTT."


# -- the names a user can pick ----------------------------------------------------


def device_name(text: str) -> str:
    """An argparse type for a ``--device`` option: ``auto``, ``cpu`` or ``cuda``, resolved to ``cpu`` or ``cuda``.

    ``cuda`` where torch sees no CUDA device is a usage error, said before anything starts.
    """
    from edge_sdk.training.torch_support import resolve_device

    try:
        return resolve_device(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def known_strategies() -> list[str]:
    """Every ``--strategy`` name: those of :func:`server_kit.strategies.strategy_names` and ``fedcref``."""
    from .strategies import strategy_names

    return sorted({*strategy_names(), "fedcref"})


@functools.lru_cache(maxsize=1)
def _classifiers() -> tuple[str, ...]:
    from edge_sdk.training.nets import ARCHITECTURES, build_model

    names = []
    for name in ARCHITECTURES:
        model = build_model(name)
        if hasattr(model, "num_classes") and hasattr(model, "input_shape"):
            names.append(name)
    return tuple(sorted(names))


def known_architectures() -> list[str]:
    """Every ``--architecture``: the classifiers of :data:`edge_sdk.training.nets.ARCHITECTURES` the clients train.

    An architecture is a classifier when its model declares ``num_classes``
    and ``input_shape`` (what :mod:`edge_sdk.training.trainer` trains); the
    autoencoders are left out.
    """
    return list(_classifiers())


def known_encoders() -> list[str]:
    """Every ``--encoder``: the shipped artifacts of role ``encoder`` (:func:`edge_sdk.models.artifacts.load_manifest`)."""
    from edge_sdk.models.artifacts import load_manifest

    return sorted(name for name, spec in load_manifest().items() if spec.role == "encoder")


# -- the command line -------------------------------------------------------------


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps help at spaces only: names such as ``fedsketch-fedae`` stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


def _defaults() -> dict[str, Any]:
    """Every option's default as --help shows it (those of ServerConfig, TrainSettings and the strategies)."""
    from edge_sdk.tasks import TrainSettings

    from .drivers.config import ServerConfig
    from .pretrain.settings import PRETRAIN_DEFAULTS
    from .robust import DEFAULT_NORM_BOUND, DEFAULT_REFUSE_ABOVE, DEFAULT_TRIM_FRACTION
    from .strategies.base import Strategy
    from .strategies.fedsketch import SketchClustered

    d: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    d.update({f"train_{f.name}": f.default for f in dataclasses.fields(TrainSettings)})
    d.update({f"ae_{k}": v for k, v in PRETRAIN_DEFAULTS.items()})
    d["fraction"] = inspect.signature(Strategy.__init__).parameters["fraction"].default
    d["min_cluster_size"] = inspect.signature(SketchClustered.__init__).parameters["min_cluster_size"].default
    d.update(norm_bound=DEFAULT_NORM_BOUND, refuse_above=DEFAULT_REFUSE_ABOVE, trim_fraction=DEFAULT_TRIM_FRACTION)
    return d


def build_parser() -> argparse.ArgumentParser:
    """The ``fedsketch-server`` options; their help gives every default and the names to choose from."""
    dflt = functools.partial(_default_text, _defaults())
    p = argparse.ArgumentParser(prog="fedsketch-server", description=DESCRIPTION,
                                formatter_class=_HelpFormatter)
    _add_strategy_options(p, dflt)
    _add_fleet_options(p, dflt)
    _add_training_options(p, dflt)
    _add_deadline_options(p, dflt)
    _add_output_options(p, dflt)
    BrokerConfig.add_arguments(p, defaults_in_help=True)  # the same broker options as fedsketch-client
    p.add_argument("--signing-key", default=None, metavar="PEM",
                   help="sign everything sent to devices with this Ed25519 private key (fedsketch keygen, "
                        "deploy/make_passwords.sh); devices given its public half (--server-key) obey nothing "
                        "else (default: none)")
    _add_scale_out_options(p)
    add_privacy_arguments(p)
    add_watch_options(p)
    p.add_argument("-v", "--verbose", action="count", default=0, help="debug logging (default: info)")
    add_log_format_argument(p, defaults_in_help=True)
    return p


def _add_scale_out_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scale-out: ingest workers and site aggregators")
    g.add_argument("--ingest-workers", type=int, default=0, metavar="W",
                   help="start W worker processes, worker p taking partition p of the devices' update topics "
                        "(clients/+/update/p): they decode, check and sum the updates and hand this server partial "
                        "sums. The broker must let user <user>-ingest-p read its partition (deploy/make_acl.py "
                        "--ingest-workers W); the server probes each at start and stops if one cannot "
                        "(default: 0, the server takes the updates itself)")
    g.add_argument("--worker-threads", type=int, default=None, metavar="N",
                   help="numpy/BLAS and torch threads of each ingest worker (default: its share of the cores, "
                        "cores // (W + 1), at most 2; this server takes the cores the workers leave)")
    g.add_argument("--aggregator-keys", default=None, metavar="DIR",
                   help="accept partial sums from the site aggregators whose public keys are in DIR (ID.pub, "
                        "from fedsketch keygen --name ID); the devices of other sites send their updates "
                        "through the bridge as usual (default: none)")
    g.add_argument("--partial-timeout", type=float, default=None, metavar="S", dest="partial_timeout_s",
                   help="how long a round's close waits for the aggregators' partial sums (default: 60)")


def _default_text(defaults: dict[str, Any], key: str, none: str = "none") -> str:
    """``(default: X)`` for the option ``key`` of ``defaults``; ``none`` stands for None."""
    v = defaults[key]
    return f"(default: {none if v is None else v})"


def _one_of(names: Sequence[str]) -> str:
    return "one of: " + ", ".join(names)


def _add_strategy_options(p: argparse.ArgumentParser, dflt: Callable[..., str]) -> None:
    """The run config, the broker, the federation, the strategy and how it combines updates."""
    p.add_argument("--config", metavar="TOML",
                   help="TOML run config: ServerConfig keys plus a [strategy] table; options given here override "
                        "it (default: none)")
    p.add_argument("--broker", default=None, metavar="URL[,URL...]",
                   help="mqtt://host:port or mqtts://host:port; a comma-separated list (a cluster's nodes) is failed "
                        "over in turn: each lost connection moves to the next (default: mqtt://127.0.0.1:1883)")
    p.add_argument("--federation", default=None, metavar="NAME",
                   help=f"the federation's name, in every topic {dflt('federation')}")
    p.add_argument("--strategy", default=None, metavar="NAME",
                   help=f"{_one_of(known_strategies())}. fedsketch is ours, fedsketch-fedae ours with federated AE "
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
    p.add_argument("--compress", default=None, metavar="METHOD",
                   help=f"how updates come up and models go down: {COMPRESS_FORMS} (the share of each tensor "
                        "sent, e.g. topk:0.01); the devices follow. A method that clusters from whole updates (cfl, "
                        "ocfl, briggs, kmeans-weights, flis) sends them whole (default: --compress-up "
                        f"{DEFAULT_COMPRESS_UP} --compress-down {DEFAULT_COMPRESS_DOWN})")
    p.add_argument("--compress-up", default=None, metavar="METHOD",
                   help=f"how updates come up, instead of --compress (default: {DEFAULT_COMPRESS_UP})")
    p.add_argument("--compress-down", default=None, metavar="METHOD",
                   help=f"how models go down, instead of --compress (default: {DEFAULT_COMPRESS_DOWN})")
    p.add_argument("--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="a strategy parameter, the value in TOML syntax (repeatable): --set algorithm=hdbscan "
                        "--set eps1=0.4 (default: the strategy's own)")


def _add_fleet_options(p: argparse.ArgumentParser, dflt: Callable[..., str]) -> None:
    """The rounds, the fleet, its sketches and the models it trains."""
    p.add_argument("--rounds", type=int, help=f"training rounds {dflt('rounds')}")
    p.add_argument("--min-clients", type=int, help=f"clients registration waits for {dflt('min_clients')}")
    p.add_argument("--flip-prob", type=float,
                   help=f"probability the clients flip each sketch bit (privacy) {dflt('flip_prob')}")
    p.add_argument("--num-classes", type=int, help=f"classes of the clients' labels {dflt('num_classes')}")
    p.add_argument("--encoder", metavar="NAME",
                   help=f"shipped encoder the clients sketch with; {_one_of(known_encoders())} "
                        f"{dflt('encoder', 'chosen from the fleet')}")
    p.add_argument("--architecture", metavar="NAME",
                   help=f"classifier the clients train; {_one_of(known_architectures())} "
                        f"{dflt('architecture', 'chosen from the fleet')}")


def _add_training_options(p: argparse.ArgumentParser, dflt: Callable[..., str]) -> None:
    """Local training, sampling, the sketch clustering and the AE pre-training."""
    p.add_argument("--epochs", type=int, default=None, help=f"local epochs per round {dflt('train_epochs')}")
    p.add_argument("--lr", type=float, default=None, help=f"local learning rate {dflt('train_lr')}")
    p.add_argument("--batch-size", type=int, default=None, help=f"local batch size {dflt('train_batch_size')}")
    p.add_argument("--fraction", type=float, default=None,
                   help=f"fraction of each cluster sampled per round {dflt('fraction')}")
    p.add_argument("--min-cluster-size", type=int, default=None,
                   help=f"smallest cluster the sketch clustering accepts (fedsketch) {dflt('min_cluster_size')}")
    p.add_argument("--follow-drift", action="store_true",
                   help="fedsketch: follow data that drifts during training. A device whose data changed sends a "
                        "fresh sketch unasked; the server moves it to the cluster it now fits (each move logged "
                        "with its distances), pools devices that fit none and makes a new cluster of at least "
                        "--min-cluster-size of them; counted in each round's record and the results (default: off, "
                        "the paper's method: cluster once)")
    p.add_argument("--resketch-every", type=int, default=None, metavar="N",
                   help="fedsketch: also ask devices for fresh sketches every N rounds (before rounds N+1, 2N+1, "
                        "...; the share --fraction of the online clustered devices, a seeded sample); implies "
                        "--follow-drift (default: never, only the sketches devices send unasked)")
    p.add_argument("--ae-rounds", type=int, default=None,
                   help=f"federated AE pre-training rounds (fedsketch-fedae) {dflt('ae_rounds')}")
    p.add_argument("--ae-epochs", type=int, default=None,
                   help=f"local epochs per AE pre-training round (fedsketch-fedae) {dflt('ae_epochs')}")
    p.add_argument("--shared-base", action="store_true",
                   help="average the architecture's base layers (its convolutions) over all clients, "
                        "the rest per cluster (the paper's LeNet-5 setting) (default: off)")


def _add_deadline_options(p: argparse.ArgumentParser, dflt: Callable[..., str]) -> None:
    """How long each phase waits, and how the models and the final evaluation go out."""
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
    p.add_argument("--report-goal", type=float, dest="report_goal", metavar="G",
                   help="a round closes once each cluster sent this share of the updates it needs, rounded up "
                        "(then a short grace for the stragglers; their late updates are refused), and the final "
                        "evaluation once this share of each cluster's devices answered, in (0, 1]; 0.9 waits for every "
                        f"device of a cluster of fewer than 10, 9 of 10, 18 of 20 {dflt('report_goal')}")
    p.add_argument("--over-select", type=float, dest="over_select", metavar="F",
                   help="task this share more devices per cluster than a round needs (0.3: 130 %%), so that a "
                        "slow or broken device holds no round open (default: 0.1, rounded up, in the clusters "
                        "whose round needs at least 10 devices, none in smaller ones; a value given applies to "
                        "every cluster)")
    p.add_argument("--straggler-grace", type=float, dest="straggler_grace", metavar="F",
                   help="once every cluster has its goal, wait this share of the time the goal took for the rest "
                        f"{dflt('straggler_grace')}")
    p.add_argument("--bench-after", type=int, dest="bench_after", metavar="N",
                   help="a device that sends no usable update (refused, or none while online) in N rounds in a "
                        "row is not tasked again in the run, nor waited for in the final evaluation (0: never) "
                        f"{dflt('bench_after')}")
    p.add_argument("--model-delivery", choices=["auto", "client", "cluster"], default=None,
                   help="models per client on its own topic (each device downloads only its models), once per "
                        "cluster topic (every device downloads all), or auto: broadcast only when every client "
                        f"needs every model {dflt('model_delivery')}")
    p.add_argument("--decode-updates", choices=["auto", "intake", "sum"], dest="decode_updates", default=None,
                   help="where int8 and int4 updates are decoded: as they arrive (intake), or kept as they came "
                        "and decoded where they are summed (sum: on a GPU server the codes cross to the card, an "
                        "eighth of the float32 bytes for int4); auto: sum where a model's sums are on a GPU. "
                        "Methods that read each update, other aggregators and --dp-epsilon decode at intake "
                        f"{dflt('decode_updates')}")
    p.add_argument("--eval-fraction", type=float, dest="eval_fraction", metavar="F",
                   help="share of the assigned devices the final evaluation asks, in (0, 1]: a seeded sample, at "
                        f"least one device per cluster {dflt('eval_fraction')}")


def _add_output_options(p: argparse.ArgumentParser, dflt: Callable[..., str]) -> None:
    """The seed, checkpoints and resuming, and the report."""
    p.add_argument("--seed", type=int, help=f"seed of the initial models and of client sampling {dflt('seed')}")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="write the state after every round here (default: none, no checkpoints)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint's last round (default: off)")
    p.add_argument("--leave", action="append", default=[], metavar="CLIENT_ID",
                   help="run nothing: tell these devices (repeatable; 'all': every device of the federation) to "
                        "leave the fleet, signed with --signing-key, then exit; a device in service mode exits 0 "
                        "(default: none)")
    p.add_argument("--report-dir", default=None, metavar="DIR",
                   help="write results.json, accuracy.png, threshold_search.png (sketch strategies), bytes.png, "
                        "report.html and models/ (each trained model: ONNX, safetensors, models.json) here "
                        "(default: none)")
    p.add_argument("--serve-models", action="store_true",
                   help="after the run, keep serving its models: a device that says hello (fedsketch-client "
                        "--get-model) is placed from its sketch and sent its model (default: off)")
    p.add_argument("--serve-models-from", default=None, metavar="DIR",
                   help="train nothing: serve the models of an earlier run's export (REPORT_DIR/models) to the "
                        "devices that say hello (default: none)")
    p.add_argument("--serve-for", type=float, default=None, metavar="S",
                   help="with --serve-models or --serve-models-from: stop serving after S seconds (default: "
                        "until SIGTERM or Ctrl-C)")
    p.add_argument("--truth", default=None, metavar="JSON",
                   help="a JSON object client id -> true group (fedsketch-data split writes one): the final "
                        "clustering's ARI, AMI, completeness and homogeneity against it (default: none)")
    p.add_argument("--target-accuracy", type=float, default=0.8, metavar="A",
                   help="the report's rounds_to_target is the first round reaching it (default: %(default)s)")
