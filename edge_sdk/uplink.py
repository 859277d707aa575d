"""What a device sends of a trained model: the whole weights, or the compressed delta with error feedback.

One function for the MQTT client (:mod:`edge_sdk.client_commands`) and the
in-process simulator (:mod:`server_kit.drivers.simulate`), so that both send
the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .compress import Compression, ErrorFeedback
from .protocol import tensors_body
from .tasks import Update

__all__ = ["update_body"]


def update_body(update: Update, start: Mapping[str, np.ndarray], feedback: ErrorFeedback,
                compression: Compression | None) -> tuple[bytes, dict[str, np.ndarray] | None]:
    """The body of ``update``'s message, and the delta the server will decode from it (None: whole weights).

    Parameters
    ----------
    update : Update
        The trained model.
    start : mapping
        The model it was trained from (the version the device holds).
    feedback : ErrorFeedback
        The device's error feedback: the part of earlier deltas of the same
        model key not sent yet is added, and what is not sent now is kept.
    compression : Compression or None
        The run's method (None or ``none``: the whole weights as safetensors, as always).
    """
    if compression is None or not compression.enabled:
        return tensors_body(update.weights), None
    feedback.set_compression(compression)
    delta = {n: np.asarray(np.subtract(update.weights[n], start[n], dtype=np.float32)) for n in start}
    return feedback.compress(update.model_key, delta)
