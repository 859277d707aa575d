"""Compressed model deltas for federated learning, and chains of them for models sent downstream.

- :mod:`.codec`: :class:`Compression` (the ``--compress`` setting: ``none``, ``int8``, ``int4``,
  ``sign``, ``rsign``, ``rtern``, ``rint2``, ``topk:0.01``, ``stc:0.01``), :func:`encode_delta` and
  :func:`decode_delta`, the body format, and :func:`add_change`, the one way a decoded change is
  added; the quantisers in :mod:`.blocks` and :mod:`.rotated`.
- :mod:`.feedback`: :class:`ErrorFeedback`, the unsent rest of each delta, added to the next.
- :mod:`.catchup`: :func:`catchup_body`, :func:`apply_catchup`, :func:`catchup_size`: one exact body
  that brings a model from an older version to the current one bit for bit.
- :mod:`.steps`: :class:`Step`, :func:`chain_body`, :func:`parse_chain` and :func:`apply_steps`:
  a model sent as the compressed changes since the version a device holds.

Every name is importable from ``edge_sdk.compress`` itself.
"""

from __future__ import annotations

from .catchup import apply_catchup, catchup_body, catchup_size
from .codec import Compression, Method, add_change, decode_delta, encode_delta, keep_count
from .feedback import ErrorFeedback
from .steps import Step, apply_steps, chain_body, parse_chain

__all__ = [
    "Compression",
    "ErrorFeedback",
    "Method",
    "Step",
    "add_change",
    "apply_catchup",
    "apply_steps",
    "catchup_body",
    "catchup_size",
    "chain_body",
    "decode_delta",
    "encode_delta",
    "keep_count",
    "parse_chain",
]
