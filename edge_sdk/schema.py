"""The schema of every meta field FedSketch's main job sends, checked in one place on both sides.

An envelope's JSON meta is decoded by :func:`edge_sdk.protocol.decode_message`
with global limits (finite numbers, integers within +-2**53, at most
:data:`~edge_sdk.protocol.MAX_META_DEPTH` levels of nesting). This module
then checks each field a handler will read, by message kind (and by ``op``
for commands): its type, its range (rounds, counts, sizes, classes), string
lengths and list sizes. :func:`check_meta` returns a *clean* meta holding
only the declared fields, with their defaults filled in, so that a handler
never meets a surprise: ``int(m["round"])`` cannot raise, ``n_samples``
cannot be ``10**12``, ``lr`` cannot be infinite.

Unknown fields are dropped, not refused, so that a newer peer can add
information an older one ignores. A message whose fields break the schema
raises :class:`~edge_sdk.protocol.ProtocolError` with reason ``meta-field``
and a message naming the field, the rule and the value.

FedCRef's messages (``meta["type"]``) keep their own checks in their
handlers (:mod:`edge_sdk.fedcref.mqtt`, :mod:`server_kit.fedcref.mqtt`); the
global limits of the decoder apply to them too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .protocol import Kind, Message, ProtocolError, check_id

__all__ = ["COMMANDS", "MAX_COUNT", "MAX_ROUND", "Field", "check_fields", "check_meta"]

#: Largest sample or test count a device may claim.
MAX_COUNT = 2**31 - 1
#: Largest round number (the envelope's u32 field).
MAX_ROUND = 2**32 - 1
_REASON = "meta-field"


@dataclass(frozen=True)
class Field:
    """One meta field: its type, range and default.

    Parameters
    ----------
    kind : {"int", "float", "bool", "str", "id", "ids", "keys", "strs", "ints", "numbers", "object", "record"}
        ``id``: a topic-safe id (:func:`~edge_sdk.protocol.check_id`);
        ``ids`` / ``strs`` / ``ints``: lists of those / of strings / of
        integers within ``lo``, ``hi``; ``keys``: a list of model keys,
        each a topic-safe id or ``"+"`` (every model); ``numbers``: an object
        of finite numbers; ``object``: a JSON object (its nesting bounded by
        the decoder); ``record``: an object of declared sub-fields
        (``fields``), each checked as a field and named ``name.sub`` in a
        refusal, its unknown keys dropped.
    lo, hi : float, optional
        Inclusive range of a number.
    max_len : int
        Longest string, or most items of a list or object.
    required : bool
        Whether the field must be present.
    default : any
        Value filled in when the field is absent (``None``: left out).
    choices : tuple, optional
        The allowed values.
    fields : mapping, optional
        A ``record``'s sub-fields, by name.
    """

    kind: str
    lo: float | None = None
    hi: float | None = None
    max_len: int = 128
    required: bool = False
    default: Any = None
    choices: tuple[Any, ...] | None = None
    fields: Mapping[str, Field] | None = None


def _fail(name: str, rule: str, value: Any) -> ProtocolError:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return ProtocolError(_REASON, f"meta field {name!r} must be {rule}, got {text}")


def _number(name: str, f: Field, v: Any, integer: bool) -> int | float:
    what = "an integer" if integer else "a finite number"
    rng = f" in [{f.lo:g}, {f.hi:g}]" if f.lo is not None and f.hi is not None else ""
    ok_type = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok_type or (not integer and not math.isfinite(v)):
        raise _fail(name, what + rng, v)
    if (f.lo is not None and v < f.lo) or (f.hi is not None and v > f.hi):
        raise _fail(name, what + rng, v)
    return int(v) if integer else float(v)


def _string(name: str, f: Field, v: Any) -> str:
    if not isinstance(v, str) or len(v) > f.max_len:
        raise _fail(name, f"a string of at most {f.max_len} characters", v)
    return v


def _ident(name: str, v: Any) -> str:
    try:
        return check_id(v, f"meta field {name!r}", reason=_REASON)
    except ProtocolError:
        raise _fail(name, "a topic-safe id (1-64 bytes, no '/', '+', '#' or spaces)", v) from None


def _value(name: str, f: Field, v: Any) -> Any:
    k = f.kind
    if k == "int":
        out: Any = _number(name, f, v, True)
    elif k == "float":
        out = _number(name, f, v, False)
    elif k == "bool":
        if not isinstance(v, bool):
            raise _fail(name, "true or false", v)
        out = v
    elif k == "str":
        out = _string(name, f, v)
    elif k == "id":
        out = _ident(name, v)
    elif k == "ints":
        if not isinstance(v, list) or len(v) > f.max_len:
            raise _fail(name, f"a list of at most {f.max_len} integers", v)
        out = [_number(name, Field("int", f.lo, f.hi), x, True) for x in v]
    elif k == "keys":
        if not isinstance(v, list) or len(v) > f.max_len:
            raise _fail(name, f"a list of at most {f.max_len} model keys", v)
        out = [x if x == "+" else _ident(name, x) for x in v]
    elif k in ("ids", "strs"):
        if not isinstance(v, list) or len(v) > f.max_len:
            raise _fail(name, f"a list of at most {f.max_len} items", v)
        out = [_ident(name, x) if k == "ids" else _string(name, Field("str", max_len=128), x) for x in v]
    elif k == "numbers":
        if not isinstance(v, dict) or len(v) > f.max_len:
            raise _fail(name, f"an object of at most {f.max_len} numbers", v)
        out = {_string(name, Field("str", max_len=64), key): _number(f"{name}.{key}", Field("float"), x, False)
               for key, x in v.items()}
    elif k == "object":
        if not isinstance(v, dict) or len(v) > f.max_len or any(len(key) > 64 for key in v):
            raise _fail(name, f"an object of at most {f.max_len} entries with keys of at most 64 characters", v)
        out = dict(v)  # values: any JSON, nesting bounded by the decoder
    elif k == "record":
        if not isinstance(v, dict):
            raise _fail(name, "an object", v)
        out = _check(f.fields or {}, v, f"{name}.")
    else:  # pragma: no cover - a schema bug, not a peer's
        raise AssertionError(f"unknown field kind {k!r}")
    if f.choices is not None and out not in f.choices:
        raise _fail(name, f"one of {list(f.choices)}", v)
    return out


def _check(fields: Mapping[str, Field], meta: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    clean: dict[str, Any] = {}
    for name, f in fields.items():
        if name in meta:
            clean[name] = _value(prefix + name, f, meta[name])
        elif f.required:
            raise ProtocolError(_REASON, f"meta field {prefix + name!r} is missing")
        elif f.default is not None:
            clean[name] = f.default
    return clean


_ROUND = Field("int", 0, MAX_ROUND, required=True)
_COUNT = Field("int", 1, MAX_COUNT, required=True)
_EPOCHS = Field("int", 1, 10_000, default=1)
_LR = Field("float", 1e-12, 100.0, default=1e-3)
_BATCH = Field("int", 1, 1_000_000, default=32)
_MODEL_KEY = Field("id", required=True)
_ARCH = Field("str", max_len=128)
#: The model topics a device keeps subscribed to (``"+"``: every model), at most 64.
_FOLLOW = Field("keys", max_len=64)
#: A device's health (edge_sdk.health.DeviceHealth.to_meta), with its hello and its status messages: what its
#: board exposes, its last round's duration, the version of its model, its kept model ("c0@1a2b3c4d5e6f")
_SECURE = Field("record", fields={
    "peers": Field("object", max_len=4096, required=True),
    "threshold": Field("int", 2, 4096, required=True),
    "bits": Field("int", 2, 16, required=True),
    "clip": Field("float", 1e-9, 1e9, required=True),
    "run": Field("id", required=True),
})
_HEALTH = Field("record", fields={
    "cpu_temp_c": Field("float", -60.0, 200.0),
    "throttled": Field("int", 0, 2**32 - 1),  # the Raspberry Pi firmware's get_throttled bitmask
    "mem_available_mb": Field("float", 0.0, 1e9),
    "mem_total_mb": Field("float", 0.0, 1e9),
    "load1": Field("float", 0.0, 1e6),
    "round_s": Field("float", 0.0, 1e8),
    "model_version": Field("int", 0, MAX_ROUND),
    "kept": Field("str", max_len=64),
})

#: Fields of each command, by its ``op`` (server -> device).
COMMANDS: dict[str, dict[str, Field]] = {
    "hello": {},
    # failed: the server could not finish the run (the reason says why); a device outside --stay exits 5
    # run: the run that ended (a device in no run, or in another one, goes on: it arrived as that one ended)
    "stop": {"reason": Field("str", max_len=300, default="finished"), "failed": Field("bool", default=False),
             "run": Field("id")},
    # the owner retires the device from the fleet: it exits 0, service mode or not
    "leave": {"reason": Field("str", max_len=300, default="the server asked this device to leave")},
    # the device's model; with "follow", the model topics it keeps (it unsubscribes from the others)
    "assign": {"model_key": _MODEL_KEY, "follow": _FOLLOW},
    # admitted: what the device learns from the server instead of flags
    "welcome": {
        "architecture": _ARCH,
        "encoder": Field("str", max_len=128),
        "num_classes": Field("int", 1, 0xFFFF),
        "train": Field("bool", default=True),
        "reason": Field("str", max_len=300),
        # the run the device is admitted to (its announcement may reach the device after this welcome)
        "run": Field("id"),
    },
    # not admitted: the device says why and exits non-zero
    "refused": {"reason": Field("str", max_len=300, required=True)},
    "sketch": {
        "encoder": Field("str", max_len=128, default="digits_encoder"),
        "num_classes": Field("int", 1, 0xFFFF, required=True),
        "flip_prob": Field("float", 0.0, 0.5, default=0.1),
        "summary": Field("str", max_len=64, default="sketch"),
        "params": Field("object", max_len=32, default={}),
    },
    "train": {
        "round": _ROUND,
        "architecture": _ARCH,
        "models": Field("ids", max_len=256, required=True),
        "evaluate_first": Field("bool", default=True),
        "epochs": _EPOCHS,
        "lr": _LR,
        "batch_size": _BATCH,
        "optimizer": Field("str", choices=("adam", "sgd"), default="adam"),
        # the run's compression of the deltas (edge_sdk.compress.Compression.to_meta); absent: whole weights
        "compress": Field("object", max_len=4),
        # the partition of the update topics the update goes to (the ingest worker that takes it); absent: none
        "partition": Field("int", 0, 255),
        # an update above this many bytes is announced (status "ready") and sent when the server says (resend)
        "announce_above": Field("int", 1, 1 << 40),
        # secure aggregation (edge_sdk.client.secure): the round's peers of the device's model (id -> X25519
        # public key, hex), the threshold t, the quantiser's bits and clip, the run that binds the seeds
        "secure": _SECURE,
    },
    "train_ae": {
        "round": _ROUND,
        "architecture": Field("str", max_len=128, required=True),
        "epochs": _EPOCHS,
        "lr": _LR,
        "batch_size": _BATCH,
    },
    # without model_key (a broadcast): the model the device was assigned, if it is in the sample of
    # "fraction" drawn with "seed" (edge_sdk.training.sampling.in_sample); a device without a model ignores it
    "evaluate": {"round": _ROUND, "model_key": Field("id"), "architecture": _ARCH,
                 "fraction": Field("float", 0.0, 1.0), "seed": Field("int", -(2**53), 2**53)},
    # keep a trained model (edge_sdk.models.keeping): the models of round "round" this command may name, each with
    # what the server knows of it (edge_sdk.models.keep_offer.parse_offers checks each entry); without model_key
    # (a broadcast), the device's assigned model; with choose, the one of lowest loss on a local batch
    "keep": {"round": _ROUND, "run": Field("id"), "strategy": Field("str", max_len=64), "architecture": _ARCH,
             "model_key": Field("id"), "choose": Field("bool", default=False),
             "models": Field("object", max_len=256, required=True)},
    "resend": {"round": _ROUND},
    # secure aggregation (edge_sdk.secure): the body is the UnmaskRequest of the round's model
    "unmask": {"round": _ROUND, "model_key": _MODEL_KEY},
}

_SCHEMAS: dict[Kind, dict[str, Field]] = {
    Kind.HELLO: {
        "n_samples": _COUNT,
        "n_test": Field("int", 0, MAX_COUNT, default=0),
        "classes_present": Field("int", 0, 0xFFFF, default=0),
        "capabilities": Field("strs", max_len=32, default=[]),
        "architecture": _ARCH,
        "label_max": Field("int", 0, 0xFFFF),
        "input_shape": Field("ints", 1, 0xFFFF, max_len=4),
        "version": Field("str", max_len=32),
        # the device's own `fedsketch bench` (fedsketch-client --bench FILE): its figures and its CPU
        "bench": Field("numbers", max_len=16),
        "cpu": Field("str", max_len=128),
        "health": _HEALTH,
        # its X25519 public key for secure aggregation (64 hex digits)
        "secure_key": Field("str", max_len=64),
    },
    Kind.STATUS: {
        "state": Field("str", choices=("online", "offline"), default="online"),
        "working": Field("int", 0, MAX_ROUND),  # the round it is training, while it trains
        "sent": Field("int", 0, MAX_ROUND),  # the round whose update it just sent (the server re-asks a lost one)
        "ready": Field("int", 0, MAX_ROUND),  # the round whose large update it holds, to send when asked
        "size": Field("int", 0, 1 << 40),  # ... and its size in bytes
        "follow": _FOLLOW,  # the model topics it now follows (the answer to an assign's "follow")
        # the models it needs whole: what it was sent could not be applied to its copy (edge_sdk.models.held_models)
        "need": Field("ids", max_len=64),
        # the server's own status (retained on server/status): the run it serves ("online") or served
        "run": Field("id"),
        # the server's own status: after its run it keeps serving its models to devices that ask (cold start)
        "serving": Field("bool"),
        # the server's own status: its last will, named (edge_sdk.signing.signature_id): accepted at any age
        "will": Field("str", max_len=64),
        # a device's health (with "working", "sent", "ready"); absent: the one it last said stands
        "health": _HEALTH,
        # the server's check that an ingest worker reads its partition (on that partition), and the worker's answer
        "probe": Field("id"),
        # a device that does not send what it was asked, and why: its sketch would pass its owner's budget
        "declined": Field("str", choices=("sketch",)),
    },
    # sent by a device whose data changed, without being asked (edge_sdk.client: EdgeClient.data_changed)
    Kind.SKETCH: {"unasked": Field("bool")},
    Kind.FEATURES: {"summary": Field("str", max_len=64, required=True)},
    Kind.UPDATE: {
        "round": _ROUND,
        "model_key": _MODEL_KEY,
        "n_samples": _COUNT,
        "loss": Field("float"),
        "metrics": Field("numbers", max_len=32, default={}),
        # compressed: the version of the model it was trained from (its body is the delta from it)
        "version": Field("int", 0, MAX_ROUND),
        # secure aggregation: the body is a masked update (edge_sdk.secure.MaskedUpdate), summed, never read alone
        "secure": Field("bool"),
    },
    Kind.REVEAL: {"round": _ROUND, "model_key": _MODEL_KEY},
    Kind.METRICS: {
        "round": _ROUND,
        "model_key": _MODEL_KEY,
        "accuracy": Field("float", 0.0, 1.0),
        "loss": Field("float"),
        "n_test": Field("int", 0, MAX_COUNT),
    },
    # the partial aggregation (server_kit.partials): an aggregator's receipt of one device's update
    Kind.RECEIPT: {
        "round": _ROUND,
        "client": Field("id", required=True),
        "model_key": Field("id"),
        "n_samples": Field("int", 1, MAX_COUNT),
        "version": Field("int", 0, MAX_ROUND),
        "norm": Field("float", 0.0),  # the delta's norm; absent: not finite (or not computed: refused)
        "loss": Field("float"),
        "metrics": Field("numbers", max_len=32, default={}),
        "refused": Field("str", max_len=64),  # the reason, when the aggregator refused the update
        "detail": Field("str", max_len=300),
    },
    # its weighted mean of the members' updates of one model (the body), weighing n_samples in all
    Kind.PARTIAL: {
        "round": _ROUND,
        "model_key": _MODEL_KEY,
        "n_samples": Field("int", 1, 2**53, required=True),
        "members": Field("ids", max_len=4096, required=True),
    },
    # server -> aggregators: the model (the body) that round's updates of model_key start from
    Kind.COLLECT: {"round": _ROUND, "model_key": _MODEL_KEY, "version": Field("int", 0, MAX_ROUND),
                   "compress": Field("object", max_len=4)},
    # server -> one aggregator: sum these members' updates, {cid: [n_samples, scale]} (scale < 1: clipped)
    Kind.FLUSH: {"round": _ROUND, "aggregator": Field("id", required=True),
                 "members": Field("object", max_len=4096, required=True)},
    Kind.MODEL: {
        "key": _MODEL_KEY,
        "name": Field("str", max_len=128),
        "sha256": Field("str", max_len=64),
        "entry": Field("object", max_len=64),
        # compression on: the model's version; with "base", the body is the chain of its changes since that one
        # (codec: the method of its steps), or their exact merged catch-up (codec "exact")
        "version": Field("int", 0, MAX_ROUND),
        "base": Field("int", 0, MAX_ROUND),
        "codec": Field("str", choices=("int8", "int4", "sign", "rsign", "rtern", "rint2", "topk", "stc", "exact")),
        # the device holds that version already: the body is empty
        "current": Field("bool"),
        # the portable initial weights of this architecture and seed (edge_sdk.training.torch_support.initial_weights),
        # which the device builds and checks against sha256: the body is empty
        "init": Field("int", 0, 2**31 - 1),
        "architecture": _ARCH,
    },
}


def check_meta(msg: Message) -> dict[str, Any]:
    """The clean meta of ``msg``: its declared fields, checked, with defaults.

    Parameters
    ----------
    msg : Message
        A decoded envelope of the main job.

    Returns
    -------
    dict
        Only the fields of the message's schema (for a command, of its
        ``op``, which is kept); a FedCRef message (``meta["type"]``) and a
        CHUNK are returned unchanged (their handlers check them).

    Raises
    ------
    ProtocolError
        Reason ``meta-field``: a missing required field, a wrong type, a
        number out of range or not finite, a string or list too long, an
        unknown command.
    """
    meta = msg.meta
    if "type" in meta or msg.kind == Kind.CHUNK:
        return dict(meta)
    if msg.kind == Kind.CMD:
        op = meta.get("op")
        if not isinstance(op, str) or op not in COMMANDS:
            raise _fail("op", f"one of {sorted(COMMANDS)}", op)
        return {"op": op, **_check(COMMANDS[op], meta)}
    return check_fields(msg.kind, meta)


def check_fields(kind: Kind, meta: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a ``kind`` message's schema in ``meta``, checked, with defaults (as :func:`check_meta`).

    For the same facts arriving in another container: Flower's records
    (:mod:`edge_sdk.flower.records`) are checked by the one schema.
    """
    return _check(_SCHEMAS[kind], meta)
