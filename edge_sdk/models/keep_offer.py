"""What a ``keep`` command says of each model it offers: :class:`KeepOffer`, built by the server, read by the device.

The server puts one offer per model key in the command's ``models`` object
(:meth:`KeepOffer.to_wire`); the device reads them back with
:func:`parse_offers`, every field checked (a bad one is a ``meta-field``
refusal, like any other field of a command). The sha256 is that of the
model's weights as :func:`edge_sdk.models.model_folder.weights_bytes` writes them:
the device keeps a model only if its own copy has that sha256, bit for bit
the server's export.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from ..protocol import ProtocolError, check_id

__all__ = ["KeepOffer", "parse_offers"]

_SHA = re.compile(r"[0-9a-f]{64}")
_MAX = 2**53


@dataclass(frozen=True)
class KeepOffer:
    """One model a ``keep`` command offers: its key, its weights' sha256 and what the server knows of it."""

    key: str
    sha256: str
    #: The round its weights come from, its version (compression on), its cluster index.
    round: int = 0
    version: int | None = None
    cluster: int | None = None
    #: Devices of its cluster and their samples.
    members: int | None = None
    samples: int | None = None
    #: The server's accuracy: the mean over the devices that evaluated it, and their count.
    accuracy: float | None = None
    evaluated: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The offer's fields but its key (the key of the ``models`` object), absent ones left out."""
        return {k: v for k, v in asdict(self).items() if k != "key" and v is not None}


def _int(key: str, name: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= _MAX:
        raise ProtocolError("meta-field", f"keep offer {key!r}: {name} must be an integer >= {lo}, got {v!r:.40}")
    return v


def parse_offers(models: Mapping[str, Any]) -> dict[str, KeepOffer]:
    """The offers of a ``keep`` command's ``models`` object, every field checked.

    Raises
    ------
    ProtocolError
        ``meta-field``: a key that is no model key, a sha256 that is not 64 hex digits, a count or round
        out of range, an accuracy outside [0, 1] or not finite.
    """
    out: dict[str, KeepOffer] = {}
    for key, raw in models.items():
        check_id(key, "keep offer", reason="meta-field")
        if not isinstance(raw, dict):
            raise ProtocolError("meta-field", f"keep offer {key!r} must be an object")
        sha = raw.get("sha256")
        if not isinstance(sha, str) or not _SHA.fullmatch(sha):
            raise ProtocolError("meta-field", f"keep offer {key!r}: sha256 must be 64 hex digits, got {sha!r:.80}")
        acc = raw.get("accuracy")
        if acc is not None and (isinstance(acc, bool) or not isinstance(acc, (int, float))
                                or not math.isfinite(acc) or not 0.0 <= acc <= 1.0):
            raise ProtocolError("meta-field", f"keep offer {key!r}: accuracy must be in [0, 1], got {acc!r:.40}")
        opt = {name: _int(key, name, raw[name]) for name in ("version", "cluster", "members", "samples")
               if raw.get(name) is not None}
        out[key] = KeepOffer(key, sha, round=_int(key, "round", raw.get("round", 0)),
                             accuracy=None if acc is None else float(acc),
                             evaluated=_int(key, "evaluated", raw.get("evaluated", 0)), **opt)
    return out
