"""FedSketch's messages as Flower records: one layout, read and written by both sides.

Flower (the Message API) carries a ``RecordDict`` of ``ArrayRecord``,
``MetricRecord`` and ``ConfigRecord`` entries. FedSketch's server adapter
(:mod:`server_kit.flower`) and device side (:mod:`edge_sdk.flower.client_app`)
agree on these entries through this module only:

==========================  ===============================================  ========================================
message type                server -> node                                   node -> server
==========================  ===============================================  ========================================
``query.fedsketch_hello``   ``config``                                       ``hello``: cid, sample counts,
                                                                             capabilities
``query.fedsketch_sketch``  ``config``: num_classes, flip_prob, summary,     ``sketch``: {"body": the SKETCH body},
                            params (JSON)                                    or ``features`` and ``summary``
``train.fedsketch``         ``config``: round, architecture, settings;       ``update`` (ArrayRecord), ``result``:
                            ``model.<key>`` per offered model (IFCA: more)   model_key, round; ``metrics``
``evaluate.fedsketch``      ``config``: round, architecture, model_key;      ``metrics``: accuracy, loss,
                            ``model.<key>``                                  num-examples; ``result``
==========================  ===============================================  ========================================

The actions are namespaced, so FedSketch's handlers sit beside a Flower
app's own ``@app.train()`` and ``@app.evaluate()``.

A sketch travels as the very bytes of an MQTT SKETCH body
(:func:`edge_sdk.protocol.sketch_body`), so it is checked by the same
:func:`~edge_sdk.protocol.parse_sketch`; tensors are checked by
:func:`~edge_sdk.protocol.check_tensors` (names, shapes, dtypes, NaN). Flower
serialises arrays with ``numpy.save(allow_pickle=False)``: no pickle.

Readers raise :class:`edge_sdk.protocol.ProtocolError` (with a reason) on
anything malformed; the server counts and logs it and goes on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..protocol import (
    Kind,
    ProtocolError,
    check_features,
    check_id,
    check_tensors,
    parse_sketch,
    sketch_body,
)
from ..schema import check_fields
from ..sketch import Sketch
from ..tasks import Task, TrainSettings, Update

__all__ = [
    "HELLO",
    "SKETCH",
    "model_keys",
    "read_evaluate",
    "read_evaluation",
    "read_features",
    "read_hello",
    "read_model",
    "read_sketch",
    "read_sketch_request",
    "read_task",
    "read_update",
    "record_weights",
    "sketch_request",
    "weights_record",
    "write_evaluate",
    "write_evaluation",
    "write_features",
    "write_hello",
    "write_sketch",
    "write_task",
    "write_update",
]

#: Message types of the two queries (Flower's ``"query.<action>"``).
HELLO = "query.fedsketch_hello"
SKETCH = "query.fedsketch_sketch"
_MODEL = "model."


def _get(content: RecordDict, key: str, kind: type, what: str) -> Any:
    """Entry ``key`` of ``content``, of record type ``kind``; a ProtocolError naming ``what`` if absent."""
    rec = content.get(key) if hasattr(content, "get") else None
    if not isinstance(rec, kind):
        raise ProtocolError("meta", f"{what} lacks its {kind.__name__} {key!r}")
    return rec


def _field(rec: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = rec.get(key)
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        raise ProtocolError("meta", f"{what}: field {key!r} is {value!r}, expected {getattr(kind, '__name__', kind)}")
    return value


# -- tensors ----------------------------------------------------------------


def weights_record(weights: Mapping[str, np.ndarray]) -> ArrayRecord:
    """A model's named tensors as an ``ArrayRecord`` (numpy serialisation, no pickle)."""
    return ArrayRecord({name: Array(np.ascontiguousarray(v)) for name, v in weights.items()})


def record_weights(rec: ArrayRecord, spec: Mapping[str, tuple[tuple[int, ...], str]] | None = None
                   ) -> dict[str, np.ndarray]:
    """An ``ArrayRecord``'s tensors, checked against ``spec`` (names, shapes, dtypes) and for NaN/Inf."""
    try:
        arrays = {name: rec[name].numpy() for name in rec}
    except (TypeError, ValueError) as e:
        raise ProtocolError("tensors", f"arrays could not be read: {e}") from None
    return check_tensors(arrays, spec=spec)


