"""The edge client (``fedsketch-client``): a device's side of the federation over MQTT.

It registers (hello: sample count, classes present, capabilities), sends its
sketch when asked, trains when commanded and sends the update with its sample
count, evaluates the model it was given, takes part in the federated
pre-training of the sketch autoencoder when asked ("train_ae", then the
exported encoder arrives as raw ONNX bytes, checked against its sha256 and
kept in a private models folder), and keeps going across broker
restarts (paho reconnects with back-off; the persistent session keeps its
subscriptions and queued QoS 1 messages). The application says when the
local data changed (``data_changed``). All work is done by an
:class:`edge_sdk.worker.LocalWorker`; this module only speaks the protocol,
and what each command does is in :mod:`edge_sdk.client_commands`. The
``fedsketch-client`` command is :mod:`edge_sdk.client_cli`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import queue
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .client_commands import SERVER_STATUS, VIA, ClientCommands, DeviceDrift
from .client_keep import KeepOutcome
from .compress import Compression, ErrorFeedback
from .held_models import HeldModel, ModelStore
from .keeping import ModelKeeper
from .protocol import SERVER_ID, Kind, Message, ProtocolError, Topics
from .rejections import RejectionLog
from .schema import check_meta
from .worker import LocalWorker

__all__ = ["KEEPS_MODELS", "EdgeClient"]

#: The capability a device's hello names when it keeps the model of each run (``--model-dir``).
KEEPS_MODELS = "keep-model"

log = logging.getLogger(__name__)


class EdgeClient(ClientCommands):
    """Answers the server's commands for one :class:`LocalWorker`.

    What each command does is in :class:`edge_sdk.client_commands.ClientCommands`
    (:meth:`handle`); this class holds the connection, the models received and
    the hello.

    Parameters
    ----------
    transport : MqttTransport or MemoryTransport
        Connected or not; :meth:`run` connects it.
    worker : LocalWorker
        The device's data and local operations.
    federation, root : str
        Topic namespace.
    seed : int, optional
        Seed of the sketch, the device's key for its life (default: drawn from the OS once).
    model_timeout_s : float
        How long a command waits for the model it names.
    max_models : int
        Most models kept at once (the oldest round is forgotten first), so
        that no stream of models can fill the device's memory.
    stay : bool
        Keep waiting for the next run when the server finishes (default:
        exit 0 when it says it has finished).
    progress_interval_s : float
        While training, a status saying which round it trains is sent this
        often, so that the server keeps the round open for a device that is
        slow but working.
    hello_jitter_s : float
        After every (re)connection the device says hello after a random wait
        of up to this many seconds, so that a fleet booting (or coming back
        after a broker restart) at once does not reach the broker in one
        instant. An answer to the server's own "hello" request is not delayed.
    encoders : dict, optional
        The cache of loaded ONNX encoders (name -> encoder). Clients in one
        process may share one dict, and so one ONNX Runtime session per
        encoder (an emulated fleet); by default each client has its own.
    bench : mapping, optional
        The hello fields of the device's own benchmark
        (:func:`edge_sdk.bench.summary.hello_fields`): the server lists each
        device's speed in its report.
    state_dir : path, optional
        A folder the device keeps across restarts: the error feedback of its
        compressed updates (what it has not sent yet) is saved there after
        every update and read back at start.
    keeper : ModelKeeper, optional
        The device's model folder: at the end of a run (the server's ``keep``
        command) the model it was assigned is kept there, by its keep policy
        (:mod:`edge_sdk.keeping`). None: the run's model is not kept.
    get_model : bool
        Leave once a ``keep`` command was done (``fedsketch-client --get-model``:
        a cold start), exit code 0 with a kept model, 6 without.
    """

    def __init__(
        self,
        transport: Any,
        worker: LocalWorker,
        *,
        federation: str = "default",
        root: str = "fedsketch",
        seed: int | None = None,
        model_timeout_s: float = 60.0,
        max_models: int = 8,
        stay: bool = False,
        progress_interval_s: float = 10.0,
        hello_jitter_s: float = 0.0,
        encoders: dict[str, Any] | None = None,
        bench: Mapping[str, Any] | None = None,
        state_dir: str | Path | None = None,
        keeper: ModelKeeper | None = None,
        get_model: bool = False,
    ) -> None:
        self.transport = transport
        self.worker = worker
        #: What the hello says of the device's own benchmark (``cpu``, ``bench``), or nothing.
        self.bench: dict[str, Any] = dict(bench or {})
        self.cid = worker.cid
        self.federation = federation
        self.topics = Topics(root, federation)
        self.seed = seed
        #: The sketch key and the last sketch sent, for :meth:`data_changed`.
        self.drift = DeviceDrift(seed)
        self.model_timeout_s = model_timeout_s
        #: The models held (whole or kept up to date by compressed changes), bounded by ``max_models``.
        self.store = ModelStore(max_models)
        #: The part of each delta not sent yet (compression on), per model key; kept in ``state_dir`` if given.
        self.feedback = ErrorFeedback(Compression())
        self.state_dir = None if state_dir is None else Path(state_dir)
        #: Where the run's model is kept (None: not kept), and what the last ``keep`` command came to.
        self.keeper = keeper
        self.kept: KeepOutcome | None = None
        self.get_model = bool(get_model)
        #: Whether the state folder's feedback was read (at the first compressed update: its method is known then).
        self._feedback_read = False
        self.model_key: str | None = None
        #: The model topic filters this device subscribes to (every model until an assign narrows it).
        self.followed: frozenset[str] = frozenset({self.topics.model("+")})
        self._welcomed = False
        self._models_cv = self.store.cv
        self._cmds: queue.Queue[Message] = queue.Queue(maxsize=1000)
        self._encoders: dict[str, Any] = {} if encoders is None else encoders
        #: Encoders received from the server: name -> the folder holding it and its manifest.
        self.encoder_dirs: dict[str, Path] = {}
        self._encoder_root: Path | None = None
        #: Why received encoders were refused (for logs and tests).
        self.rejected_encoders: list[str] = []
        self._stop = threading.Event()
        self.handled: dict[str, int] = {}
        self.stay = bool(stay)
        self.progress_interval_s = float(progress_interval_s)
        if not float(hello_jitter_s) >= 0:
            raise ValueError(f"hello_jitter_s must be a non-negative number of seconds, got {hello_jitter_s!r}")
        self.hello_jitter_s = float(hello_jitter_s)
        self._hello_due: float | None = None  # when the scheduled hello goes out (monotonic), if one is
        self._hello_lock = threading.Lock()
        self._jitter = random.Random()  # from the OS: devices must not jitter alike
        self._commands_run = 0
        #: What :func:`main` exits with: 0, 4 when the server refused this device, 5 when the server failed.
        self.exit_code = 0
        #: The run the server last announced (its status), None before the first announcement.
        self.run_id: str | None = None
        #: Runs announced while this device served (the first one included).
        self.runs_seen = 0
        #: Whether the server's last status said it is online (None: no status seen yet).
        self.server_online: bool | None = None
        #: The network thread's own record that the server said it was away (:meth:`ModelStore.rewind` on its return).
        self._server_was_away = False
        #: Why the server refused this device (None while admitted or not yet answered).
        self.refused_reason: str | None = None
        self._connections = 0
        self._rejections = RejectionLog(log)
        #: Refused commands and models per reason (logged once per reason per interval).
        self.rejected: dict[str, int] = self._rejections.counts

    @property
    def max_models(self) -> int:
        """Most models held at once (the store's bound)."""
        return self.store.max_models

    # -- transport callbacks (network thread: enqueue only) ---------------
    def _on_cmd(self, topic: str, msg: Message) -> None:
        if msg.kind == Kind.MODEL and msg.sender == SERVER_ID and topic == self.topics.cmd(self.cid):
            self._on_model(topic, msg)  # a model for this client alone, ahead of the command that uses it
            return
        if msg.kind != Kind.CMD or msg.sender != SERVER_ID:
            self._rejections("sender", msg.sender, f"ignoring {msg.kind.name} on {topic}")
            return
        # which topic it came by (a broadcast may not concern this device); set here, never by the sender
        self._enqueue(msg, "broadcast" if topic == self.topics.broadcast() else "cmd")

    def _enqueue(self, msg: Message, via: str) -> None:
        """Queue a message from the server for the client's loop, marked with the way it came (``VIA``)."""
        msg = dataclasses.replace(msg, meta={**msg.meta, VIA: via})
        try:
            self._cmds.put_nowait(msg)
        except queue.Full:
            what = msg.meta.get("op") if via != SERVER_STATUS else "the server's status"
            self._rejections("queue-full", msg.sender, f"command queue full; dropping {what!r}")

    def _on_model(self, topic: str, msg: Message) -> None:
        if msg.kind != Kind.MODEL or msg.sender != SERVER_ID:
            return
        try:
            meta = check_meta(msg)
            key = meta["key"]
            if key == "encoder":  # raw ONNX bytes, not tensors
                self._on_encoder(msg)
                return
            self.store.receive(key, msg, meta)
        except ProtocolError as e:
            self._rejections(e.reason, msg.sender, f"model for round {msg.round}: {e}")
        except Exception as e:  # never let a message end the device
            self._rejections("handler-error", msg.sender, f"model: {type(e).__name__}: {e}")

    def _reject_encoder(self, reason: str) -> None:
        self.rejected_encoders.append(reason)
        log.error("rejected encoder: %s", reason)

    def _on_encoder(self, msg: Message) -> None:
        """Keep an encoder the server sent, if its bytes match the sha256 of its meta and entry."""
        m = msg.meta
        name, sha, entry = m.get("name"), m.get("sha256"), m.get("entry")
        if not isinstance(name, str) or not name or Path(name).name != name or name.startswith("."):
            return self._reject_encoder(f"invalid encoder name {name!r}")
        if not isinstance(sha, str) or not isinstance(entry, dict):
            return self._reject_encoder(f"encoder {name!r}: meta lacks sha256 or its manifest entry")
        actual = hashlib.sha256(msg.body).hexdigest()
        if actual != sha.lower():
            return self._reject_encoder(f"encoder {name!r}: bytes have sha256 {actual}, meta says {sha}")
        if str(entry.get("sha256", "")).lower() != actual:
            return self._reject_encoder(f"encoder {name!r}: manifest entry sha256 differs from the bytes'")
        fname = entry.get("file")
        if not isinstance(fname, str) or Path(fname).name != fname or not fname.endswith(".onnx"):
            return self._reject_encoder(f"encoder {name!r}: invalid file name {fname!r}")
        try:
            from .artifacts import ArtifactSpec

            ArtifactSpec.from_entry(name, entry)
            if self._encoder_root is None:
                self._encoder_root = Path(tempfile.mkdtemp(prefix=f"fedsketch-{self.cid}-encoders-"))
            folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self._encoder_root))
            (folder / fname).write_bytes(msg.body)
            (folder / "manifest.json").write_text(json.dumps({"artifacts": {name: entry}}, indent=1))
        except (ValueError, TypeError, KeyError, OSError) as e:
            return self._reject_encoder(f"encoder {name!r}: {e}")
        with self._models_cv:
            self.encoder_dirs[name] = folder
            self._encoders.pop(name, None)
            self._models_cv.notify_all()
        log.info("received encoder %s (%d bytes)", name, len(msg.body))

    def _wait_model(self, key: str, rnd: int) -> HeldModel:
        return self.store.wait(key, rnd, self.model_timeout_s)

    # -- outgoing -----------------------------------------------------------
    def _send(self, topic: str, kind: Kind, rnd: int = 0, meta: Mapping[str, Any] | None = None,
              body: bytes = b"") -> None:
        self.transport.publish(topic, Message(kind, self.federation, self.cid, rnd, dict(meta or {}), body))

    def hello(self) -> None:
        """Register now: one HELLO (the server takes it as "online": no STATUS goes with it).

        A hello scheduled by a (re)connection and not yet sent is cancelled:
        this one says the same.
        """
        with self._hello_lock:
            self._hello_due = None
        meta = {**self.worker.hello(), **self.bench}
        if self.keeper is not None:  # the server sends the run's last model only to devices that keep it
            meta["capabilities"] = [*meta["capabilities"], KEEPS_MODELS]
        self._send(self.topics.hello(self.cid), Kind.HELLO, meta=meta)

    @property
    def hello_due(self) -> float | None:
        """When the hello scheduled by the last (re)connection goes out (``time.monotonic()``), or None.

        :meth:`step` (and :meth:`run`) send it once due; a driver stepping
        many clients wakes this one then.
        """
        return self._hello_due

    def _hello_if_due(self) -> None:
        with self._hello_lock:
            due = self._hello_due
            if due is None or due > time.monotonic():
                return
        try:
            self.hello()
        except (ConnectionError, ValueError) as e:  # closed meanwhile: the next connection says it again
            log.warning("hello not sent: %s", e)

    def schedule_hello(self) -> float:
        """Say hello up to ``hello_jitter_s`` from now (:meth:`step` sends it when due); returns the wait.

        A hello already scheduled keeps its (earlier) time.
        """
        delay = self._jitter.uniform(0.0, self.hello_jitter_s) if self.hello_jitter_s else 0.0
        with self._hello_lock:
            due = time.monotonic() + delay
            if self._hello_due is None or due < self._hello_due:
                self._hello_due = due
            return max(0.0, self._hello_due - time.monotonic())

    def _on_connected(self) -> None:
        """Every (re)connection: schedule a hello, up to ``hello_jitter_s`` from now (network thread: no wait).

        :meth:`step` sends it when due; nothing here blocks the network thread.
        """
        self._connections += 1
        delay = self.schedule_hello()
        if self._connections > 1:
            log.info("reconnected: announcing this device again in %.1f s", delay)

    def _on_server_status_msg(self, topic: str, msg: Message) -> None:
        """The server's status (network thread): queued, handled on the client's loop between two commands."""
        if msg.kind != Kind.STATUS or msg.sender != SERVER_ID:
            self._rejections("sender", msg.sender, f"ignoring {msg.kind.name} on {topic}")
            return
        state = msg.meta.get("state")
        if state == "offline":
            self._server_was_away = True
        elif state == "online" and self._server_was_away:
            # here, before the models the server sends next: a resumed run's rounds may be below the ones held
            self._server_was_away = False
            self.store.rewind()
        self._enqueue(msg, SERVER_STATUS)

    def _forget_run(self) -> None:
        """A new run: drop what the last one left (admission, model, models and encoders received)."""
        self._welcomed = False
        self.model_key = None
        self.refused_reason = None
        self._follow(["+"], confirm=False)
        self.feedback.reset()  # what was not sent belongs to the last run's models
        self.save_feedback()
        with self._models_cv:
            self.store.clear()
            for name in self.encoder_dirs:
                self._encoders.pop(name, None)
            self.encoder_dirs.clear()
        self._remove_encoder_folders()

    def _remove_encoder_folders(self) -> None:
        """Delete the folder of the encoders received (nothing of a run stays on the device's disk)."""
        root, self._encoder_root = self._encoder_root, None
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)

    def start(self) -> None:
        """Connect, subscribe, register (and register again after every reconnection)."""
        self.transport.subscribe(self.topics.cmd(self.cid), self._on_cmd)
        self.transport.subscribe(self.topics.broadcast(), self._on_cmd)
        self.transport.subscribe(self.topics.server_status(), self._on_server_status_msg)
        for f in sorted(self.followed):  # every model until an assign says which to follow
            self.transport.subscribe(f, self._on_model)
        self.transport.on_connected(self._on_connected)
        self.transport.connect()
        if self._connections == 0:  # connected before this listener was added (connect(wait=False) on a loop)
            self._on_connected()
        log.info("connected as %s; hello in %.1f s (%d samples)", self.cid,
                 max(0.0, (self._hello_due or time.monotonic()) - time.monotonic()), len(self.worker.y))

    def step(self, timeout: float = 0.0) -> bool:
        """Send the scheduled hello if due, then handle at most one queued command.

        For a driver that runs many clients without a thread each (see
        :mod:`server_kit.emulate`): call it when the transport delivered
        something (:meth:`MqttTransport.on_delivered`) or at :attr:`hello_due`.

        Parameters
        ----------
        timeout : float
            Seconds to wait for a command (0: take one only if queued); the
            wait ends early when the scheduled hello falls due.

        Returns
        -------
        bool
            False once this client is done (the server said stop or refused
            it, or :meth:`stop` was called), True otherwise.
        """
        if self._stop.is_set():
            return False
        self._hello_if_due()
        due = self._hello_due
        wait = timeout if due is None else min(timeout, max(0.0, due - time.monotonic()))
        try:
            msg = self._cmds.get(timeout=wait) if wait > 0 else self._cmds.get_nowait()
        except queue.Empty:
            self._hello_if_due()
            return not self._stop.is_set()
        self._commands_run += 1
        if not self.handle(msg):
            self._stop.set()
            return False
        return not self._stop.is_set()

    def run(self, *, max_idle_s: float | None = None) -> None:
        """Process commands until ``stop`` (or ``max_idle_s`` without any command); then :meth:`close`."""
        try:
            self.start()
            idle_since = time.monotonic()
            seen = self._commands_run
            while self.step(timeout=0.5):
                if self._commands_run != seen:
                    seen, idle_since = self._commands_run, time.monotonic()
                elif max_idle_s is not None and time.monotonic() - idle_since > max_idle_s:
                    log.warning("no command for %g s: leaving", max_idle_s)
                    break
        finally:
            self.close()

    def close(self) -> None:
        """Disconnect and delete the encoders received: the device keeps nothing of its runs on disk."""
        try:
            self.transport.close()
        finally:
            self._remove_encoder_folders()

    def stop(self) -> None:
        self._stop.set()
