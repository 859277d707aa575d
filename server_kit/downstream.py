"""Models downstream: each model's versions, its compressed changes, and what a device is sent.

With downstream compression on (``fedsketch-server --compress-down``, or
``--compress`` for both ways), a model key's *canonical* weights are exactly
what the devices hold: after each aggregation the change from the previous
version (plus the part of earlier changes not sent yet: the server's own
error feedback) is compressed with the run's downstream method, and the new
version is the previous one plus the decoded change, computed with the same
float32 addition on the server and on every device
(:func:`edge_sdk.compress.apply_steps`), so that both copies are
bit-identical. The strategy's model becomes that canonical copy.

What a device holding version ``u`` of a key at version ``v`` is sent
(:meth:`ModelVersions.payload`), the fewest bytes of:

- **nothing** when ``u == v``: a body of 0 bytes whose meta says ``current``;
- **its first model for free**: a version whose weights are the portable
  initial weights of the run's architecture and a seed
  (:func:`edge_sdk.training.torch_support.initial_weights`, bit for bit the same on
  every platform) goes as ``{"init": seed, "architecture": ..., "sha256": ...}``
  and a 0-byte body; the device builds it and checks the hash (a device whose
  copy differs asks for the whole model: status ``need``). A device that holds
  no version of a key that started from such a model is sent the same
  ``init`` with the changes since it (a chain or a merged catch-up, ``base``
  being that first version), unless the whole model is smaller;
- **the chain of changes** ``u -> ... -> v`` (:mod:`edge_sdk.compress.steps`);
- **one merged catch-up** (``codec: "exact"``, :mod:`edge_sdk.compress.catchup`):
  the difference of the float32 bit patterns of versions ``u`` and ``v`` as
  ordered integers, exact, so the device lands on version ``v`` bit for bit.
  The server rebuilds version ``u`` from the oldest version it keeps and the
  steps since (the same additions as the devices'): it keeps no copy per device;
- **the whole model** (a device whose version the server does not know, one
  behind the oldest version kept).

The changes are kept for the whole run up to ``cache_bytes`` per key (256 MB
by default: thousands of rounds of a LeNet-5 in any codec); past it the oldest
step is folded into the oldest version kept. A change of a model outside
aggregation (a new cluster's model, a device moved to a pool) starts a new
version with no change leading to it: it goes whole, or free when it is a
portable initial model.

With downstream compression off, versions are not tracked and every model
goes whole, as it always did.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from edge_sdk.compress import (
    Compression,
    ErrorFeedback,
    Step,
    apply_steps,
    catchup_body,
    chain_body,
)
from edge_sdk.compress.update_codec import with_delta
from edge_sdk.models.portable_init import tensors_sha256
from edge_sdk.protocol import tensors_body

__all__ = ["DEFAULT_CACHE_BYTES", "ModelVersions"]

log = logging.getLogger(__name__)

#: Bytes of changes kept per model key (the oldest folded into the oldest version kept past it).
DEFAULT_CACHE_BYTES = 256 << 20

Models = MutableMapping[str, dict[str, np.ndarray]]
Payload = tuple[dict[str, Any], bytes]


@dataclass(frozen=True)
class InitialOrigin:
    """Where a model version comes from when every device can build it: an architecture and a seed."""

    architecture: str
    seed: int
    sha256: str
    #: The key's version whose weights these are.
    version: int = 0


@dataclass
class _History:
    """A key's oldest version kept (its weights) and the steps from it to the current version."""

    base_version: int
    base: dict[str, np.ndarray]
    steps: deque[Step]

    @property
    def nbytes(self) -> int:
        return sum(len(s.body) for s in self.steps)