def model_keys(content: RecordDict) -> list[str]:
    """The model keys a train or evaluate message offers (``model.<key>`` entries), sorted."""
    return sorted(k[len(_MODEL):] for k in content.keys() if k.startswith(_MODEL))


def read_model(content: RecordDict, key: str) -> dict[str, np.ndarray]:
    return record_weights(_get(content, _MODEL + key, ArrayRecord, f"model {key!r}"))


# -- hello ------------------------------------------------------------------


def write_hello(cid: str, hello: Mapping[str, Any]) -> RecordDict:
    """A node's registration (:meth:`edge_sdk.worker.LocalWorker.hello` and its cid)."""
    fields = {"cid": cid, "n_samples": int(hello["n_samples"]), "n_test": int(hello.get("n_test", 0)),
              "classes_present": int(hello["classes_present"]), "capabilities": list(hello.get("capabilities", [])),
              "version": str(hello.get("version", ""))}
    return RecordDict({"hello": ConfigRecord(fields)})


def read_hello(content: RecordDict) -> dict[str, Any]:
    """A node's registration, checked as an MQTT HELLO's meta is (:func:`edge_sdk.schema.check_fields`), and its cid."""
    rec = dict(_get(content, "hello", ConfigRecord, "hello"))
    cid = check_id(rec.pop("cid", None), "hello cid", reason="meta")
    return {"cid": cid, **check_fields(Kind.HELLO, rec)}


# -- sketches and features ---------------------------------------------------


def write_sketch(sketch: Sketch) -> RecordDict:
    return RecordDict({"sketch": ConfigRecord({"body": sketch_body(sketch)})})


def read_sketch(content: RecordDict, *, num_classes: int | None = None, latent_dim: int | None = None) -> Sketch:
    """A node's sketch, checked as an MQTT SKETCH body is (shape, length, padding bits)."""
    body = _field(_get(content, "sketch", ConfigRecord, "sketch reply"), "body", bytes, "sketch")
    return parse_sketch(body, num_classes=num_classes, latent_dim=latent_dim)


def write_features(kind: str, features: np.ndarray) -> RecordDict:
    return RecordDict({"features": weights_record({"features": np.asarray(features, dtype=np.float32)}),
                       "summary": ConfigRecord({"summary": kind})})


def read_features(content: RecordDict, kind: str, num_classes: int) -> np.ndarray:
    """A float summary (LADD's spectra) of the kind asked: as an MQTT FEATURES message is checked."""
    got = check_fields(Kind.FEATURES, _get(content, "summary", ConfigRecord, "features reply"))["summary"]
    if got != kind:
        raise ProtocolError("meta", f"summary {got!r} is not the {kind!r} this server asked for")
    return check_features(record_weights(_get(content, "features", ArrayRecord, "features reply")), (num_classes, None))


def sketch_request(num_classes: int, flip_prob: float, summary: str, params: Mapping[str, Any]) -> RecordDict:
    """The ``query.sketch`` content: what to summarise and how."""
    return RecordDict({"config": ConfigRecord({"num_classes": int(num_classes), "flip_prob": float(flip_prob),
                                               "summary": summary, "params": json.dumps(dict(params))})})


def read_sketch_request(content: RecordDict) -> dict[str, Any]:
    rec = _get(content, "config", ConfigRecord, "sketch request")
    try:
        params = json.loads(_field(rec, "params", str, "sketch request"))
    except ValueError as e:
        raise ProtocolError("meta", f"sketch request: params are not JSON: {e}") from None
    return {"num_classes": _field(rec, "num_classes", int, "sketch request"),
            "flip_prob": float(_field(rec, "flip_prob", (int, float), "sketch request")),
            "summary": _field(rec, "summary", str, "sketch request"),
            "params": params if isinstance(params, dict) else {}}


# -- tasks and updates -------------------------------------------------------


def write_task(task: Task, architecture: str, cache: dict[str, ArrayRecord] | None = None) -> RecordDict:
    """A train message: the round, the architecture, the settings and each offered model.

    ``cache`` (model key -> ArrayRecord), kept by the caller for one round, serialises each
    model once however many nodes get it.
    """
    content = RecordDict({"config": ConfigRecord({"round": int(task.round), "architecture": architecture,
                                                  "evaluate_first": bool(task.evaluate_first),
                                                  **task.settings.to_dict()})})
    for key, w in task.models.items():
        content[_MODEL + key] = _record(key, w, cache)
    return content


