"""How a trained model goes up: one codec chosen once per run, the identity one when nothing is compressed.

A run's ``--compress`` setting (:class:`~.codec.Compression`) picks an
:class:`UpdateCodec` with :func:`update_codec`; the device, the server's
intake, the ingest workers and the simulator all ask it, and none of them asks
whether compression is on:

- :class:`WholeWeights` (``none``): the body is the trained model as
  safetensors; no version is named or checked; nothing is kept back.
- :class:`CompressedDelta` (``int8``, ``topk:f``, ``stc:f``): the body is the
  change from the model version the device holds (:func:`~.codec.encode_delta`,
  with the device's error feedback); the update names that version, which must
  be the round's; the server adds the decoded change to that model
  (:func:`with_delta`, the one decompression of both sides).

Every refusal is a :class:`~edge_sdk.protocol.ProtocolError` with the reasons
of :func:`~.codec.decode_delta`, ``tensors`` (a bad safetensors body) or
``wrong-version``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from ..protocol import ProtocolError, parse_tensors, tensors_body
from .codec import Compression, add_change, decode_delta
from .feedback import ErrorFeedback

__all__ = ["CompressedDelta", "DecodedUpdate", "DeviceFeedback", "InMemoryFeedback", "UpdateCodec", "WholeWeights",
           "check_compression_pair", "compression_for", "device_feedback", "update_codec", "with_delta"]

#: A tensor's shape and dtype by name: what the receiver expects (:func:`edge_sdk.protocol.parse_tensors`).
Spec = Mapping[str, tuple[tuple[int, ...], str]]


def with_delta(base: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``base + delta`` per tensor (:func:`~.codec.add_change`: float32, integer counters rounded and kept integer).

    The one decompression: the server's and the workers' bits agree.
    """
    return {n: np.asarray(add_change(base[n], delta[n])) for n in base}


@dataclass(frozen=True)
class DecodedUpdate:
    """An update's body as the server reads it: whole ``weights``, or the ``delta`` from version ``version``."""

    weights: dict[str, np.ndarray]
    delta: dict[str, np.ndarray] | None = None
    version: int | None = None


class DeviceFeedback(Protocol):
    """Where a device keeps its error feedback across restarts (the client's state folder)."""

    feedback: ErrorFeedback

    def load_feedback(self, comp: Compression) -> None:
        """Read the kept feedback back, once, if it is of method ``comp``."""
        ...

    def save_feedback(self) -> None:
        """Keep the feedback (after every compressed update)."""
        ...


@dataclass
class InMemoryFeedback:
    """A device's error feedback kept in memory only (the simulator's devices, a device without a state folder)."""

    feedback: ErrorFeedback

    def load_feedback(self, comp: Compression) -> None:
        return None

    def save_feedback(self) -> None:
        return None


