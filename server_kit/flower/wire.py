"""The bytes a Flower message takes: every object it carries, serialised as Flower sends it.

Flower moves a message as a tree of content-addressed objects (the message,
its ``RecordDict``, each record, each array and its chunks), each
``deflate()``-d to bytes; a message's size is the sum over its tree, each
object once. This counts what the SuperLink and a SuperNode exchange for one
message, framing of the gRPC transport aside.
"""

from __future__ import annotations

from flwr.supercore.inflatable.inflatable_object import InflatableObject, get_all_nested_objects

__all__ = ["message_bytes"]


def message_bytes(msg: InflatableObject) -> int:
    """Serialised bytes of ``msg`` (a ``Message``, or any of its records) and every object under it."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(msg).values())
