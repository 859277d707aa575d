"""Error feedback: the part of each delta that compression did not send, added to the next one.

Top-k sends 1 % of a delta; dropping the other 99 % every round would bias training. Error
feedback (Seide et al. 2014, Stich et al. 2018, and Sattler et al.'s STC) keeps that rest per model
key and adds it to the next delta of the same key::

    total = delta + residual[key]
    body, sent = encode_delta(total, comp)
    residual[key] = total - sent

so that the sum of what was sent trails the sum of the deltas by one residual, whatever the
rounds. All of it is float32, and ``sent`` is what the receiver decodes, bit for bit.

A device keeps one residual per model key (the model of its cluster); a change of cluster
(:meth:`ErrorFeedback.reset`) or of compression (:meth:`ErrorFeedback.set_compression`) starts
afresh. :meth:`ErrorFeedback.save` writes the residuals to ``residual.safetensors`` (tensors
named ``key/name``, the compression's command-line form as the metadata ``compression``) so that
a restarted device goes on where it stopped; :meth:`ErrorFeedback.load` reads back only a file of
the same compression, and ignores a missing, corrupt or other one.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .codec import Compression, _as_float32, encode_delta

__all__ = ["RESIDUAL_FILE", "ErrorFeedback"]

log = logging.getLogger(__name__)

#: The file :meth:`ErrorFeedback.save` writes in its folder.
RESIDUAL_FILE = "residual.safetensors"


def _check_comp(comp: object) -> Compression:
    if not isinstance(comp, Compression):
        raise ValueError(f"comp must be a Compression, got {comp!r}")
    return comp


class ErrorFeedback:
    """The part of each delta that was not sent, per model key, added to the next delta of that key.

    Parameters
    ----------
    comp : Compression
        How deltas are compressed (not ``none`` for :meth:`compress`).

    Attributes
    ----------
    comp : Compression
        The current setting; change it with :meth:`set_compression`.
    """

    def __init__(self, comp: Compression) -> None:
        self.comp = _check_comp(comp)
        self._residual: dict[str, dict[str, np.ndarray]] = {}

    def set_compression(self, comp: Compression) -> None:
        """Use ``comp`` from now on; a setting other than the current one drops every residual."""
        comp = _check_comp(comp)
        if comp != self.comp:
            if self._residual:
                log.info("compression %s -> %s: the residuals of %s dropped", self.comp, comp, self.keys)
            self.reset()
            self.comp = comp

    @property
    def keys(self) -> list[str]:
        """The model keys that have a residual, sorted."""
        return sorted(self._residual)

    def compress(self, key: str, delta: Mapping[str, np.ndarray]) -> tuple[bytes, dict[str, np.ndarray]]:
        """Encode ``delta + residual[key]`` and keep what was not sent as the new residual.

        A residual whose names or shapes differ from ``delta``'s (the model changed) is dropped,
        with a warning, never mixed in. Nothing changes when encoding fails.

        Parameters
        ----------
        key : str
            The model the delta belongs to (a cluster's model key); no ``/`` in it.
        delta : mapping of str to ndarray
            The change of that model, floating point (float32, or cast to it), finite.

        Returns
        -------
        body : bytes
            :func:`~edge_sdk.compress.encode_delta`'s body of ``delta + residual``.
        sent : dict of str to ndarray
            What the receiver decodes from ``body`` (float32).

        Raises
        ------
        ValueError
            A bad key, compression ``none``, or a delta :func:`~edge_sdk.compress.encode_delta` refuses.
        """
        if not isinstance(key, str) or not key or "/" in key:
            raise ValueError(f"model key must be a non-empty string without '/', got {key!r}")
        residual = self._residual.get(key)
        if residual is not None and (set(residual) != set(delta) or any(
                np.shape(delta[name]) != r.shape for name, r in residual.items())):
            log.warning("the residual of model %r has other tensors than its delta; dropped", key)
            residual = None
        if residual is None:
            total = {name: _as_float32(name, value) for name, value in delta.items()}
        else:
            total = {name: np.add(_as_float32(name, value), residual[name]) for name, value in delta.items()}
        body, sent = encode_delta(total, self.comp)
        # (out= keeps a 0-d tensor an array: np.subtract alone gives a numpy scalar)
        self._residual[key] = {name: np.subtract(total[name], s, out=np.empty_like(s)) for name, s in sent.items()}
        return body, sent

    def reset(self, key: str | None = None) -> None:
        """Drop the residual of one model key, or of all (the device changed cluster) when None."""
        if key is None:
            self._residual.clear()
        else:
            self._residual.pop(key, None)

    def residual_norm(self, key: str) -> float:
        """The L2 norm of ``key``'s residual over all its tensors (in float64); 0.0 when none."""
        residual = self._residual.get(key, {})
        return math.sqrt(sum(float(np.sum(np.square(r, dtype=np.float64))) for r in residual.values()))

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write every residual to ``folder/residual.safetensors`` (folder created if missing).

        The file is written under a temporary name and then renamed, so a device killed while
        writing keeps the previous file whole.

        Returns
        -------
        pathlib.Path
            The file written.
        """
        from safetensors.numpy import save_file

        path = Path(folder) / RESIDUAL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {f"{key}/{name}": arr for key, arrays in self._residual.items()
                   for name, arr in arrays.items()}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"compression": str(self.comp)})
        os.replace(tmp, path)
        log.debug("error feedback: %d residual tensors of %s saved to %s", len(tensors), self.keys, path)
        return path

    def load(self, folder: str | os.PathLike[str]) -> bool:
        """Read the residuals :meth:`save` wrote in ``folder``, replacing the ones held.

        Returns
        -------
        bool
            True when a file of the current compression was read. A missing file, a corrupt one
            (not safetensors, names not ``key/name``, not float32, NaN or Inf) or one of another
            compression is ignored (logged), the residuals held are kept, and the answer is False.
        """
        from safetensors import safe_open

        path = Path(folder) / RESIDUAL_FILE
        if not path.is_file():
            log.debug("error feedback: no residuals in %s", path.parent)
            return False
        residual: dict[str, dict[str, np.ndarray]] = {}
        try:
            with safe_open(str(path), framework="numpy") as f:
                saved = (f.metadata() or {}).get("compression")
                if saved != str(self.comp):
                    log.info("error feedback: %s holds residuals of compression %r, not %s; ignored",
                             path, saved, self.comp)
                    return False
                for full in f.keys():
                    key, _, name = full.partition("/")
                    arr = f.get_tensor(full)
                    if not key or not name or arr.dtype != np.float32 or not np.isfinite(arr).all():
                        raise ValueError(f"tensor {full!r} is not a finite float32 'key/name' residual")
                    residual.setdefault(key, {})[name] = np.array(arr)
        except Exception as e:  # safetensors raises its own error types; any failure means: start afresh
            log.warning("error feedback: %s is unreadable (%s); ignored", path, e)
            return False
        self._residual = residual
        log.debug("error feedback: residuals of %s read from %s", self.keys, path)
        return True
