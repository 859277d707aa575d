"""The device side of FedSketch in Flower: a ``ClientApp`` that sketches with ONNX Runtime, trains and evaluates.

A node answers the four FedSketch message types of :mod:`edge_sdk.flower.records`
with the same :class:`~edge_sdk.worker.LocalWorker` a device runs behind the
MQTT client: its sketch through ONNX Runtime (no torch needed), local
training with FedSketch's trainer (torch) or the user's own function, and
evaluation (ONNX Runtime where torch is missing).

The actions are namespaced (``train.fedsketch``, ``query.fedsketch_sketch``,
...), so FedSketch joins an existing Flower app without touching its own
``@app.train()``::

    from flwr.clientapp import ClientApp
    from edge_sdk.flower import NodeData, add_fedsketch

    app = ClientApp()                       # the app you have

    def load(context):                      # your data for this node
        x, y = my_partition(context.node_config["partition-id"])
        return NodeData(cid=f"node-{context.node_config['partition-id']}", x=x, y=y)

    add_fedsketch(app, load, encoder="digits_encoder")

Seeds: the node's flip key and shuffling seed are ``seed * 1000 + index``
(``seed`` from the run config, ``index`` from :class:`NodeData`), as in
:class:`server_kit.drivers.Simulator`, so a Flower run and a simulator run
of the same partition sketch and train alike.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.clientapp import ClientApp

from ..sketch import Sketcher
from ..tasks import Task, TrainSettings, Update
from ..worker import LocalWorker
from . import records as rec

__all__ = ["EVALUATE", "TRAIN", "NodeData", "TrainFn", "add_fedsketch", "client_app"]

log = logging.getLogger(__name__)

#: FedSketch's train and evaluate message types (namespaced actions).
TRAIN = "train.fedsketch"
EVALUATE = "evaluate.fedsketch"

#: A user's local training: ``(weights, data, settings, seed) -> new weights`` or ``(new weights, loss)``.
TrainFn = Callable[[dict[str, np.ndarray], "NodeData", TrainSettings, Union[int, None]], Any]


@dataclass(frozen=True)
class NodeData:
    """One node's local data, as a ``load(context)`` function returns it.

    ``index`` seeds the node (its flip key and shuffling: ``seed * 1000 + index``);
    the partition id is the natural choice.
    """

    cid: str
    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray | None = None
    y_test: np.ndarray | None = None
    index: int = 0


class _Node:
    """What a ClientApp process keeps per node: the worker and the sketcher, built once."""

    def __init__(self, load: Callable[[Context], NodeData], *, encoder: Any, num_classes: int, seed: int | None,
                 train_fn: TrainFn | None, selection: str) -> None:
        self.load = load
        self.encoder_spec = encoder
        self.num_classes = int(num_classes)
        self.seed = seed
        self.train_fn = train_fn
        self.selection = selection
        self._encoders: dict[str, Any] = {}
        self._nodes: dict[tuple[int, int], tuple[NodeData, LocalWorker]] = {}
        self._sketchers: dict[tuple[int, int, float], Sketcher] = {}

    def _seed(self, context: Context) -> int:
        return int(self.seed if self.seed is not None else context.run_config.get("seed", 0))

    def worker(self, context: Context) -> tuple[NodeData, LocalWorker]:
        """This node's data and worker (IFCA's selection counter restored from the node's state)."""
        key = (context.run_id, context.node_id)
        if key not in self._nodes:
            data = self.load(context)
            if not isinstance(data, NodeData):
                raise TypeError(f"load(context) must return a NodeData, got {type(data).__name__}")
            w = LocalWorker(data.cid, data.x, data.y, data.x_test, data.y_test, num_classes=self.num_classes,
                            seed=self._seed(context) * 1000 + data.index, selection=self.selection)
            self._nodes[key] = (data, w)
        data, w = self._nodes[key]
        state = context.state.get("fedsketch")
        w._calls = int(state["calls"]) if isinstance(state, ConfigRecord) and "calls" in state else 0
        return data, w

    def _save(self, context: Context, w: LocalWorker) -> None:
        context.state["fedsketch"] = ConfigRecord({"calls": int(w._calls)})

    def hello(self, msg: Message, context: Context) -> Message:
        data, w = self.worker(context)
        return Message(rec.write_hello(data.cid, w.hello()), reply_to=msg)

    def sketch(self, msg: Message, context: Context) -> Message:
        """The node's sketch (ONNX Runtime encoder, its own flip key), or the float summary asked for."""
        data, w = self.worker(context)
        ask = rec.read_sketch_request(msg.content)
        if ask["num_classes"] != self.num_classes:
            raise ValueError(f"the server asks for {ask['num_classes']} classes; this node has {self.num_classes}")
        if ask["summary"] != "sketch":
            from ..features import SUMMARIES

            if ask["summary"] not in SUMMARIES:
                raise ValueError(f"unknown summary kind {ask['summary']!r}; this node knows {sorted(SUMMARIES)}")
            feats = SUMMARIES[ask["summary"]](w.x, w.y, num_classes=self.num_classes, **ask["params"])
            return Message(rec.write_features(ask["summary"], feats), reply_to=msg)
        key = (context.run_id, context.node_id, ask["flip_prob"])
        if key not in self._sketchers:
            self._sketchers[key] = Sketcher(self.encoder(context), self.num_classes, ask["flip_prob"],
                                            seed=self._seed(context) * 1000 + data.index)
        return Message(rec.write_sketch(w.sketch(self._sketchers[key])), reply_to=msg)

    def encoder(self, context: Context) -> Any:
        """The ONNX encoder: the one given, or loaded by name or path (a function of the run config's choice)."""
        spec = self.encoder_spec
        if callable(spec) and not hasattr(spec, "encode"):
            spec = spec(context.run_config)
        if not isinstance(spec, str):
            return spec
        if spec not in self._encoders:
            from ..encoder import OnnxEncoder

            self._encoders[spec] = OnnxEncoder(spec)
        return self._encoders[spec]

    def train(self, msg: Message, context: Context) -> Message:
        data, w = self.worker(context)
        task, architecture = rec.read_task(data.cid, msg.content)
        w.architecture = architecture
        update = w.fit(task) if self.train_fn is None else self._user_fit(w, data, task, context)
        self._save(context, w)
        return Message(rec.write_update(update), reply_to=msg)

    def _user_fit(self, w: LocalWorker, data: NodeData, task: Task, context: Context) -> Update:
        """The user's training function on the model the node picks (IFCA: lowest loss on a batch)."""
        w._calls += 1
        key = w.select(task.models, task.settings.batch_size)
        seed = None if w.seed is None else w.seed * 100_003 + task.round
        out = self.train_fn(dict(task.models[key]), data, task.settings, seed)
        weights, loss = out if isinstance(out, tuple) else (out, float("nan"))
        if not isinstance(weights, Mapping):
            raise TypeError(f"train_fn must return the new weights (a dict of arrays), got {type(weights).__name__}")
        return Update(data.cid, task.round, key, {k: np.asarray(v) for k, v in weights.items()}, len(w.y),
                      float(loss))

    def evaluate(self, msg: Message, context: Context) -> Message:
        _, w = self.worker(context)
        rnd, key, weights, architecture = rec.read_evaluate(msg.content)
        w.architecture = architecture
        return Message(rec.write_evaluation(rnd, key, w.evaluate(weights)), reply_to=msg)


