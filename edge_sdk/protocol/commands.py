"""The command vocabulary: the commands the server sends a device, built and read in one place.

The server builds every command's meta with :func:`build`, the device reads
every command with :func:`parse`, and the simulator counts the bytes of what
:func:`build` returns; so the three cannot drift apart. :class:`Op` names the
commands, exactly as they go on the wire (``meta["op"]``). Each command's
fields, with their types, ranges and defaults (the sketch's encoder
``"digits_encoder"`` and flip probability 0.1 among them), are declared once,
in :data:`edge_sdk.schema.COMMANDS`; :data:`FIELDS` is that very table.

A command travels as a :class:`~edge_sdk.protocol.Kind` ``CMD`` message on a
device's command topic, or on the broadcast topic for every device.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import TYPE_CHECKING, Any

from ..schema import COMMANDS, Field, check_meta

if TYPE_CHECKING:
    from . import Message

__all__ = ["FIELDS", "Op", "build", "parse"]


class Op(str, Enum):
    """The name of each command (server -> device), as it goes on the wire."""

    #: Say hello again (a new server): the device follows every model until it is assigned again.
    HELLO = "hello"
    #: The server has finished (``reason``): the device exits, unless it stays for the next run.
    STOP = "stop"
    #: The owner retires the device (``reason``): it exits 0, in service mode too.
    LEAVE = "leave"
    #: The device's model (``model_key``) and, with ``follow``, the model topics it keeps.
    ASSIGN = "assign"
    #: Admitted: the architecture, encoder, classes and whether it trains.
    WELCOME = "welcome"
    #: Not admitted (``reason``): the device exits non-zero.
    REFUSED = "refused"
    #: Send the sketch (or the float summary ``summary``) of the local data.
    SKETCH = "sketch"
    #: Train the models of round ``round`` and send the update.
    TRAIN = "train"
    #: Train the sketch autoencoder of round ``round`` (federated pre-training).
    TRAIN_AE = "train_ae"
    #: Evaluate a model (``model_key``, or the assigned one if in the sample) and send the metrics.
    EVALUATE = "evaluate"
    #: Keep a trained model of round ``round`` (the assigned one, ``model_key``, or the lowest-loss candidate).
    KEEP = "keep"
    #: Send the update of round ``round`` again: the receiver lost it, or had no room for it then.
    RESEND = "resend"
    #: Secure aggregation: reveal what the round's survivors need (the request is the command's body).
    UNMASK = "unmask"


#: The fields of each command, by op: their type, range, default (:class:`edge_sdk.schema.Field`).
FIELDS: Mapping[str, Mapping[str, Field]] = COMMANDS


def build(op: Op | str, /, **fields: Any) -> dict[str, Any]:
    """The meta of one command: ``{"op": op, **fields}``, in the order given.

    The order is kept because it is the order of the bytes on the wire.
    Values are not checked here: the device checks them, in :func:`parse`.

    Parameters
    ----------
    op : Op or str
        The command.
    **fields
        Its fields (see :data:`FIELDS`); absent ones take their default on the device.

    Returns
    -------
    dict
        The meta to send in a ``CMD`` message.

    Raises
    ------
    ValueError
        For an unknown command, a field the command does not have, or a
        required field missing.
    """
    name = op.value if isinstance(op, Op) else op
    spec = FIELDS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"unknown command {op!r}; the commands are {sorted(FIELDS)}")
    for key in fields:
        if key not in spec:
            raise ValueError(f"command {name!r} has no field {key!r}; its fields are {sorted(spec)}")
    for key, f in spec.items():
        if f.required and key not in fields:
            raise ValueError(f"command {name!r} needs the field {key!r}")
    return {"op": name, **fields}


def parse(msg: Message) -> dict[str, Any]:
    """The clean meta of a received command: ``op`` and its declared fields, checked, defaults filled in.

    Fields a command does not declare are dropped, so that a newer server
    can add information an older device ignores.

    Parameters
    ----------
    msg : Message
        A decoded ``CMD`` message.

    Returns
    -------
    dict
        ``{"op": ..., **fields}``; a FedCRef message (``meta["type"]``) is
        returned unchanged, as :func:`edge_sdk.schema.check_meta` does.

    Raises
    ------
    ProtocolError
        Reason ``meta-field``: an unknown op (``meta field 'op' must be one
        of [...], got ...``), a missing required field, a field of the wrong
        type or out of range.
    """
    return check_meta(msg)
