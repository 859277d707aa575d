"""The models a device holds: what the server sent, whole or as compressed changes, and the wait for one.

With downstream compression on, a model arrives as one of (the server's
:class:`server_kit.downstream.ModelVersions` picks the fewest bytes):

- nothing new (``current``): the device holds that version already;
- its portable initial weights (``init``): the device builds them
  (:func:`edge_sdk.training.torch_support.initial_weights`, the same bits on every
  platform) and checks them against the server's ``sha256``; with ``base``,
  the changes that follow come in the same message and apply to them;
- the chain of its compressed changes since a version the device holds
  (:mod:`edge_sdk.compress.steps`), applied with the same float32 addition as
  the server's, or one exact merged catch-up (``codec: "exact"``,
  :mod:`edge_sdk.compress.catchup`): either way the copy is bit-identical to
  the server's;
- the whole model (safetensors), as always with compression off.

What cannot be applied to the copy held (no version held, another version,
initial weights that hash otherwise or cannot be built here) is refused with
reason ``model-base`` or ``model-init`` (:data:`NEEDS_WHOLE`) and the model
stays as it was; the device then asks the server for the model whole (its
status ``need``, :class:`edge_sdk.client.link.DeviceLink`).

A model of an earlier round than the one held is a late copy (a broker that
redelivers an unacknowledged QoS 1 message, a NATS cluster among them): it is
refused with reason ``model-stale``, so it cannot replace the newer model a
command waits for. A server that comes back to its run (resumed from a
checkpoint, its rounds possibly below the ones held) is the exception:
:meth:`ModelStore.rewind` lets the next model of each key in, whatever its round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..compress import Method, apply_catchup, apply_steps, parse_chain
from ..protocol import Message, ProtocolError, parse_tensors
from .portable_init import tensors_sha256

__all__ = ["NEEDS_WHOLE", "HeldModel", "ModelStore"]

#: The refusals after which the device asks for the model whole (status ``need``): what it was sent does
#: not apply to its copy.
NEEDS_WHOLE = frozenset({"model-base", "model-init"})


def _initial_weights(architecture: str, seed: int) -> dict[str, np.ndarray]:
    from ..training.torch_support import initial_weights

    return initial_weights(architecture, seed)


@dataclass(frozen=True)
class HeldModel:
    """One model as the device holds it."""

    #: The round of the message that brought it (a command of round ``r`` waits for one of round >= ``r``).
    round: int
    weights: dict[str, np.ndarray]
    #: Its version (compression on), None when the server does not version its models.
    version: int | None = None


class ModelStore:
    """The models a device holds, by key, at most ``max_models`` (the oldest round is forgotten first).

    Thread-safe: the network thread puts, the command loop waits.
    """

    def __init__(self, max_models: int = 8,
                 build_initial: Callable[[str, int], dict[str, np.ndarray]] | None = None) -> None:
        if int(max_models) < 1:
            raise ValueError(f"max_models must be a positive integer, got {max_models!r}")
        self.max_models = int(max_models)
        #: Builds the portable initial weights of an architecture and a seed (default: with torch, for the structure).
        self.build_initial = build_initial or _initial_weights
        self._models: dict[str, HeldModel] = {}
        #: The keys whose next model is taken whatever its round (:meth:`rewind`).
        self._rewound: set[str] = set()
        self.cv = threading.Condition()

    def receive(self, key: str, msg: Message, meta: Mapping[str, Any]) -> HeldModel:
        """A MODEL message (its checked ``meta``): the whole model, or a chain applied to the one held.

        Raises
        ------
        ProtocolError
            The body is not what its meta says (``tensors``, the ``compressed-*``
            reasons), or ``model-base``: the chain starts after the version held.
        """
        version = meta.get("version")
        with self.cv:
            have = self._models.get(key)
            if have is not None and msg.round < have.round and key not in self._rewound:
                raise ProtocolError("model-stale", f"model {key!r} of round {msg.round} came after the one of "
                                                   f"round {have.round}: a late copy, ignored")
        start = None  # the version the changes apply to: the one held, or the initial weights built here
        if "init" in meta:
            start = HeldModel(msg.round, self._initial(key, meta), meta.get("base", version))
        if meta.get("current"):
            held = HeldModel(msg.round, self._held_version(key, version).weights, version)
        elif "init" in meta and "base" not in meta:
            held = start
        elif "base" not in meta:
            held = HeldModel(msg.round, parse_tensors(msg.body), version)
        elif meta["codec"] == "exact":
            have = start or self._held_version(key, meta["base"])
            spec = {n: (a.shape, "float32") for n, a in have.weights.items()}
            held = HeldModel(msg.round, apply_catchup(have.weights, msg.body, spec), version)
        else:
            held = HeldModel(msg.round, *self._apply_chain(key, msg.body, meta, start)[::-1])
        self.put(key, held)
        return held

    def _held_version(self, key: str, version: int | None) -> HeldModel:
        """The model held of ``key`` when it is of ``version``; else ``model-base`` (the device needs it whole)."""
        with self.cv:
            have = self._models.get(key)
        if have is None or have.version is None or have.version != version:
            held = "no version" if have is None or have.version is None else f"version {have.version}"
            raise ProtocolError("model-base", f"model {key!r} sent for version {version}, and {held} of it is held")
        return have

    def _initial(self, key: str, meta: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The portable initial weights the meta names, built here and checked against its hash."""
        arch, seed = meta.get("architecture"), meta["init"]
        if not arch or "sha256" not in meta:
            raise ProtocolError("model-init", f"model {key!r}: initial weights without an architecture or a hash")
        try:
            weights = self.build_initial(arch, seed)
        except (ImportError, ValueError) as e:
            raise ProtocolError("model-init", f"model {key!r}: cannot build {arch} seed {seed} here: {e}") from None
        got = tensors_sha256(weights)
        if got != meta["sha256"]:
            raise ProtocolError("model-init", f"model {key!r}: {arch} seed {seed} built here hashes to {got[:12]}, "
                                              f"the server's to {str(meta['sha256'])[:12]}")
        return weights

    def _apply_chain(self, key: str, body: bytes, meta: Mapping[str, Any],
                     have: HeldModel | None = None) -> tuple[int, dict[str, np.ndarray]]:
        """The chain of changes in ``body`` applied to ``have``, by default the version held."""
        method = Method(meta["codec"])
        steps = parse_chain(body, method)
        if have is None:
            with self.cv:
                have = self._models.get(key)
        if have is None or have.version is None:
            raise ProtocolError("model-base", f"changes of model {key!r} since version {meta['base']}, "
                                              "and no version of it is held")
        if steps and steps[-1].version != meta.get("version"):
            raise ProtocolError("compressed-index", f"changes of model {key!r} end at version "
                                                    f"{steps[-1].version}, the meta says {meta.get('version')}")
        try:
            return apply_steps(have.version, have.weights, steps, method)
        except ValueError as e:
            raise ProtocolError("model-base", f"model {key!r}: {e}") from None

    def put(self, key: str, held: HeldModel) -> None:
        """Hold ``held`` as model ``key`` (it replaces the one held)."""
        with self.cv:
            self._rewound.discard(key)
            self._models.pop(key, None)
            self._models[key] = held
            while len(self._models) > self.max_models:  # forget the oldest round first
                oldest = min(self._models, key=lambda k: self._models[k].round)
                del self._models[oldest]
            self.cv.notify_all()

    def get(self, key: str) -> HeldModel | None:
        with self.cv:
            return self._models.get(key)

    def wait(self, key: str, rnd: int, timeout_s: float) -> HeldModel:
        """Model ``key`` as received in round ``rnd`` or later, waiting up to ``timeout_s``.

        Raises
        ------
        TimeoutError
            When it did not arrive in time.
        """
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while True:
                got = self._models.get(key)
                if got is not None and got.round >= rnd:
                    return got
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"model {key!r} for round {rnd} did not arrive within {timeout_s:g} s")
                self.cv.wait(timeout=min(left, 0.5))

    def rewind(self) -> None:
        """The run's server is back (resumed): the next model of each key held replaces it, whatever its round."""
        with self.cv:
            self._rewound = set(self._models)

    def keys(self) -> list[str]:
        """The keys of the models held."""
        with self.cv:
            return list(self._models)

    def clear(self) -> None:
        with self.cv:
            self._models.clear()
            self._rewound.clear()

    def __len__(self) -> int:
        with self.cv:
            return len(self._models)
