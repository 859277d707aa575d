"""A Flower ``ServerApp`` that runs any FedSketch strategy, configured by the run config.

The run config (``[tool.flwr.app.config]`` of the app's ``pyproject.toml``,
or ``flwr run --run-config``) names the method and its settings:

=====================  =========================================================  ===============
key                    meaning                                                    default
=====================  =========================================================  ===============
``strategy``           a name of :data:`server_kit.strategies.REGISTRY`           ``fedsketch``
``num-server-rounds``  rounds of training                                         3
``architecture``       the classifier (:data:`edge_sdk.training.nets.ARCHITECTURES`)       required
``fraction``           share of each cluster's nodes trained per round            1.0
``local-epochs``,      local training settings                                    1, 0.001, 32
``lr``, ``batch-size``
``seed``               seed of the model, the sampling and the nodes              0
``flip-prob``          P of the sketches                                          0.1
``num-classes``        classes of the federation                                  10
``timeout``            seconds to wait for the nodes' replies per phase           3600
``min-nodes``          nodes to wait for before starting                          2
``report``             a JSON file the run's report is written to                 none
``strategy-params``    the strategy's parameters, TOML inline-table syntax:       ""
                       ``"k = 4"`` for IFCA, ``"min_cluster_size = 5"`` for ours
``set.<name>``         one parameter of the strategy (``set.k = 4``), for apps     the strategy's
                       that declare it
=====================  =========================================================  ===============

(``flwr run --run-config`` overrides only keys the app's ``pyproject.toml``
declares, hence one ``strategy-params`` string for any strategy's parameters.)

Other keys (the data's folder, say) are the app's own and are left alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from .strategy import FlowerStrategy

__all__ = ["FlowerRunConfig", "build_strategy", "run", "server_app"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowerRunConfig:
    """The run config's FedSketch keys, checked."""

    architecture: str
    strategy: str = "fedsketch"
    rounds: int = 3
    fraction: float = 1.0
    epochs: int = 1
    lr: float = 1e-3
    batch_size: int = 32
    seed: int = 0
    flip_prob: float = 0.1
    num_classes: int = 10
    timeout: float = 3600.0
    min_nodes: int = 2
    report: str = ""
    params: Mapping[str, Any] = field(default_factory=dict)

    _KEYS = {"strategy": ("strategy", str), "num-server-rounds": ("rounds", int), "fraction": ("fraction", float),
             "local-epochs": ("epochs", int), "lr": ("lr", float), "batch-size": ("batch_size", int),
             "seed": ("seed", int), "flip-prob": ("flip_prob", float), "num-classes": ("num_classes", int),
             "timeout": ("timeout", float), "min-nodes": ("min_nodes", int), "report": ("report", str), "architecture": ("architecture", str)}

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FlowerRunConfig:
        """Read the FedSketch keys of a Flower run config; a ValueError names a missing or mistyped one."""
        kw: dict[str, Any] = {}
        for key, (name, kind) in cls._KEYS.items():
            if key not in run_config:
                continue
            v = run_config[key]
            ok = isinstance(v, kind) or (kind is float and isinstance(v, int))
            if isinstance(v, bool) or not ok:
                raise ValueError(f"run config {key!r} must be a {kind.__name__}, got {v!r}")
            kw[name] = kind(v)
        if "architecture" not in kw:
            raise ValueError("run config lacks 'architecture' (the classifier, e.g. digits_cnn_1x8x8_10)")
        kw["params"] = {**_toml_params(run_config.get("strategy-params", "")),
                        **{k[len("set."):]: v for k, v in run_config.items() if k.startswith("set.")}}
        return cls(**kw)


def _toml_params(text: object) -> dict[str, Any]:
    """``"k = 4, min_cluster_size = 2"`` (a TOML inline table's body) as a dict; a ValueError if it is not."""
    if not isinstance(text, str):
        raise ValueError(f"run config 'strategy-params' must be a str, got {text!r}")
    if not text.strip():
        return {}
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    try:
        return dict(tomllib.loads(f"p = {{{text}}}")["p"])
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"run config 'strategy-params' is not TOML key = value pairs ({e}): {text!r}") from None


def build_strategy(cfg: FlowerRunConfig, truth: Mapping[str, int] | None = None,
                   on_round: Callable[[dict[str, Any]], None] | None = None) -> FlowerStrategy:
    """The adapter around ``make_strategy(cfg.strategy, ...)``: a bad name or setting raises here."""
    from edge_sdk.tasks import TrainSettings

    from ..strategies import make_strategy

    settings = TrainSettings(epochs=cfg.epochs, lr=cfg.lr, batch_size=cfg.batch_size)
    params = dict(cfg.params)
    if cfg.strategy in ("fedsketch", "fedsketch-fedae"):
        params.setdefault("flip_prob", cfg.flip_prob)
    inner = make_strategy(cfg.strategy, settings=settings, fraction=cfg.fraction, seed=cfg.seed,
                          architecture=cfg.architecture, **params)
    return FlowerStrategy(inner, architecture=cfg.architecture, num_classes=cfg.num_classes,
                          flip_prob=cfg.flip_prob, seed=cfg.seed, truth=truth, on_round=on_round,
                          min_nodes=cfg.min_nodes)


def run(grid: Grid, context: Context, *, truth: Callable[[Context], Mapping[str, int]] | None = None,
        defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A whole FedSketch run on ``grid``; its report (written to the ``report`` file if set).

    ``defaults`` are run-config keys the context's run config overrides.
    """
    _log_through_flower()
    cfg = FlowerRunConfig.from_run_config({**dict(defaults or {}), **dict(context.run_config)})
    adapter = build_strategy(cfg, truth(context) if truth is not None else None)
    adapter.start(grid, num_rounds=cfg.rounds, timeout=cfg.timeout)
    report = adapter.report()
    report["config"] = {k: v for k, v in vars(cfg).items() if k != "params"} | {"params": dict(cfg.params)}
    if cfg.report:
        from ..report.results import write_json

        log.info("report written to %s", write_json(cfg.report, report))
    _print(report)
    return report


def _log_through_flower() -> None:
    """FedSketch's server log lines (rounds, refusals, late nodes) through Flower's handlers, as its own."""
    ours, flwr_log = logging.getLogger("server_kit"), logging.getLogger("flwr")
    if flwr_log.handlers and not ours.handlers:
        for h in flwr_log.handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


def _print(report: Mapping[str, Any]) -> None:
    """The run in a few lines, for ``flwr run --stream``."""
    acc = report.get("final_accuracy")
    clusters = len(set(report["assignment"].values()))
    ari = f", ARI {report['ari']:.3f}" if "ari" in report else ""
    print(f"FedSketch {report['strategy']}: {report['nodes']} nodes, {clusters} clusters{ari}, final accuracy "
          f"{'n/a' if acc is None else f'{acc:.4f}'}, {report['bytes_total']:,} bytes "
          f"({report['bytes_before_training']:,} before training), {sum(report['rejected'].values())} refused",
          flush=True)


def server_app(*, truth: Callable[[Context], Mapping[str, int]] | None = None,
               defaults: Mapping[str, Any] | None = None) -> ServerApp:
    """A ``ServerApp`` running the strategy its run config names (:class:`FlowerRunConfig`).

    ``truth(context)``, if given, returns the nodes' true groups to score the clusters (ARI);
    ``defaults`` are run-config keys the run config overrides.
    """
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run(grid, context, truth=truth, defaults=defaults)

    return app
