"""Error feedback: the part of each delta that compression did not send, added to the next one.

Top-k sends 1 % of a delta; dropping the other 99 % every round would bias training. Error
feedback (Seide et al. 2014, Stich et al. 2018, and Sattler et al.'s STC) keeps that rest per model
key and adds it to the next delta of the same key::

    total = delta + residual[key]
    body, sent = encode_delta(total, comp)
    residual[key] = total - sent

so that the sum of what was sent trails the sum of the deltas by one residual, whatever the
rounds. ``sent`` is what the receiver decodes, bit for bit. The residual is float32, or float16 on a
device (``residual_dtype``: half the memory; it never leaves the device, so its rounding changes no
copy of a model), and a device compresses in place (``keep_sent=False``: no dense copy of what was
sent), so that compression adds less than the model's size to a device's memory.

A device keeps one residual per model key (the model of its cluster); a change of cluster
(:meth:`ErrorFeedback.reset`) or of compression (:meth:`ErrorFeedback.set_compression`) starts
afresh. :meth:`ErrorFeedback.save` writes the residuals to ``residual.safetensors`` (tensors
named ``key/name`` in the residual's dtype, the compression's command-line form as the metadata
``compression``) so that a restarted device goes on where it stopped; :meth:`ErrorFeedback.load`
reads back only a file of the same compression, converting a file of the other dtype (float16 to
float32 exactly; float32 to float16 clipped to its range), and ignores a missing, corrupt or other
one.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

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
    residual_dtype : numpy dtype
        How the residuals are kept: ``np.float32`` (the default; the server's) or ``np.float16``
        (a device's: half the memory; values beyond +-65504 are clipped, with one warning).

    Attributes
    ----------
    comp : Compression
        The current setting; change it with :meth:`set_compression`.
    """

    def __init__(self, comp: Compression, *, residual_dtype: Any = np.float32) -> None:
        self.comp = _check_comp(comp)
        #: How the residuals are stored: float32, or float16 on a device (half the memory; only it reads them).
        self.residual_dtype = np.dtype(residual_dtype)
        if self.residual_dtype not in (np.dtype(np.float32), np.dtype(np.float16)):
            raise ValueError(f"residual_dtype must be float32 or float16, got {residual_dtype!r}")
        self._residual: dict[str, dict[str, np.ndarray]] = {}
        self._clipped = False

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

    def compress(self, key: str, delta: Mapping[str, np.ndarray], *,
                 keep_sent: bool = True) -> tuple[bytes, dict[str, np.ndarray] | None]:
        """Encode ``delta + residual[key]`` and keep what was not sent as the new residual.

        A residual whose names or shapes differ from ``delta``'s (the model changed) is dropped,
        with a warning, never mixed in. Nothing changes when encoding fails, except that without
        ``keep_sent`` the residual of ``key`` is dropped (it was added into the refused delta).

        Parameters
        ----------
        key : str
            The model the delta belongs to (a cluster's model key); no ``/`` in it.
        delta : mapping of str to ndarray
            The change of that model, floating point (float32, or cast to it), finite.
        keep_sent : bool
            False (a device): ``delta``'s float32 arrays are the caller's to lose; the residual is
            added into them, the encoder leaves there what it did not send, and no dense copy of
            what was sent is built (the second value is None). Compressing then adds, beyond the
            residual kept, about the body and a chunk of temporaries.

        Returns
        -------
        body : bytes
            :func:`~edge_sdk.compress.encode_delta`'s body of ``delta + residual``.
        sent : dict of str to ndarray, or None
            What the receiver decodes from ``body`` (float32); None without ``keep_sent``.

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
        if not keep_sent:
            stale = residual is None
            residual = None  # the in-place path owns the residual now: it lets each tensor go once added in
            return self._compress_in_place(key, delta, stale), None
        fresh = residual is not None  # then each total is a new array, and becomes the new rest in place
        if residual is None:
            total = {name: _as_float32(name, value) for name, value in delta.items()}
        else:
            total = {name: np.add(_as_float32(name, value), residual[name],
                                  out=np.empty(np.shape(value), dtype=np.float32)) for name, value in delta.items()}
        body, sent = encode_delta(total, self.comp)
        rest = {}
        for name, s in sent.items():  # (out= keeps a 0-d tensor an array: np.subtract alone gives a numpy scalar)
            t = total.pop(name)
            rest[name] = self._stored(np.subtract(t, s, out=t if fresh else np.empty_like(s)))
        self._residual[key] = rest
        return body, sent

    def _compress_in_place(self, key: str, delta: Mapping[str, np.ndarray], stale: bool) -> bytes:
        """:meth:`compress` without ``keep_sent``: the residual added into ``delta``, the rest left there.

        Each old residual tensor is let go as soon as it is added in, and the new ones are built
        after the encoding, so the old and the new residual are never held whole together.
        """
        old = self._residual.pop(key, None) or {}
        if stale:  # none, or of other tensors (dropped above)
            old = {}
        total = {}
        for name, value in delta.items():
            x = value if isinstance(value, np.ndarray) and value.dtype == np.float32 and value.flags.writeable \
                and value.flags.c_contiguous else np.array(value, dtype=np.float32)
            if name in old:
                np.add(x, old.pop(name), out=x, casting="unsafe")
            total[name] = x
        body, _ = encode_delta(total, self.comp, keep_sent=False)  # refused (NaN, Inf): the residual is gone
        self._residual[key] = {name: self._stored(x) for name, x in total.items()}
        return body

    def _stored(self, rest: np.ndarray) -> np.ndarray:
        """A residual as kept: float32, or float16 clipped to its finite range (said once)."""
        if self.residual_dtype == np.float32:
            return rest
        top = np.float32(np.finfo(np.float16).max)
        if not self._clipped and rest.size and max(rest.max(), -rest.min()) > top:  # no |rest| copy
            self._clipped = True
            log.warning("error feedback: a residual beyond float16's range (%g) clipped", float(top))
        return np.clip(rest, -top, top, out=rest).astype(np.float16)

    def residual_bytes(self) -> int:
        """Bytes of every residual held."""
        return sum(a.nbytes for arrays in self._residual.values() for a in arrays.values())

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
            True when a file of the current compression was read. Its tensors are converted to
            ``residual_dtype`` (a float32 file read as float16 is clipped to float16's range, as
            :meth:`compress` clips). A missing file, a corrupt one (not safetensors, names not
            ``key/name``, not float32 or float16, NaN or Inf) or one of another compression is
            ignored (logged), the residuals held are kept, and the answer is False.
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
                    if not key or not name or arr.dtype not in (np.float32, np.float16) or not np.isfinite(arr).all():
                        raise ValueError(f"tensor {full!r} is not a finite float32 or float16 'key/name' residual")
                    residual.setdefault(key, {})[name] = self._stored(np.array(arr, dtype=np.float32))
        except Exception as e:  # safetensors raises its own error types; any failure means: start afresh
            log.warning("error feedback: %s is unreadable (%s); ignored", path, e)
            return False
        self._residual = residual
        log.debug("error feedback: residuals of %s read from %s", self.keys, path)
        return True
