"""Every FedSketch strategy as a Flower strategy (Flower's Message API, ``flwr.serverapp``).

:class:`FlowerStrategy` wraps any :class:`server_kit.strategies.base.Strategy`
object and drives it through a Flower ``Grid`` with the hooks the MQTT
orchestrator and the simulator call, in the same order:

1. ``query.fedsketch_hello`` to every node: its cid and sample counts
   (:meth:`Strategy.setup`);
2. if the method clusters before training, ``query.fedsketch_sketch``: the
   node's ONNX sketch or float summary (:meth:`Strategy.on_sketches`);
3. per round, :meth:`Strategy.configure_round` picks the nodes (per-cluster
   sampling) and the models each gets (its cluster's, or IFCA's K): one
   ``train.fedsketch`` message per node; the replies are checked and handed
   to :meth:`Strategy.aggregate` (screening, streaming FedAvg per cluster);
4. ``evaluate.fedsketch`` to the round's nodes, each with its own model.

Nodes that appear later (a SuperNode that connects mid-run) are greeted at
the start of the next round and placed with :meth:`Strategy.assign_late` (the
nearest centroid of their sketch for ours). Bytes are counted from Flower's
own messages: the serialised size of every object a message carries.

No strategy is rewritten for Flower; what the adapter cannot carry it refuses
when it is built (:func:`check_carry`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from flwr.serverapp.strategy import Strategy as FlwrStrategy

from edge_sdk.compress.update_codec import compression_for
from edge_sdk.flower import EVALUATE, TRAIN
from edge_sdk.flower import records as rec
from edge_sdk.protocol import ProtocolError

from ..metrics import CommLedger, clustering_scores
from ..rounds.pace import Pace
from ..rounds.recorded import RecordedIntake
from ..rounds.round_wait import CloseReason, RoundClose
from ..rounds.training import OpenRound, TrainingRound
from ..strategies.base import ClientInfo, Strategy
from .wire import message_bytes

__all__ = ["FlowerStrategy", "check_carry"]

log = logging.getLogger(__name__)


def check_carry(strategy: Any, *, flip_prob: float, num_rounds: int | None = None) -> None:
    """Refuse, with a clear message, a strategy or setting the Flower adapter cannot carry."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"FlowerStrategy wraps a FedSketch Strategy (server_kit.strategies), got "
                        f"{type(strategy).__name__}; FedCRef has its own protocol and runs over MQTT only")
    if strategy.capabilities.pretrain is not None:
        raise ValueError(f"strategy {strategy.name!r} pre-trains its autoencoder with the devices "
                         "(pretrain=...), which the Flower adapter does not carry; give the nodes a "
                         "ready ONNX encoder (strategy 'fedsketch') or run it over MQTT")
    for comp in (strategy.compress_up, strategy.versions.compression):
        compression_for(comp, "compression is carried over MQTT only: Flower's ArrayRecords "
                        "move whole float32 arrays both ways, and its nodes keep no model version between rounds; "
                        "build the strategy with compression='none' for Flower", "the Flower adapter")
    if strategy.capabilities.follows_drift:
        raise ValueError("follow_drift needs devices that send a sketch unasked when their data changes; "
                         "Flower nodes only answer the server, so the Flower adapter does not carry it")
    if not 0.0 <= float(flip_prob) < 0.5:
        raise ValueError(f"flip_prob must be in [0, 0.5), got {flip_prob!r}")
    if num_rounds is not None and (isinstance(num_rounds, bool) or not isinstance(num_rounds, int)
                                   or num_rounds < 1):
        raise ValueError(f"num_rounds must be a positive integer, got {num_rounds!r}")


