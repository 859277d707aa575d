"""The models a device holds: what the server sent, whole or as compressed changes, and the wait for one.

A model arrives whole (safetensors) or, with compression on, as the chain of
its compressed changes since a version the device holds
(:mod:`edge_sdk.compress.steps`): the device applies the changes it lacks,
with the same float32 addition as the server, so that its copy is bit-identical
to the server's. A chain that starts after the version held (the device missed
more than the server knew) cannot be applied: it is refused with reason
``model-base`` and the model stays as it was (the command that needs it times
out; the server sends the whole model once the device says which version it holds).

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
from typing import Any

import numpy as np

from .compress import Method, apply_steps, parse_chain
from .protocol import Message, ProtocolError, parse_tensors

__all__ = ["HeldModel", "ModelStore"]


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

    def __init__(self, max_models: int = 8) -> None:
        if int(max_models) < 1:
            raise ValueError(f"max_models must be a positive integer, got {max_models!r}")
        self.max_models = int(max_models)
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
        if "base" not in meta:
            held = HeldModel(msg.round, parse_tensors(msg.body), version)
        else:
            method = Method(meta["codec"])
            steps = parse_chain(msg.body, method)
            with self.cv:
                have = self._models.get(key)
            if have is None or have.version is None:
                raise ProtocolError("model-base", f"changes of model {key!r} since version {meta['base']}, "
                                                  "and no version of it is held")
            if steps and steps[-1].version != version:
                raise ProtocolError("compressed-index", f"changes of model {key!r} end at version "
                                                        f"{steps[-1].version}, the meta says {version}")
            try:
                v, weights = apply_steps(have.version, have.weights, steps, method)
            except ValueError as e:
                raise ProtocolError("model-base", f"model {key!r}: {e}") from None
            held = HeldModel(msg.round, weights, v)
        self.put(key, held)
        return held

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