def _record(key: str, weights: Mapping[str, np.ndarray], cache: dict[str, ArrayRecord] | None) -> ArrayRecord:
    """Model ``key``'s ArrayRecord, from ``cache`` when it holds it (and into it)."""
    if cache is None:
        return weights_record(weights)
    if key not in cache:
        cache[key] = weights_record(weights)
    return cache[key]


def read_task(cid: str, content: RecordDict) -> tuple[Task, str]:
    """A train message as the :class:`~edge_sdk.tasks.Task` a worker fits, and the architecture."""
    rec = _get(content, "config", ConfigRecord, "train message")
    keys = model_keys(content)
    if not keys:
        raise ProtocolError("meta", "train message offers no model")
    try:
        settings = TrainSettings.from_dict(rec)
    except (TypeError, ValueError) as e:
        raise ProtocolError("meta", f"train message: bad settings: {e}") from None
    task = Task(cid, _field(rec, "round", int, "train message"), {k: read_model(content, k) for k in keys},
                settings, bool(rec.get("evaluate_first", True)))
    return task, _field(rec, "architecture", str, "train message")


def write_update(update: Update) -> RecordDict:
    metrics = {k: float(v) for k, v in update.metrics.items() if isinstance(v, (int, float))}
    metrics.update({"num-examples": int(update.n_samples), "loss": float(update.loss)})
    return RecordDict({"update": weights_record(update.weights), "metrics": MetricRecord(metrics),
                       "result": ConfigRecord({"model_key": update.model_key, "round": int(update.round)})})


def read_update(cid: str, content: RecordDict, spec: Mapping[str, tuple[tuple[int, ...], str]]) -> Update:
    """A node's update, checked as an MQTT UPDATE is: its fields by the schema, its tensors against ``spec``."""
    metrics = dict(_get(content, "metrics", MetricRecord, "update"))
    loss = {"loss": metrics.pop("loss")} if "loss" in metrics else {}
    m = check_fields(Kind.UPDATE, {**_get(content, "result", ConfigRecord, "update"), **loss,
                                   "n_samples": metrics.pop("num-examples", None), "metrics": metrics})
    weights = record_weights(_get(content, "update", ArrayRecord, "update"), spec)
    return Update(cid, m["round"], m["model_key"], weights, m["n_samples"], m.get("loss", float("nan")),
                  m["metrics"])


def write_evaluate(rnd: int, key: str, weights: Mapping[str, np.ndarray], architecture: str,
                   cache: dict[str, ArrayRecord] | None = None) -> RecordDict:
    """An evaluate message: the model ``key`` a node is evaluated with (``cache`` as in :func:`write_task`)."""
    return RecordDict({"config": ConfigRecord({"round": int(rnd), "architecture": architecture, "model_key": key}),
                       _MODEL + key: _record(key, weights, cache)})


def read_evaluate(content: RecordDict) -> tuple[int, str, dict[str, np.ndarray], str]:
    """An evaluate message: its round, model key, the model, the architecture."""
    rec = _get(content, "config", ConfigRecord, "evaluate message")
    key = _field(rec, "model_key", str, "evaluate message")
    return (_field(rec, "round", int, "evaluate message"), key, read_model(content, key),
            _field(rec, "architecture", str, "evaluate message"))


def write_evaluation(rnd: int, key: str, result: Mapping[str, float]) -> RecordDict:
    return RecordDict({"metrics": MetricRecord({"accuracy": float(result["accuracy"]), "loss": float(result["loss"]),
                                                "num-examples": int(result["n_test"])}),
                       "result": ConfigRecord({"model_key": key, "round": int(rnd)})})


def read_evaluation(content: RecordDict) -> tuple[str, dict[str, float]]:
    """The model key a node evaluated and its accuracy and loss, checked as MQTT METRICS are."""
    m = check_fields(Kind.METRICS, {**_get(content, "result", ConfigRecord, "evaluation"),
                                    **_get(content, "metrics", MetricRecord, "evaluation")})
    return m["model_key"], {"accuracy": float(m.get("accuracy", float("nan"))),
                            "loss": float(m.get("loss", float("nan")))}
