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
:class:`edge_sdk.worker.LocalWorker`; this module only speaks the protocol.

The device is in parts, each with one job: :mod:`edge_sdk.client.state`
(what the runs gave it), :mod:`edge_sdk.client.link` (its connection),
:mod:`edge_sdk.client.commands` (what each command does),
:mod:`edge_sdk.client.encoders` (the encoders received),
:mod:`edge_sdk.client.drift` (its own drift signal) and
:mod:`edge_sdk.client.keep` (the end of a run's ``keep``). The
``fedsketch-client`` command is :mod:`edge_sdk.client.cli`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping
from operator import attrgetter
from pathlib import Path
from typing import Any

from ..models.held_models import ModelStore
from ..models.keeping import ModelKeeper
from ..privacy import SketchBudget
from ..protocol import Kind, Message, Topics
from ..protocol.commands import Op
from ..rejections import RejectionLog
from ..worker import LocalWorker
from .commands import HANDLERS, DeviceContext, Handler, handle
from .drift import DeviceDrift
from .encoders import ReceivedEncoders
from .link import DeviceLink
from .state import DeviceState, kept_label

__all__ = ["KEEPS_MODELS", "EdgeClient"]

#: The capability a device's hello names when it keeps the model of each run (``--model-dir``).
KEEPS_MODELS = "keep-model"

log = logging.getLogger(__name__)


class _Part:
    """An attribute of one of the client's parts (``part``: its dotted path from the client), read and set
    through the client."""

    def __init__(self, part: str, name: str | None = None) -> None:
        self._part = attrgetter(part)
        self._name = name

    def __set_name__(self, owner: type, name: str) -> None:
        if self._name is None:
            self._name = name

    def __get__(self, client: Any, owner: type | None = None) -> Any:
        return self if client is None else getattr(self._part(client), self._name)

    def __set__(self, client: Any, value: Any) -> None:
        setattr(self._part(client), self._name, value)


class EdgeClient:
    """Answers the server's commands for one :class:`LocalWorker`.

    It puts together the device's parts: what the runs gave it
    (:attr:`state`, a :class:`~edge_sdk.client.state.DeviceState`), its
    connection (:attr:`link`, a :class:`~edge_sdk.client.link.DeviceLink`)
    and what its command handlers work with (:attr:`context`, a
    :class:`~edge_sdk.client.commands.DeviceContext`); it runs the loop that
    gives each command to its handler (the table of the ``handlers`` argument, by op), and says
    hello. The state's and the parts' attributes read through it
    (``client.model_key``, ``client.store``, ``client.followed``, ...).

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
        (:mod:`edge_sdk.models.keeping`). None: the run's model is not kept.
    get_model : bool
        Leave once a ``keep`` command was done (``fedsketch-client --get-model``:
        a cold start), exit code 0 with a kept model, 6 without.
    max_sketch_epsilon : float, optional
        The owner's budget for this device's sketches, user level
        (:class:`edge_sdk.privacy.SketchBudget`): a sketch that would take the
        total past it is not sent, and the server is told so. None: no limit
        (each sketch's epsilon is still logged).
    handlers : mapping, optional
        The handler of each command, by op; default
        :data:`edge_sdk.client.commands.HANDLERS`. A device that answers a
        command its own way (a test's hostile device) gives
        ``{**HANDLERS, Op.TRAIN: its_train}``.
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
        max_sketch_epsilon: float | None = None,
        handlers: Mapping[Op, Handler] | None = None,
    ) -> None:
        #: What the hello says of the device's own benchmark (``cpu``, ``bench``), or nothing.
        self.bench: dict[str, Any] = dict(bench or {})
        self.cid = worker.cid
        self.federation = federation
        self.topics = Topics(root, federation)
        self._rejections = RejectionLog(log)
        #: Refused commands and models per reason (logged once per reason per interval).
        self.rejected: dict[str, int] = self._rejections.counts
        store = ModelStore(max_models)
        #: What the server's runs gave this device.
        self.state = DeviceState(store=store, encoders=ReceivedEncoders(self.cid, store.cv, encoders),
                                 state_dir=None if state_dir is None else Path(state_dir))
        #: The connection: topics, the command queue, the models followed, the hello's time.
        self.link = DeviceLink(transport, cid=self.cid, federation=federation, topics=self.topics,
                               receive_model=self.state.receive_model, server_back=store.rewind,
                               rejections=self._rejections, hello_jitter_s=hello_jitter_s)
        #: What the command handlers work with besides the state.
        self.context = DeviceContext(worker=worker, link=self.link, drift=DeviceDrift(seed),
                                     reject=self._rejections, hello=self.hello, stop=self.stop, keeper=keeper,
                                     seed=seed, model_timeout_s=model_timeout_s,
                                     progress_interval_s=float(progress_interval_s), stay=bool(stay),
                                     get_model=bool(get_model),
                                     sketch_budget=None if max_sketch_epsilon is None
                                     else SketchBudget(float(max_sketch_epsilon)))
        self._handlers: dict[Op, Handler] = dict(HANDLERS if handlers is None else handlers)
        self._stop = threading.Event()
        self._commands_run = 0
        self._health_said = False

    # -- what the runs gave the device (DeviceState) -------------------------------------
    store = _Part("state")
    feedback = _Part("state")
    state_dir = _Part("state")
    run_id = _Part("state")
    runs_seen = _Part("state")
    server_online = _Part("state")
    refused_reason = _Part("state")
    model_key = _Part("state")
    kept = _Part("state")
    exit_code = _Part("state")
    handled = _Part("state")
    load_feedback = _Part("state")
    save_feedback = _Part("state")
    encoder_dirs = _Part("state.encoders", "dirs")
    rejected_encoders = _Part("state.encoders", "rejected")
    # -- what the handlers work with (DeviceContext) ---------------------------------------
    worker = _Part("context")
    drift = _Part("context")
    keeper = _Part("context")
    seed = _Part("context")
    model_timeout_s = _Part("context")
    progress_interval_s = _Part("context")
    stay = _Part("context")
    get_model = _Part("context")
    # -- the connection (DeviceLink) --------------------------------------------------------
    transport = _Part("link")
    followed = _Part("link")
    hello_jitter_s = _Part("link")

    @property
    def max_models(self) -> int:
        """Most models held at once (the store's bound)."""
        return self.store.max_models

    # -- the hello ----------------------------------------------------------------------------
    def hello(self) -> None:
        """Register now: one HELLO (the server takes it as "online": no STATUS goes with it), with the device's
        health (:meth:`~edge_sdk.client.state.DeviceState.health`; what the board does not expose is logged once).

        A hello scheduled by a (re)connection and not yet sent is cancelled:
        this one says the same.
        """
        self.link.hello_sent()
        meta = {**self.worker.hello(), **self.bench, "secure_key": self.state.secure_keys.public_bytes.hex()}
        if self.keeper is not None:  # the server sends the run's last model only to devices that keep it
            meta["capabilities"] = [*meta["capabilities"], KEEPS_MODELS]
            if self.state.kept_model is None:  # kept by an earlier run (or process): read once
                self.state.kept_model = kept_label(self.keeper)
        health = self.state.health()
        if not self._health_said:
            self._health_said = True
            if health.not_exposed():
                log.info("device health: %s", health.not_exposed())
        if health.to_meta():
            meta["health"] = health.to_meta()
        self.link.send(self.topics.hello(self.cid), Kind.HELLO, meta=meta)

    @property
    def hello_due(self) -> float | None:
        """When the hello scheduled by the last (re)connection goes out (``time.monotonic()``), or None.

        :meth:`step` (and :meth:`run`) send it once due; a driver stepping
        many clients wakes this one then.
        """
        return self.link.hello_due

    def schedule_hello(self) -> float:
        """Say hello up to ``hello_jitter_s`` from now (:meth:`step` sends it when due); returns the wait.

        A hello already scheduled keeps its (earlier) time.
        """
        return self.link.schedule_hello()

    def _hello_if_due(self) -> None:
        if not self.link.hello_is_due():
            return
        try:
            self.hello()
        except (ConnectionError, ValueError) as e:  # closed meanwhile: the next connection says it again
            log.warning("hello not sent: %s", e)

    # -- the loop -----------------------------------------------------------------------------
    def handle(self, msg: Message) -> bool:
        """Do one message of the loop (:func:`edge_sdk.client.commands.handle`); False when told to stop."""
        return handle(self.state, msg, self.context, self._handlers)

    def data_changed(self, x: Any, y: Any, x_test: Any = None, y_test: Any = None) -> None:
        """Say that the device's local data changed: a moved camera, another user (thread-safe).

        Any thread may call it. The client's own loop (:meth:`run`, or
        :meth:`step` for a driver that steps clients itself: step the client
        after this call) then, between two commands (never during training),
        gives the worker the new data (:meth:`~edge_sdk.worker.LocalWorker.replace_data`;
        test data default to the training data), sketches it with the
        device's own sketcher (its key unchanged) and, when the new sketch is
        farther from the last one sent than flip noise explains
        (:class:`edge_sdk.drift.DriftWatch`), sends it unasked: a server
        that follows drift may move the device to another cluster. A smaller
        change sends nothing, nor does a device that never sent a sketch (the
        server's request will get the new data). The sample count of the
        hello is not said again: the server weighs the device's updates by at
        most the one it registered. See :func:`edge_sdk.client.commands.apply_data_change`.

        Raises
        ------
        ValueError
            If ``x`` and ``y`` differ in length or are empty (in the caller's thread).
        """
        if len(x) != len(y):
            raise ValueError(f"x and y differ in length: {len(x)} vs {len(y)}")
        if len(y) == 0:
            raise ValueError(f"client {self.cid!r} has no training samples")
        self.drift.offer((x, y, x_test, y_test))
        self.link.wake()  # the change is taken before the next command

    def start(self) -> None:
        """Connect, subscribe, register (and register again after every reconnection)."""
        self.link.start()
        log.info("connected as %s; hello in %.1f s (%d samples)", self.cid,
                 max(0.0, (self.hello_due or time.monotonic()) - time.monotonic()), len(self.worker.y))

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
        due = self.link.hello_due
        wait = timeout if due is None else min(timeout, max(0.0, due - time.monotonic()))
        try:
            msg = self.link.commands.get(timeout=wait) if wait > 0 else self.link.commands.get_nowait()
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
            self.link.close()
        finally:
            self.state.encoders.remove_folders()

    def stop(self) -> None:
        """Stop serving: :meth:`step` returns False from now on."""
        self._stop.set()