class ModelVersions:
    """Versions, canonical weights and the changes of every model key (see the module docstring).

    Parameters
    ----------
    compression : Compression
        The run's downstream method (:class:`edge_sdk.compress.Compression`); ``none``: nothing tracked.
    cache_bytes : int
        Bytes of changes kept per key.
    """

    def __init__(self, compression: Compression, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if int(cache_bytes) < 1:
            raise ValueError(f"cache_bytes must be a positive integer, got {cache_bytes!r}")
        self.compression = compression
        self.cache_bytes = int(cache_bytes)
        #: Each key's current version (0: its first weights).
        self.version: dict[str, int] = {}
        self._canon: dict[str, dict[str, np.ndarray]] = {}
        self._history: dict[str, _History] = {}
        self._feedback = ErrorFeedback(compression) if compression.enabled else None
        self._payloads: dict[tuple[str, int | None, int, bool], Payload] = {}
        self._whole: dict[str, tuple[Mapping[str, np.ndarray], Payload]] = {}
        #: The portable initial models the devices can build, by their hash (:meth:`note_initial`).
        self._initial: dict[str, InitialOrigin] = {}
        #: The keys whose current version is a portable initial model.
        self._origin: dict[str, InitialOrigin] = {}

    @property
    def enabled(self) -> bool:
        """Whether models go as compressed changes (downstream compression is on)."""
        return self.compression.enabled

    def versions_sent(self, keys: Iterable[str]) -> dict[str, int] | None:
        """The versions a device holds once sent ``keys`` now; ``None`` when models go whole (nothing to track)."""
        return {key: self.version[key] for key in keys} if self.enabled else None

    def note_initial(self, architecture: str | None, seed: int, weights: Mapping[str, np.ndarray]) -> None:
        """``weights`` are ``initial_weights(architecture, seed)``: a version equal to them goes free."""
        if self.enabled and architecture:
            sha = tensors_sha256(weights)
            self._initial[sha] = InitialOrigin(str(architecture), int(seed), sha)

    # -- the models change ---------------------------------------------------------
    def _changed(self, key: str, weights: Mapping[str, np.ndarray]) -> bool:
        canon = self._canon.get(key)
        return canon is None or canon.keys() != weights.keys() or any(weights[n] is not canon[n] for n in canon)

    def sync(self, models: Models) -> None:
        """Take note of models changed outside aggregation: each starts a new version (whole, or free)."""
        if not self.enabled:
            return
        for key in list(models):
            if self._changed(key, models[key]):
                v = self.version[key] = self.version.get(key, -1) + 1
                self._canon[key] = dict(models[key])
                self._history[key] = _History(v, self._canon[key], deque())
                self._feedback.reset(key)
                self._payloads = {k: p for k, p in self._payloads.items() if k[0] != key}
                origin = self._initial.get(tensors_sha256(models[key])) if self._initial else None
                if origin is None:
                    self._origin.pop(key, None)
                else:
                    self._origin[key] = replace(origin, version=v)
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
            self._keep_step(key, Step(v - 1, v, body))
            self.version[key] = v
            models[key] = new
            self._canon[key] = dict(new)
            moved[key] = v
        self._payloads = {k: p for k, p in self._payloads.items() if k[0] not in moved}
        return moved

    def _keep_step(self, key: str, step: Step) -> None:
        """Keep ``step``; past ``cache_bytes``, fold the oldest steps into the oldest version kept."""
        hist = self._history[key]
        hist.steps.append(step)
        while len(hist.steps) > 1 and hist.nbytes > self.cache_bytes:
            oldest = hist.steps.popleft()
            hist.base_version, hist.base = apply_steps(hist.base_version, hist.base, [oldest],
                                                       self.compression.method)

    def forget(self, key: str) -> None:
        """A key the strategy dropped (a merged cluster)."""
        for d in (self.version, self._canon, self._history, self._origin):
            d.pop(key, None)
        if self._feedback is not None:
            self._feedback.reset(key)

    # -- what a device is sent ---------------------------------------------------
    def payload(self, key: str, held: int | None, weights: Mapping[str, np.ndarray], *,
                whole: bool = False, merge: bool = True) -> Payload:
        """The meta and body of model ``key`` for a device holding version ``held`` of it (None: unknown).

        The fewest bytes of those the module docstring lists; ``whole``: the
        whole model whatever the device holds (it asked: its copy differs);
        ``merge`` False: no merged catch-up (a cluster topic's devices that
        hold several versions: each applies the steps it lacks).
        Memoised per (key, held, version): the devices holding the same
        version get the same bytes (the same object: one publication on a
        cluster topic).
        """
        if not self.enabled:  # the same bytes (the same object) for every device while the weights stay
            got = self._whole.get(key)
            if got is None or got[0] is not weights:
                got = self._whole[key] = (weights, ({"key": key}, tensors_body(weights)))
            return got[1]
        v = self.version[key]
        entire = self._payloads.get((key, -1, v, False))
        if entire is None:
            entire = self._payloads[(key, -1, v, False)] = ({"key": key, "version": v}, tensors_body(weights))
        if whole:
            return entire
        start = held if held is not None and held <= v else None
        memo = (key, start, v, merge)
        got = self._payloads.get(memo)
        if got is None:
            got = self._payloads[memo] = self._choose(key, start, v, entire, merge)
        return got

    def _choose(self, key: str, held: int | None, v: int, entire: Payload, merge: bool) -> Payload:
        """What a device holding ``held`` is sent: nothing, the free first model, or :meth:`_catch_up`."""
        if held == v:
            return {"key": key, "version": v, "current": True}, b""
        if held is None:  # a device that holds none of it builds the portable initial version, if there was one
            origin = self._origin.get(key)
            if origin is None:
                return entire
            init = {"init": origin.seed, "architecture": origin.architecture, "sha256": origin.sha256}
            if origin.version == v:
                return {"key": key, "version": v, **init}, b""
            meta, body = self._catch_up(key, origin.version, v, entire, merge)
            return ({**meta, **init}, body) if "base" in meta else (meta, body)
        return self._catch_up(key, held, v, entire, merge)

    def _catch_up(self, key: str, held: int, v: int, entire: Payload, merge: bool) -> Payload:
        """The smallest of the chain of changes since ``held``, the exact merged catch-up and the whole model."""
        hist = self._history.get(key)
        if hist is None or held < hist.base_version:
            return entire
        steps = [s for s in hist.steps if s.base >= held]
        meta = {"key": key, "version": v, "base": held}
        best = entire
        if steps and steps[0].base == held:
            chain = chain_body(steps)
            if len(chain) < len(best[1]):
                best = ({**meta, "codec": self.compression.method.value}, chain)
        if merge and len(steps) > 1 and self._all_float32(key):  # the exact catch-up maps float32 bits only
            before = self.weights_at(key, held)
            merged = catchup_body(before, self._canon[key])
            if len(merged) < len(best[1]):
                best = ({**meta, "codec": "exact"}, merged)
        return best

    def _all_float32(self, key: str) -> bool:
        return all(a.dtype == np.float32 for a in self._canon[key].values())

    def weights_at(self, key: str, version: int) -> dict[str, np.ndarray]:
        """The canonical weights of an earlier ``version`` of ``key``: the oldest kept plus the steps since."""
        hist = self._history[key]
        steps = [s for s in hist.steps if s.version <= version]
        held, weights = apply_steps(hist.base_version, hist.base, steps, self.compression.method)
        if held != version:
            raise ValueError(f"version {version} of model {key!r} is not kept (oldest {hist.base_version})")
        return weights

    # -- checkpoints ---------------------------------------------------------------
    def state(self) -> dict[str, int]:
        """The versions (the changes and the server's feedback are not kept: after a resume, models go whole)."""
        return dict(self.version)

    def load_state(self, versions: Mapping[str, int], models: Models) -> None:
        """Versions from a checkpoint, for the strategy's loaded ``models``: the next one of each is sent whole."""
        if not self.enabled:
            return
        for key in models:  # a new version, sent whole: the changes leading to it went with the old process
            v = self.version[key] = int(versions.get(key, -1)) + 1
            self._canon[key] = dict(models[key])
            self._history[key] = _History(v, self._canon[key], deque())
            self._origin.pop(key, None)