class UpdateCodec(ABC):
    """How the run's updates come up. Immutable; :func:`update_codec` builds it from the run's setting."""

    def __init__(self, compression: Compression) -> None:
        self.compression = compression

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.compression})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.compression == self.compression  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.compression))

    @property
    @abstractmethod
    def command_meta(self) -> dict[str, Any]:
        """What a ``train`` command says of the update wanted (``{}``: whole weights)."""

    @abstractmethod
    def base_meta(self, version: int | None) -> dict[str, Any]:
        """What an ingest worker is told of the model version the round's updates start from (``COLLECT``)."""

    @abstractmethod
    def encode(self, model_key: str, trained: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray],
               start_version: int | None, device: DeviceFeedback, *, lean: bool = False
               ) -> tuple[bytes, dict[str, Any], dict[str, np.ndarray] | None]:
        """A device's update of ``model_key``: the body, the meta it adds, and the delta the server decodes.

        ``start`` is the model trained from, of version ``start_version``.
        ``lean`` (a device): ``trained`` is the caller's to lose (the delta is
        computed in its float32 arrays) and no dense copy of what was sent is
        built (the third value is None), so that compressing adds little
        memory beyond the residual the device keeps.
        """

    @abstractmethod
    def check_version(self, key: str, named: Any, have: int | None) -> None:
        """Refuse (``wrong-version``) an update that names another version of ``key`` than the round's ``have``."""

    @abstractmethod
    def decode(self, body: bytes, spec: Spec, version: int | None) -> DecodedUpdate:
        """An update's body, checked whole before anything of its size is built."""

    @staticmethod
    def weights(decoded: DecodedUpdate, base: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The trained model: the whole weights, or ``base`` (the version it started from) plus the delta."""
        return decoded.weights if decoded.delta is None else with_delta(base, decoded.delta)


class WholeWeights(UpdateCodec):
    """``none``: whole float32 models, as safetensors."""

    @property
    def command_meta(self) -> dict[str, Any]:
        return {}

    def base_meta(self, version: int | None) -> dict[str, Any]:
        return {}

    def encode(self, model_key, trained, start, start_version, device, *, lean=False):
        return tensors_body(trained), {}, None

    def check_version(self, key: str, named: Any, have: int | None) -> None:
        return None

    def decode(self, body: bytes, spec: Spec, version: int | None) -> DecodedUpdate:
        return DecodedUpdate(parse_tensors(body, spec=spec))


class CompressedDelta(UpdateCodec):
    """``int8``, ``topk:f``, ``stc:f``: the change from the version held, with error feedback."""

    @property
    def command_meta(self) -> dict[str, Any]:
        return {"compress": self.compression.to_meta()}

    def base_meta(self, version: int | None) -> dict[str, Any]:
        return {"version": version, **self.command_meta}

    def encode(self, model_key, trained, start, start_version, device, *, lean=False):
        if start_version is None:
            raise ValueError(f"compressed updates asked, but model {model_key!r} came without a version")
        device.load_feedback(self.compression)
        device.feedback.set_compression(self.compression)
        delta = {n: _delta(trained[n], start[n], in_place=lean) for n in start}
        body, sent = device.feedback.compress(model_key, delta, keep_sent=not lean)
        device.save_feedback()
        return body, {"version": start_version}, sent

    def check_version(self, key: str, named: Any, have: int | None) -> None:
        if named != have:
            raise ProtocolError("wrong-version", f"update from model {key!r} version {named}; "
                                                 f"the round's is version {have}")

    def decode(self, body: bytes, spec: Spec, version: int | None) -> DecodedUpdate:
        return DecodedUpdate({}, decode_delta(body, spec, self.compression.method), version)


def _delta(trained: np.ndarray, start: np.ndarray, *, in_place: bool) -> np.ndarray:
    """``trained - start`` in float32, in ``trained``'s own array when allowed and possible."""
    t = np.asarray(trained)
    if in_place and t.dtype == np.float32 and t.flags.writeable and t.shape == np.shape(start):
        return np.subtract(t, start, out=t)
    return np.asarray(np.subtract(t, start, dtype=np.float32))


def device_feedback(comp: Compression) -> ErrorFeedback:
    """A device's error feedback: its residual in float16 (half the model's size; only the device reads it)."""
    return ErrorFeedback(comp, residual_dtype=np.float16)


def compression_for(comp: Compression, refusal: str | None, who: str, *, asked: bool = True) -> Compression:
    """The compression a run of a method takes: ``comp``, unless the method cannot take compressed updates.

    ``refusal``: why the method cannot (None: it can). Then a ``comp`` that
    was only a default (``asked`` False) becomes ``none`` (whole weights),
    and one that was asked for is refused: ``ValueError`` naming ``who``,
    ``comp`` and the reason.
    """
    if not comp.enabled or not refusal:
        return comp
    if asked:
        raise ValueError(f"{who} cannot use --compress {comp}: {refusal}")
    return Compression()


def check_compression_pair(up: Compression, down: Compression, who: str) -> None:
    """Refuse compressed updates with whole models down.

    A compressed update is the change from a model version the server keeps,
    and versions are kept only when models go down compressed
    (``server_kit.downstream.ModelVersions``).
    """
    if up.enabled and not down.enabled:
        raise ValueError(
            f"{who} cannot send updates as {up} while models go down whole (none): a compressed update is the "
            "change from a model version the server keeps, and versions are kept only when models go down "
            "compressed; set --compress-down too (int8, int4, sign, topk or stc), or --compress-up none")


def update_codec(compression: Compression | str | None) -> UpdateCodec:
    """The codec of a run's setting (a :class:`Compression`, its text, or None for ``none``)."""
    comp = compression if isinstance(compression, Compression) else Compression.parse(compression or "none")
    return CompressedDelta(comp) if comp.enabled else WholeWeights(comp)