class FlowerStrategy(FlwrStrategy):
    """A FedSketch strategy driven by Flower.

    Parameters
    ----------
    strategy : Strategy
        Any strategy of :mod:`server_kit.strategies` (``make_strategy(name, ...)``).
    architecture : str
        The classifier's key in :data:`edge_sdk.training.nets.ARCHITECTURES`.
    num_classes : int
        Classes of the federation.
    flip_prob : float
        P of the nodes' sketches.
    seed : int
        Seed of the initial model (as :class:`server_kit.drivers.Simulator`).
    truth : mapping of cid to group, optional
        True groups, to score the clusters (ARI) in :meth:`report`.
    on_round : callable, optional
        Called with each round's record (a dict) once it is evaluated.
    min_nodes : int
        Nodes to wait for before greeting them (Flower's ``min_available_nodes``): a
        ServerApp may start before its SuperNodes, simulated or real, have connected.
    """

    def __init__(self, strategy: Strategy, *, architecture: str, num_classes: int = 10, flip_prob: float = 0.1,
                 seed: int = 0, truth: Mapping[str, int] | None = None,
                 on_round: Callable[[dict[str, Any]], None] | None = None, min_nodes: int = 2) -> None:
        check_carry(strategy, flip_prob=flip_prob)
        if isinstance(min_nodes, bool) or not isinstance(min_nodes, int) or min_nodes < 1:
            raise ValueError(f"min_nodes must be a positive integer, got {min_nodes!r}")
        self.min_nodes = min_nodes
        self.strategy = strategy
        self.architecture = architecture
        self.num_classes = int(num_classes)
        self.flip_prob = float(flip_prob)
        self.seed = int(seed)
        self.truth = dict(truth or {})
        self.on_round = on_round
        self.node_of: dict[str, int] = {}
        self.cid_of: dict[int, str] = {}
        self.ledger = CommLedger()
        self.rejected: Counter[str] = Counter()
        self.rounds: list[dict[str, Any]] = []
        self.spec: dict[str, tuple[tuple[int, ...], str]] = {}
        self.latent_dim: int | None = None
        self.seconds_clustering = 0.0
        self.bytes_before_training = 0
        self._grid: Grid | None = None
        self._timeout = 3600.0
        self._tasks: dict[str, Any] = {}
        self._round_t0 = 0.0
        self._summary: dict[str, Any] = {}
        self._placed: set[str] = set()
        #: The rounds: planned and combined by the one TrainingRound; Flower's Grid sends and waits.
        self._intake = RecordedIntake()
        self._training = TrainingRound(strategy, self._intake, _GridPort(lambda: self._placed), Pace())
        self._open: OpenRound | None = None

    # -- Flower's strategy interface -------------------------------------------
    def summary(self) -> None:
        log.info("FedSketch strategy %r through Flower: architecture %s, %d classes, P = %g",
                 self.strategy.name, self.architecture, self.num_classes, self.flip_prob)

    def start(self, grid: Grid, initial_arrays: ArrayRecord | None = None, num_rounds: int = 3,
              timeout: float = 3600, train_config: ConfigRecord | None = None,
              evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Greet the nodes, cluster before training if the method does, then Flower's round loop."""
        from edge_sdk.training.trainer import initial_weights

        check_carry(self.strategy, flip_prob=self.flip_prob, num_rounds=num_rounds)
        self._grid, self._timeout = grid, float(timeout)
        t0 = time.perf_counter()
        infos = self._greet(self._wait_for_nodes(grid))
        if not infos:
            raise RuntimeError("no Flower node answered the hello: nothing to train")
        template = (initial_weights(self.architecture, self.seed) if initial_arrays is None
                    else rec.record_weights(initial_arrays))
        self.spec = {k: (tuple(v.shape), str(v.dtype)) for k, v in template.items()}
        self.strategy.setup(infos, template)
        self._placed = set(self.node_of)
        if self.strategy.capabilities.needs_sketches:
            summaries = self._summaries(sorted(self.node_of))
            self._placed = set(summaries)
            self.strategy.on_sketches(summaries)
        self.seconds_clustering = time.perf_counter() - t0
        self.bytes_before_training = self.ledger.total()
        log.info("%d nodes registered; %s before training: %d bytes, %.1f s", len(self.node_of),
                 self.strategy.name, self.bytes_before_training, self.seconds_clustering)
        return super().start(grid, self.models_record(), num_rounds, timeout, train_config, evaluate_config,
                             evaluate_fn)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Late nodes are placed, then the strategy's tasks: one message per node with its own models."""
        self._round_t0 = time.perf_counter()
        self._admit_late(grid)
        self._open = self._training.open(server_round, sorted(self._placed))
        tasks = self._open.tasks
        self._tasks = {t.cid: t for t in tasks}
        cache: dict[str, ArrayRecord] = {}  # each model serialised once this round
        messages = [Message(rec.write_task(t, self.architecture, cache), dst_node_id=self.node_of[t.cid],
                            message_type=TRAIN) for t in tasks]
        self._count("TRAIN", "down", messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Check each reply, then :meth:`Strategy.aggregate` the updates in the order the tasks were made."""
        got = {}
        for cid, msg in self._from_nodes("update", replies):
            try:
                u = rec.read_update(cid, msg.content, self.spec)
                task = self._tasks.get(cid)
                if task is None or u.round != server_round or u.model_key not in task.models:
                    raise ProtocolError("wrong-model", f"update for round {u.round}, model {u.model_key!r}; this "
                                                       f"node was sent {sorted(task.models) if task else []}")
                got[cid] = u
            except ProtocolError as e:
                self._reject(e.reason, cid, str(e))
                if self._open is not None:
                    self._open.wait.refuse(cid, e.reason)
        if self._open is None or self._open.round != server_round:
            raise RuntimeError(f"aggregate_train for round {server_round}, which configure_train did not open")
        wait = self._open.wait
        for cid in self._tasks:  # in the order the tasks were made
            if cid in got:
                self._intake.updates[cid] = got[cid]
                wait.answer("update", cid)
        close = RoundClose(CloseReason.ALL_ANSWERED if not wait.left else CloseReason.DEADLINE, wait.elapsed(),
                           wait.goal_s, frozenset())
        report = self._training.finish(self._open, close)
        self._summary = dict(report.summary)
        self._summary["updates"] = report.updates
        return self.models_record(), _metrics(self._summary)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """The round's nodes evaluate the model the strategy now gives each (:meth:`Strategy.model_key_for`)."""
        messages = []
        cache: dict[str, ArrayRecord] = {}
        for cid in self._tasks:
            key = self.strategy.model_key_for(cid)
            weights = self.strategy.models[key]
            messages.append(Message(rec.write_evaluate(server_round, key, weights, self.architecture, cache),
                                    dst_node_id=self.node_of[cid], message_type=EVALUATE))
        self._count("EVALUATE", "down", messages)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Mean accuracy over the round's nodes, overall and per model; the round's record."""
        per_model: dict[str, list[float]] = {}
        accs = []
        for cid, msg in self._from_nodes("metrics", replies):
            try:
                key, m = rec.read_evaluation(msg.content)
            except ProtocolError as e:
                self._reject(e.reason, cid, str(e))
                continue
            accs.append(m["accuracy"])
            per_model.setdefault(key, []).append(m["accuracy"])
        acc = float(np.mean(accs)) if accs else float("nan")
        record = {"round": server_round, "accuracy": acc, "sampled": len(self._tasks),
                  "evaluated": len(accs), "cluster_accuracy": {k: float(np.mean(v)) for k, v in per_model.items()},
                  "summary": dict(self._summary), "seconds": time.perf_counter() - self._round_t0,
                  "bytes_total": self.ledger.total()}
        self.rounds.append(record)
        log.info("%s round %d: %d nodes, mean accuracy %.4f, %d bytes so far", self.strategy.name, server_round,
                 len(self._tasks), acc, record["bytes_total"])
        if self.on_round is not None:
            self.on_round(record)
        return MetricRecord({"accuracy": acc, "clusters": len(set(self.strategy.clusters().values()))})

    # -- what a run did ------------------------------------------------------
    def models_record(self) -> ArrayRecord:
        """Every model of the strategy, keyed ``<model key>/<tensor name>`` (Flower's ``Result.arrays``)."""
        return rec.weights_record({f"{k}/{n}": v for k, w in sorted(self.strategy.models.items())
                                   for n, v in w.items()})

    def report(self) -> dict[str, Any]:
        """The run as plain JSON: rounds, clusters (and ARI against ``truth``), bytes, refusals."""
        assignment = self.strategy.clusters()
        out: dict[str, Any] = {
            "strategy": self.strategy.name, "nodes": len(self.node_of), "rounds": self.rounds,
            "assignment": dict(sorted(assignment.items())), "bytes": self.ledger.as_dict(),
            "bytes_total": self.ledger.total(), "bytes_before_training": self.bytes_before_training,
            "seconds_clustering": self.seconds_clustering, "rejected": dict(self.rejected),
            "final_accuracy": _final(self.rounds)}
        known = [c for c in sorted(assignment) if c in self.truth]
        if known:
            out["scores"] = clustering_scores([self.truth[c] for c in known], [assignment[c] for c in known])
            out["ari"] = out["scores"]["ari"]
        return out

    # -- the phases before training ------------------------------------------
    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        """The connected nodes once at least ``min_nodes`` are (polling, up to the run's timeout)."""
        deadline = time.monotonic() + self._timeout
        while True:
            ids = sorted(grid.get_node_ids())
            if len(ids) >= self.min_nodes:
                return ids
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(ids)} Flower nodes connected within {self._timeout:g} s; "
                                   f"this run waits for min_nodes = {self.min_nodes}")
            time.sleep(0.5)

    def _greet(self, node_ids: list[int]) -> list[ClientInfo]:
        """Ask ``node_ids`` who they are; the nodes that answered well, as ClientInfo."""
        if not node_ids:
            return []
        msgs = [Message(RecordDict({"config": ConfigRecord({"architecture": self.architecture})}),
                        dst_node_id=n, message_type=rec.HELLO) for n in node_ids]
        infos = []
        for msg in self._send("HELLO", msgs):
            node = msg.metadata.src_node_id
            if msg.has_error():
                self._reject("node-error", f"node {node}", f"hello: {msg.error.code} {msg.error.reason}")
                continue
            try:
                hello = rec.read_hello(msg.content)
            except ProtocolError as e:
                self._reject(e.reason, f"node {node}", str(e))
                continue
            cid = hello["cid"]
            if cid in self.node_of and self.node_of[cid] != node:
                self._reject("duplicate-id", f"node {node}", f"cid {cid!r} is already node {self.node_of[cid]}")
                continue
            self.node_of[cid], self.cid_of[node] = node, cid
            infos.append(ClientInfo(cid, hello["n_samples"], hello["classes_present"], tuple(hello["capabilities"])))
        return infos

    def _summaries(self, cids: list[str]) -> dict[str, Any]:
        """Each node's sketch (or float summary) of the kind the strategy asks for, checked."""
        s = self.strategy
        content = rec.sketch_request(self.num_classes, self.flip_prob, s.capabilities.summary_kind, s.capabilities.summary_params)
        msgs = [Message(content, dst_node_id=self.node_of[c], message_type=rec.SKETCH) for c in cids]
        out: dict[str, Any] = {}
        kind = "SKETCH" if s.capabilities.summary_kind == "sketch" else "FEATURES"
        for cid, msg in self._from_nodes(kind, self._send(kind, msgs)):
            try:
                if s.capabilities.summary_kind == "sketch":
                    sk = rec.read_sketch(msg.content, num_classes=self.num_classes, latent_dim=self.latent_dim)
                    self.latent_dim = sk.latent_dim  # the first sketch fixes the shape the others must have
                    out[cid] = sk
                else:
                    out[cid] = rec.read_features(msg.content, s.capabilities.summary_kind, self.num_classes)
            except ProtocolError as e:
                self._reject(e.reason, cid, str(e))
        return out

    def _admit_late(self, grid: Grid) -> None:
        """Nodes that connected since the last round, and nodes not placed yet: summarised if need be, placed."""
        new = sorted(n for n in grid.get_node_ids() if n not in self.cid_of)
        infos = {i.cid: i for i in self._greet(new)} if new else {}
        waiting = sorted(set(self.node_of) - self._placed)
        if not waiting:
            return
        summaries = self._summaries(waiting) if self.strategy.capabilities.needs_sketches else dict.fromkeys(waiting)
        for cid, summary in summaries.items():
            key = self.strategy.assign_late(cid, summary, infos.get(cid, self.strategy.clients.get(cid)))
            self._placed.add(cid)
            log.info("late node %s (%s) joins model %s", self.node_of[cid], cid, key)

    # -- messages --------------------------------------------------------------
    def _send(self, kind: str, messages: list[Message]) -> list[Message]:
        assert self._grid is not None
        self._count(kind if kind == "HELLO" else "CMD", "down", messages)
        replies = list(self._grid.send_and_receive(messages, timeout=self._timeout))
        self._count(kind, "up", [m for m in replies if m.has_content()])
        return replies

    def _from_nodes(self, kind: str, replies: Iterable[Message]) -> Iterable[tuple[str, Message]]:
        """(cid, reply) of each reply with content from a registered node; errors counted and logged."""
        for msg in replies:
            node = msg.metadata.src_node_id
            cid = self.cid_of.get(node)
            if cid is None:
                self._reject("unknown-client", f"node {node}", f"{kind} reply from a node that never said hello")
            elif msg.has_error():
                self._reject("node-error", cid, f"{kind}: {msg.error.code} {msg.error.reason}")
            else:
                if kind in ("update", "metrics"):
                    self.ledger.add("UPDATE" if kind == "update" else "METRICS", "up", message_bytes(msg))
                yield cid, msg

    def _count(self, kind: str, direction: str, messages: Iterable[Message]) -> None:
        for m in messages:
            self.ledger.add(kind, direction, message_bytes(m))

    def _reject(self, reason: str, who: str, detail: str) -> None:
        self.rejected[reason] += 1
        log.warning("refused from %s (%s): %s", who, reason, detail)


class _GridPort:
    """The round's port under Flower: its Grid sends the tasks and waits for the replies, not the round."""

    def __init__(self, placed: Callable[[], set[str]]) -> None:
        self.placed = placed

    def online_ids(self) -> set[str]:
        return self.placed()

    def send(self, rnd: int, tasks: Any) -> tuple[int, dict[str, int]]:
        raise RuntimeError("under Flower the Grid sends a round's tasks (configure_train)")

    def wait(self, rnd: int, wait: Any) -> RoundClose:
        raise RuntimeError("under Flower the Grid waits for a round's replies (aggregate_train)")

    def remote(self) -> None:
        return None

    def bench(self, cid: str, reason: str) -> None:
        return None  # Flower chooses its nodes: nothing to bench


def _metrics(summary: Mapping[str, Any]) -> MetricRecord:
    """A summary's numbers as Flower's MetricRecord (for Flower's own log and Result)."""
    return MetricRecord({k: float(v) for k, v in summary.items()
                         if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)
                         and np.isfinite(float(v))})


def _final(rounds: list[dict[str, Any]]) -> float | None:
    """Mean accuracy of the last 5 rounds (the paper's final accuracy, as the simulator's)."""
    from ..metrics import final_accuracy

    return final_accuracy([r["accuracy"] for r in rounds])
