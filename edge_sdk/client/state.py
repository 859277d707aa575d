"""What the server's runs gave a device, in one object: :class:`DeviceState`.

The command handlers (:mod:`edge_sdk.client.commands`) read and change it;
the connection (:mod:`edge_sdk.client.link`) puts the models it receives in
it; :class:`edge_sdk.client.EdgeClient` shows it. A new run drops what the
last one left (:meth:`DeviceState.forget_run`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..compress import Compression, ErrorFeedback
from ..compress.update_codec import device_feedback
from ..health import DeviceHealth, read_health
from ..models.held_models import ModelStore
from ..models.keeping import ModelKeeper
from ..models.model_folder import WEIGHTS
from ..protocol import Message
from ..secure import DeviceKeys, DeviceSecureRound
from .encoders import ReceivedEncoders
from .keep import KeepOutcome

__all__ = ["DeviceState", "SentUpdate", "kept_label"]

# the device's log keeps its one name: these lines were the client's and still are
log = logging.getLogger("edge_sdk.client")


@dataclass(frozen=True)
class SentUpdate:
    """An update as it went out: its round, topic, meta and body (sent again as it is when asked)."""

    round: int
    topic: str
    meta: Mapping[str, Any]
    body: bytes


@dataclass(eq=False)
class DeviceState:
    """A device's admission, models, cluster, error feedback and kept model, and its record of the runs.

    It is also where the device keeps the error feedback of its compressed
    updates (:class:`edge_sdk.compress.update_codec.DeviceFeedback`): in
    memory, and in ``state_dir`` when the device has one.
    """

    #: The models held (whole or kept up to date by compressed changes), bounded by ``max_models``.
    store: ModelStore
    #: The encoders the server sent (federated pre-training), and the cache of loaded encoders.
    encoders: ReceivedEncoders
    #: A folder the device keeps across restarts (the error feedback is saved there), or None.
    state_dir: Path | None = None
    #: The part of each delta not sent yet (compression on), per model key.
    feedback: ErrorFeedback = field(default_factory=lambda: device_feedback(Compression()))
    #: Whether the state folder's feedback was read (at the first compressed update: its method is known then).
    feedback_read: bool = False
    #: The run the server last announced (its status, or its welcome), None before the first.
    run_id: str | None = None
    #: Runs announced while this device served (the first one included).
    runs_seen: int = 0
    #: Whether the server's last status said it is online (None: no status seen yet).
    server_online: bool | None = None
    #: Whether the server admitted this device to the current run (its ``welcome``).
    welcomed: bool = False
    #: Why the server refused this device (None while admitted or not yet answered).
    refused_reason: str | None = None
    #: The model (cluster) the server assigned this device, None before its ``assign``.
    model_key: str | None = None
    #: What the last ``keep`` command that concerned this device came to.
    kept: KeepOutcome | None = None
    #: What the device exits with: 0, 4 when the server refused it, 5 when the server failed, 6 with no model.
    exit_code: int = 0
    #: Commands handled, per op.
    handled: dict[str, int] = field(default_factory=dict)
    #: The last update sent, kept until the next one: the server may ask for it again (``resend``).
    last_update: SentUpdate | None = None
    #: Seconds the last round took, from its train command to its update sent (None before the first).
    round_s: float | None = None
    #: The model kept in the device's model folder (:func:`kept_label`), None while none is known.
    kept_model: str | None = None
    #: Secure aggregation: this device's key pair (its public half goes with the hello), and its open rounds'
    #: parts by (round, model), the last few only (:mod:`edge_sdk.client.secure`).
    secure_keys: DeviceKeys = field(default_factory=DeviceKeys.generate)
    secure_rounds: dict[tuple[int, str], DeviceSecureRound] = field(default_factory=dict)

    def health(self) -> DeviceHealth:
        """The device's health now (:func:`edge_sdk.health.read_health`): what its board exposes, its last
        round's duration, the version of its assigned model (models sent down compressed), its kept model."""
        held = None if self.model_key is None else self.store.get(self.model_key)
        return read_health(round_s=None if self.round_s is None else round(self.round_s, 3),
                           model_version=None if held is None else held.version, kept=self.kept_model)

    def receive_model(self, msg: Message, meta: Mapping[str, Any]) -> None:
        """A MODEL message from the server (its checked ``meta``): an encoder, or a model for the store.

        Raises
        ------
        ProtocolError
            What :meth:`ModelStore.receive` refuses.
        """
        key = meta["key"]
        if key == "encoder":  # raw ONNX bytes, not tensors
            self.encoders.receive(msg)
        else:
            self.store.receive(key, msg, meta)

    def forget_run(self) -> None:
        """A new run: drop what the last one left (admission, cluster, feedback, models and encoders received)."""
        self.welcomed = False
        self.model_key = None
        self.refused_reason = None
        self.feedback.reset()  # what was not sent belongs to the last run's models
        self.save_feedback()
        self.store.clear()
        self.encoders.clear()

    def load_feedback(self, comp: Compression) -> None:
        """Once, at the first compressed update: the error feedback the state folder kept, if of this method."""
        if self.feedback_read or self.state_dir is None:
            return
        self.feedback_read = True
        self.feedback.set_compression(comp)
        if self.feedback.load(self.state_dir):
            log.info("error feedback of %s restored from %s", ", ".join(self.feedback.keys) or "no model",
                     self.state_dir)

    def save_feedback(self) -> None:
        """Keep the error feedback in the state folder, if the device has one (a failure is logged, not fatal)."""
        if self.state_dir is None:
            return
        try:
            self.feedback.save(self.state_dir)
        except OSError as e:
            log.error("error feedback not saved in %s: %s", self.state_dir, e)


def kept_label(keeper: ModelKeeper | None) -> str | None:
    """The model ``keeper`` keeps, as the device's health says it: its key and the first 12 hex digits of its
    weights' sha256 (``c0@1a2b3c4d5e6f``); None when none is kept (or no model folder).

    The kept folder is read and checked (:meth:`ModelKeeper.kept`): once after a ``keep``, not per message.
    """
    entry = None if keeper is None else keeper.kept()
    sha = None if entry is None else entry.files.get(WEIGHTS)
    return None if entry is None or not sha else f"{entry.key[:51]}@{str(sha)[:12]}"
