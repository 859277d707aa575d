"""Models downstream: each model's versions, its compressed changes, and what a device is sent.

With compression on (``fedsketch-server --compress``), a model key's
*canonical* weights are exactly what the devices hold: after each
aggregation the change from the previous version (plus the part of earlier
changes not sent yet: the server's own error feedback) is compressed with the
run's method, and the new version is the previous one plus the decoded
change, computed with the same float32 addition on the server and on every
device (:func:`edge_sdk.compress.apply_steps`), so that both copies are
bit-identical. The strategy's model becomes that canonical copy.

The last ``cache_steps`` changes of each key are kept (STC's weight-update
caching): a device that holds version ``u`` of a key at version ``v`` is sent
the chain of changes ``u -> v`` when it is kept and smaller than the whole
model, else the whole model (a device that missed many rounds, joined late, or
whose version the server does not know). A change of a model outside
aggregation (a new cluster's model, a device moved to a pool) starts a new
version with no change leading to it: everyone gets it whole.

With compression off, versions are not tracked and every model goes whole,
as it always did.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping, MutableMapping
from typing import Any

import numpy as np

from edge_sdk.compress import Compression, ErrorFeedback, Step, chain_body
from edge_sdk.compress.update_codec import with_delta
from edge_sdk.protocol import tensors_body

__all__ = ["DEFAULT_CACHE_STEPS", "ModelVersions"]

log = logging.getLogger(__name__)

#: Changes kept per model key (a device more rounds behind gets the whole model).
DEFAULT_CACHE_STEPS = 8

Models = MutableMapping[str, dict[str, np.ndarray]]
Payload = tuple[dict[str, Any], bytes]


class ModelVersions:
    """Versions, canonical weights and the last changes of every model key (see the module docstring).

    Parameters
    ----------
    compression : Compression
        The run's method (:class:`edge_sdk.compress.Compression`); ``none``: nothing tracked.
    cache_steps : int
        Changes kept per key.
    """

    def __init__(self, compression: Compression, cache_steps: int = DEFAULT_CACHE_STEPS) -> None:
        if int(cache_steps) < 1:
            raise ValueError(f"cache_steps must be a positive integer, got {cache_steps!r}")
        self.compression = compression
        self.cache_steps = int(cache_steps)
        #: Each key's current version (0: its first weights).
        self.version: dict[str, int] = {}
        self._canon: dict[str, dict[str, np.ndarray]] = {}
        self._steps: dict[str, deque[Step]] = {}
        self._feedback = ErrorFeedback(compression)
        self._payloads: dict[tuple[str, int | None, int], Payload] = {}
        self._whole: dict[str, tuple[Mapping[str, np.ndarray], Payload]] = {}

    @property
    def enabled(self) -> bool:
        """Whether models go as compressed changes (compression is on)."""
        return self.compression.enabled

    # -- the models change ---------------------------------------------------------
    def _changed(self, key: str, weights: Mapping[str, np.ndarray]) -> bool:
        canon = self._canon.get(key)
        return canon is None or canon.keys() != weights.keys() or any(weights[n] is not canon[n] for n in canon)

    def sync(self, models: Models) -> None:
        """Take note of models changed outside aggregation: each starts a new version, sent whole."""
        if not self.enabled:
            return
        for key in list(models):
            if self._changed(key, models[key]):
                self.version[key] = self.version.get(key, -1) + 1
                self._canon[key] = dict(models[key])
                self._steps[key] = deque(maxlen=self.cache_steps)
                self._feedback.reset(key)
        for key in set(self._canon) - set(models):
            self.forget(key)

    def commit(self, models: Models) -> dict[str, int]:
        """After aggregation: each changed key's change is compressed and its canonical version replaces it.

        ``models[key]`` becomes the canonical weights (the previous version
        plus the decoded change). A key that is new, or whose names differ, is
        taken whole (:meth:`sync`). Returns the new version of every key that changed.
        """
        if not self.enabled:
            return {}
        moved: dict[str, int] = {}
        for key in sorted(models):
            weights, canon = models[key], self._canon.get(key)
            if canon is None or canon.keys() != weights.keys() or any(canon[n].shape != weights[n].shape
                                                                       for n in canon):
                self.sync({key: weights})
                moved[key] = self.version[key]
                continue
            if not self._changed(key, weights):
                continue
            delta = {n: np.asarray(np.subtract(weights[n], canon[n], dtype=np.float32)) for n in sorted(canon)}
            body, sent = self._feedback.compress(key, delta)
            new = with_delta(canon, sent)
            v = self.version[key] + 1
            self._steps[key].append(Step(v - 1, v, body))
            self.version[key] = v
            models[key] = new
            self._canon[key] = dict(new)
            moved[key] = v
        self._payloads = {k: p for k, p in self._payloads.items() if k[0] not in moved}
        return moved

    def forget(self, key: str) -> None:
        """A key the strategy dropped (a merged cluster)."""
        for d in (self.version, self._canon, self._steps):
            d.pop(key, None)
        self._feedback.reset(key)

    # -- what a device is sent ---------------------------------------------------
    def payload(self, key: str, held: int | None, weights: Mapping[str, np.ndarray]) -> Payload:
        """The meta and body of model ``key`` for a device holding version ``held`` of it (None: unknown).

        The chain of changes since ``held`` when it is kept and smaller than
        the whole model; else the whole model (``weights``). Memoised per
        (key, held, version): the devices holding the same version get the
        same bytes (the same object: one publication on a cluster topic).
        """
        if not self.enabled:  # the same bytes (the same object) for every device while the weights stay
            got = self._whole.get(key)
            if got is None or got[0] is not weights:
                got = self._whole[key] = (weights, ({"key": key}, tensors_body(weights)))
            return got[1]
        v = self.version[key]
        whole = self._payloads.get((key, None, v))
        if whole is None:
            whole = self._payloads[(key, None, v)] = ({"key": key, "version": v}, tensors_body(weights))
        start = held if held is not None and held < v else None
        if start is None:
            return whole
        memo = (key, start, v)
        got = self._payloads.get(memo)
        if got is None:
            got = whole
            steps = [s for s in self._steps.get(key, ()) if s.base >= start]
            if steps and steps[0].base == start:
                chain = chain_body(steps)
                if len(chain) < len(whole[1]):
                    got = ({"key": key, "version": v, "base": start, "codec": self.compression.method.value}, chain)
            self._payloads[memo] = got
        return got

    # -- checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, int]:
        """The versions (the changes and the server's feedback are not kept: after a resume, models go whole)."""
        return dict(self.version)

    def load_state(self, versions: Mapping[str, int], models: Models) -> None:
        """Versions from a checkpoint, for the strategy's loaded ``models``: the next one of each is sent whole."""
        if not self.enabled:
            return
        for key in models:  # a new version, sent whole: the changes leading to it went with the old process
            self.version[key] = int(versions.get(key, -1)) + 1
            self._canon[key] = dict(models[key])
            self._steps[key] = deque(maxlen=self.cache_steps)
