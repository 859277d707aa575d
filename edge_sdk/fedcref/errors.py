"""The device's table of reconstruction errors: each model's per-sample errors on the local samples, kept by version.

Every phase of a FedCRef device (association test, community check,
refinement) compares models by their errors on the same samples; a model is
run once per version (:class:`ErrorTable`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Optional

import numpy as np

from ..training.torch_support import using_threads
from .models import import_torch, reconstruction_errors

__all__ = ["ErrorTable"]


class ErrorTable:
    """Per-sample reconstruction errors of models on one device's samples, by model id and version.

    Parameters
    ----------
    architecture : str
        The cluster autoencoder (:data:`~edge_sdk.fedcref.models.ARCHITECTURES`).
    x : numpy.ndarray
        The device's samples.
    threads : int, optional
        torch intra-op threads while evaluating.

    Attributes
    ----------
    seconds : float
        Time spent computing errors.
    """

    def __init__(self, architecture: str, x: np.ndarray, threads: Optional[int] = None) -> None:
        self.architecture = architecture
        self.x = x
        self.threads = threads
        self.seconds = 0.0
        self._rows: dict[str, tuple[str, np.ndarray]] = {}

    def of(self, model_id: str, version: str, weights: Mapping[str, np.ndarray]) -> np.ndarray:
        """The errors of ``weights`` on every sample; computed only when ``model_id`` has another version."""
        hit = self._rows.get(model_id)
        if hit is not None and hit[0] == version:
            return hit[1]
        t0 = time.perf_counter()
        torch = import_torch()
        with using_threads(torch, self.threads):
            e = reconstruction_errors(self.architecture, weights, self.x)
        self.seconds += time.perf_counter() - t0
        self._rows[model_id] = (version, e)
        return e

    def put(self, model_id: str, version: str, errors: np.ndarray) -> None:
        """Record known errors (a model moved to another id keeps its errors)."""
        self._rows[model_id] = (version, errors)

    def drop(self, model_id: str) -> None:
        """Forget a model's errors."""
        self._rows.pop(model_id, None)