def add_fedsketch(app: ClientApp, load: Callable[[Context], NodeData], *, encoder: Any = "digits_encoder",
                  num_classes: int = 10, seed: int | None = None, train_fn: TrainFn | None = None,
                  selection: str = "onnx") -> ClientApp:
    """Register FedSketch's four handlers on an existing ``ClientApp``; returns it.

    Parameters
    ----------
    app : ClientApp
        The app to extend; its own handlers stay (FedSketch's actions are namespaced).
    load : callable
        ``load(context) -> NodeData``: this node's data, called once per node and run in each process.
    encoder : str, encoder or callable
        The ONNX encoder the node sketches with: a shipped artifact name, a path, an
        :class:`edge_sdk.encoder.OnnxEncoder`, or a function of the run config returning one of these.
    num_classes : int
        Classes of the federation.
    seed : int, optional
        Seed of the nodes (default: the run config's ``seed``, else 0).
    train_fn : callable, optional
        Local training (:data:`TrainFn`); default FedSketch's trainer (torch).
    selection : {"onnx", "torch"}
        Runtime of IFCA's model choice (see :class:`edge_sdk.worker.LocalWorker`).
    """
    if not callable(load):
        raise TypeError(f"load must be a function of the node's context, got {type(load).__name__}")
    if selection not in ("onnx", "torch"):
        raise ValueError(f"selection must be 'onnx' or 'torch', got {selection!r}")
    node = _Node(load, encoder=encoder, num_classes=num_classes, seed=seed, train_fn=train_fn, selection=selection)
    app.query(rec.HELLO.split(".")[1])(node.hello)
    app.query(rec.SKETCH.split(".")[1])(node.sketch)
    app.train(TRAIN.split(".")[1])(node.train)
    app.evaluate(EVALUATE.split(".")[1])(node.evaluate)
    return app


def client_app(load: Callable[[Context], NodeData], **kw: Any) -> ClientApp:
    """A new ``ClientApp`` with FedSketch's handlers (:func:`add_fedsketch` takes the same arguments)."""
    return add_fedsketch(ClientApp(), load, **kw)
