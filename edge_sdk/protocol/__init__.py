"""The one wire format of FedSketch: topics, a binary envelope, bodies and chunks.

- :mod:`.envelope`: the binary envelope (:class:`Message`, :class:`Kind`, the
  header and its signing flag, ids, the JSON meta), :func:`encode_message`,
  :func:`decode_message`, :class:`ProtocolError`, and
  :meth:`Message.wire_size`, the bytes a message takes on the wire.
- :mod:`.bodies`: sketch and tensor bodies.
- :mod:`.chunks`: :func:`split_payload` and the :class:`Reassembler`.
- :mod:`.topics`: :class:`Topics`.

Every name is importable from ``edge_sdk.protocol`` itself.
"""

from __future__ import annotations

from .bodies import (
    check_features,
    check_tensors,
    parse_sketch,
    parse_tensors,
    sketch_body,
    tensors_body,
)
from .chunks import (
    BUSY,
    DEFAULT_CHUNK_DEADLINE,
    DEFAULT_CHUNK_MEMORY,
    DEFAULT_CHUNK_PENDING_PER_SENDER,
    DEFAULT_CHUNK_TIMEOUT,
    Reassembler,
    split_payload,
)
from .envelope import (
    DEFAULT_MAX_MESSAGE,
    FLAG_SIGNED,
    HEADER_SIZE,
    MAGIC,
    MAX_ID_BYTES,
    MAX_META_BYTES,
    MAX_META_DEPTH,
    MAX_META_INT,
    PROTOCOL_VERSION,
    SERVER_ID,
    SIGNATURE_TRAILER,
    Kind,
    Message,
    ProtocolError,
    check_id,
    decode_message,
    encode_message,
)
from .topics import MAX_PARTITIONS, Topics, partition_of

__all__ = [
    "BUSY",
    "DEFAULT_CHUNK_DEADLINE",
    "DEFAULT_CHUNK_MEMORY",
    "DEFAULT_CHUNK_PENDING_PER_SENDER",
    "DEFAULT_CHUNK_TIMEOUT",
    "DEFAULT_MAX_MESSAGE",
    "FLAG_SIGNED",
    "HEADER_SIZE",
    "Kind",
    "MAGIC",
    "MAX_ID_BYTES",
    "MAX_META_BYTES",
    "MAX_META_DEPTH",
    "MAX_META_INT",
    "MAX_PARTITIONS",
    "Message",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "Reassembler",
    "SERVER_ID",
    "SIGNATURE_TRAILER",
    "Topics",
    "check_features",
    "check_id",
    "check_tensors",
    "decode_message",
    "encode_message",
    "parse_sketch",
    "parse_tensors",
    "partition_of",
    "sketch_body",
    "split_payload",
    "tensors_body",
]
