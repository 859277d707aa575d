"""Bytes on the wire: a sketch, and an update and a model of each architecture, in FedSketch envelopes.

A sketch is its packed bits in a SKETCH envelope. An update (device ->
server) and a model (server -> devices, signed by the server) carry the
float32 ``state_dict`` as safetensors: the shipped weights of the shipped
classifiers (``models/*.safetensors``, read without torch), fresh weights
for ResNet-18 (which ships none: torch builds them). ``wire_bytes`` counts
the chunks the envelope is cut into above ``max_payload``.

``compressed_bytes`` is None unless a ``compress`` function is given to
:func:`message_sizes`; ``fedsketch bench`` gives none yet (the compressed
updates of ``fedsketch-server --compress`` are measured by
``benchmarks/compression.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Callable, Optional

import numpy as np

from ..models.artifacts import load_manifest, models_dir
from ..protocol import (
    SERVER_ID,
    SIGNATURE_TRAILER,
    Kind,
    Message,
    encode_message,
    sketch_body,
    split_payload,
    tensors_body,
)
from ..sketch import Sketch
from .results import MessageSize
from .training import torch_missing

__all__ = ["message_sizes", "sketch_size", "weights_for", "wire_bytes"]

Compressor = Callable[[bytes], bytes]


def wire_bytes(msg: Message, max_payload: int, *, signed: bool = False) -> tuple[int, int]:
    """``(bytes, frames)`` of ``msg`` as sent: one envelope, or its chunks above ``max_payload``.

    A signed message (the server's) carries :data:`~edge_sdk.protocol.SIGNATURE_TRAILER`
    bytes, and so does each of its chunks.
    """
    trailer = SIGNATURE_TRAILER if signed else 0
    payload = encode_message(msg) + bytes(trailer)
    frames = split_payload(payload, max_payload=max_payload - trailer, federation=msg.federation,
                           sender=msg.sender, round=msg.round)
    return sum(map(len, frames)) + (trailer * len(frames) if len(frames) > 1 else 0), len(frames)


def sketch_size(encoder: str, sketch: Sketch, *, federation: str, client_id: str, max_payload: int) -> MessageSize:
    """The SKETCH message of ``sketch`` from ``client_id``."""
    msg = Message(Kind.SKETCH, federation, client_id, 0, {}, sketch_body(sketch))
    wire, _ = wire_bytes(msg, max_payload)
    return MessageSize(kind="sketch", name=encoder, body_bytes=sketch.nbytes, envelope_bytes=len(encode_message(msg)),
                       wire_bytes=wire, note=f"{sketch.num_classes} classes x {sketch.latent_dim} bits, "
                                         f"federation {federation!r}, client {client_id!r}")


def weights_for(architecture: str, seed: int = 0) -> tuple[Optional[dict[str, np.ndarray]], str]:
    """``(weights, where from)``: the shipped safetensors of ``architecture``, else fresh ones with torch.

    ``(None, why)`` when it ships none and torch is missing.
    """
    for spec in load_manifest().values():
        extra = spec.extra or {}
        if spec.role == "classifier" and extra.get("architecture") == architecture and extra.get("weights"):
            from safetensors.numpy import load_file

            name = extra["weights"]["file"]
            return load_file(str(models_dir() / name)), f"shipped weights ({name})"
    missing = torch_missing()
    if missing is None:
        from ..training.torch_support import initial_weights

        return initial_weights(architecture, seed), "fresh weights (no shipped file; built with torch)"
    return None, f"no shipped weights, and {missing.replace('not measured: ', '')}"


def _weights_rows(architecture: str, weights: Mapping[str, np.ndarray], where: str, *, federation: str,
                  client_id: str, samples: int, max_payload: int,
                  compress: Optional[Compressor]) -> list[MessageSize]:
    body = tensors_body({k: np.asarray(v, dtype=np.float32) if np.issubdtype(np.asarray(v).dtype, np.floating)
                         else v for k, v in weights.items()})
    n_params = sum(int(np.asarray(v).size) for v in weights.values())
    update = Message(Kind.UPDATE, federation, client_id, 1, {"round": 1, "model_key": "c0", "n_samples": samples,
                                                             "loss": 1.0, "metrics": {}}, body)
    model = Message(Kind.MODEL, federation, SERVER_ID, 1, {"key": "c0"}, body)
    rows = []
    for kind, msg, signed in (("update", update, False), ("model", model, True)):
        wire, frames = wire_bytes(msg, max_payload, signed=signed)
        comp = len(compress(body)) if compress is not None and kind == "update" else None
        rows.append(MessageSize(
            kind=kind, name=architecture, body_bytes=len(body),
            envelope_bytes=len(encode_message(msg)) + (SIGNATURE_TRAILER if signed else 0), wire_bytes=wire,
            compressed_bytes=comp,
            note=f"{n_params:,} values, float32 safetensors, {where}; {frames} chunk(s) of {max_payload:,} bytes"
                 + ("; signed by the server" if signed else "")))
    return rows


def message_sizes(sketches: Mapping[str, Sketch], architectures: Sequence[str], *, federation: str, client_id: str,
                  samples: int, max_payload: int, seed: int = 0,
                  compress: Optional[Compressor] = None) -> list[MessageSize]:
    """The sketch of each encoder, then the update and the model of each architecture.

    Parameters
    ----------
    sketches : mapping of str to Sketch
        A sketch per encoder (from the stage timings).
    architectures : sequence of str
        Architectures whose update and model to size.
    federation, client_id : str
        The ids written in the envelopes (they count in the header).
    samples : int
        ``n_samples`` of the update's meta.
    max_payload : int
        Largest MQTT packet (``--max-payload``): bigger envelopes go in chunks.
    compress : callable, optional
        ``body -> compressed body``, to fill ``compressed_bytes``; with None it stays None.
    """
    rows = [sketch_size(e, s, federation=federation, client_id=client_id, max_payload=max_payload)
            for e, s in sketches.items()]
    for arch in architectures:
        weights, where = weights_for(arch, seed)
        if weights is None:
            rows += [MessageSize(kind=k, name=arch, body_bytes=None, envelope_bytes=None, wire_bytes=None, note=where)
                     for k in ("update", "model")]
            continue
        rows += _weights_rows(arch, weights, where, federation=federation, client_id=client_id, samples=samples,
                              max_payload=max_payload, compress=compress)
    return rows

