"""What an edge client does for each command of the server: the dispatch table and the handlers.

:class:`ClientCommands` is a mixin of :class:`edge_sdk.client.EdgeClient`.
:meth:`~ClientCommands.handle` reads a command with
:func:`edge_sdk.protocol.commands.parse` (the command vocabulary) and runs the
method its op names in :data:`ENDINGS` or :data:`HANDLERS`. A subclass may
override one handler (a test's hostile device overrides ``_do_train``).

The application's own command, :meth:`~ClientCommands.data_changed` (the
device's data changed), is queued like the server's and done on the same
loop, between two commands; :class:`DeviceDrift` holds what it needs (the
device's sketch key, its last sketch sent).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .bits import fresh_seed
from .compress import Compression
from .compress.update_codec import update_codec
from .drift import DriftWatch
from .install import install_hint
from .protocol import SERVER_ID, Kind, Message, ProtocolError, sketch_body, tensors_body
from .protocol.commands import Op, parse
from .sampling import in_sample
from .schema import check_meta
from .sketch import Sketch, Sketcher
from .tasks import Task, TrainSettings

__all__ = ["ENDINGS", "HANDLERS", "LOCAL", "SERVER_STATUS", "VIA", "ClientCommands", "DeviceDrift"]

# the device's log keeps its one name: these lines were the client's and still are
log = logging.getLogger("edge_sdk.client")

#: Meta key the device's own command callback adds: the topic a command came by ("cmd" or "broadcast").
VIA = "_via"
#: The ``VIA`` of the application's own command (:meth:`ClientCommands.data_changed`), never of a message.
LOCAL = "local"
#: The ``VIA`` of the server's own status (its run announcement on ``server/status``).
SERVER_STATUS = "server-status"

#: What a device outside ``--stay`` exits with when the server says it could not finish the run.
SERVER_FAILED = 5
#: What ``--get-model`` exits with when the device ends with no kept model.
NO_MODEL = 6

#: The commands after which the client may stop: op -> its method, called with the command's clean
#: fields, which returns whether to keep serving.
ENDINGS: dict[str, str] = {Op.STOP: "_on_stop", Op.REFUSED: "_on_refused", Op.LEAVE: "_on_leave"}
#: Every other command: op -> its method, called with the command's clean fields and round.
HANDLERS: dict[str, str] = {
    Op.HELLO: "_on_hello",
    Op.WELCOME: "_on_welcome",
    Op.ASSIGN: "_on_assign",
    Op.SKETCH: "_do_sketch",
    Op.TRAIN: "_do_train",
    Op.TRAIN_AE: "_do_train_ae",
    Op.EVALUATE: "_do_evaluate",
    Op.KEEP: "_do_keep",
}


class DeviceDrift:
    """What a device keeps to tell the server that its data changed (see :meth:`ClientCommands.data_changed`).

    Parameters
    ----------
    seed : int, optional
        The device's sketch key: the seed of every :class:`~edge_sdk.sketch.Sketcher`
        it makes (None: one drawn from the operating system once, here). Kept for the
        device's life, so that sketching unchanged data again gives the same bits.

    Attributes
    ----------
    watch : DriftWatch or None
        The device's sketcher and the last sketch it sent, asked or unasked (None before the first).
    unasked : int
        Sketches sent unasked.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = fresh_seed() if seed is None else seed
        self.watch: DriftWatch | None = None
        self.unasked = 0
        self._lock = threading.Lock()
        self._new: tuple[Any, ...] | None = None

    def sketcher(self, encoder: Any, num_classes: int, flip_prob: float) -> Sketcher:
        """The device's sketcher for these settings (the same one while they stay; always its own key)."""
        w = self.watch
        if (w is None or w.sketcher.encoder is not encoder or w.sketcher.num_classes != num_classes
                or w.sketcher.flip_prob != flip_prob):
            self.watch = DriftWatch(Sketcher(encoder, num_classes, flip_prob, seed=self.seed))
        return self.watch.sketcher

    def sent(self, sketch: Sketch) -> None:
        """Remember the sketch just sent."""
        if self.watch is not None:
            self.watch.sent(sketch)

    def offer(self, data: tuple[Any, ...]) -> None:
        """New local data (any thread); the latest offered wins."""
        with self._lock:
            self._new = data

    def take(self) -> tuple[Any, ...] | None:
        """The new local data offered since the last call, or None (the client's loop)."""
        with self._lock:
            data, self._new = self._new, None
        return data


class ClientCommands:
    """The command handlers of :class:`edge_sdk.client.EdgeClient` (a mixin).

    They use what the client holds: ``cid``, ``worker``, ``topics``,
    ``transport``, ``seed``, ``stay``, ``model_key``, ``followed``, the
    models held (``store``, ``_wait_model``, ``_on_model``, ``encoder_dirs``,
    ``_encoders``, ``_models_cv``, ``model_timeout_s``), the error feedback of
    compressed updates (``feedback``, ``state_dir``), ``_send``,
    ``hello``, the command queue (``_cmds``, ``federation``), ``drift``
    (a :class:`DeviceDrift`), and the bookkeeping (``handled``,
    ``_rejections``, ``exit_code``, ``refused_reason``, ``progress_interval_s``).
    """

    def handle(self, msg: Message) -> bool:
        """Execute one command; returns False when told to stop.

        A broadcast that does not concern this device (an evaluation of
        devices it is not among, a sketch request before it was admitted) is
        ignored, logged at DEBUG.
        """
        self._apply_data_change()  # the application's change comes before the next command
        if msg.meta.get(VIA) == LOCAL:
            return True  # data_changed's wake-up: done above
        if msg.meta.get(VIA) == SERVER_STATUS:
            self._on_server_status(msg)
            return True
        broadcast = msg.meta.get(VIA) == "broadcast"
        try:
            m = parse(msg)  # every field checked: types, ranges, lengths; unknown ops refused
        except ProtocolError as e:
            self._rejections(e.reason, msg.sender, f"command {str(msg.meta.get('op'))[:32]!r}: {e}")
            return True
        op = m["op"]
        self.handled[op] = self.handled.get(op, 0) + 1
        ending = ENDINGS.get(op)
        if ending is not None:
            return getattr(self, ending)(m)
        try:
            if op == Op.SKETCH and broadcast and not self._welcomed:
                log.debug("sketch request for admitted devices: not admitted yet, ignored")
            elif op in HANDLERS:
                getattr(self, HANDLERS[op])(m, msg.round)
        except ImportError as e:  # e.g. a train command on a device without torch
            log.error("command %s needs a missing package (%s); for local training: %s", op, e,
                      install_hint("train"))
        except (ValueError, KeyError, TypeError, TimeoutError, RuntimeError) as e:
            log.error("command %s failed: %s", op, e)
        except Exception as e:  # whatever a command triggers, the device keeps serving
            log.debug("command %s raised", op, exc_info=True)
            self._rejections("handler-error", msg.sender, f"command {op}: {type(e).__name__}: {e}")
        return True

    # -- the commands that may end the service -------------------------------
    def _on_stop(self, m: Mapping[str, Any]) -> bool:
        run = m.get("run")
        if (not m["failed"] and run is not None and run != self.run_id
                and (self.run_id is not None or not self._welcomed)):
            # the end of a run this device is not in (it arrived as that run ended): not its stop. A failed
            # run's stop is heeded whatever it names: the device may have said hello to it, unanswered
            log.info("the server's run %s has ended; this device was not in it: waiting for its own", run)
            return True
        if m["failed"]:
            log.error("the server could not finish the run: %s%s", m["reason"],
                      "; staying for the next run" if self.stay else "")
            if not self.stay:
                self.exit_code = SERVER_FAILED
            return self.stay
        if self.stay:
            log.info("the server has finished (%s); staying for the next run", m["reason"])
            return True
        log.info("the server has finished (%s)", m["reason"])
        return False

    def _on_refused(self, m: Mapping[str, Any]) -> bool:
        self.refused_reason = m["reason"]
        if self.stay:  # this run does not want the device; the next one may
            log.error("the server refused this device for this run: %s; staying for the next run", m["reason"])
            return True
        self.exit_code = 4
        log.error("the server refused this device: %s", m["reason"])
        return False

    def _on_leave(self, m: Mapping[str, Any]) -> bool:
        log.warning("the server asked this device to leave the fleet: %s", m["reason"])
        return False

    # -- the server's own status: its runs ----------------------------------------
    def _on_server_status(self, msg: Message) -> None:
        """The server's announcement on its status topic: a run began, or the server is away.

        A run this device has not seen yet (another run id) starts afresh: what the last run left
        (admission, assignment, models, encoders received and their folders) is dropped, and the device
        says hello (after its jitter, unless the server's own hello request comes first).
        """
        try:
            m = check_meta(msg)
        except ProtocolError as e:
            self._rejections(e.reason, msg.sender, f"server status: {e}")
            return
        run = m.get("run")
        if m["state"] == "offline":
            log.info("the server is away%s; waiting for its next run", f" (run {run})" if run else "")
            self.server_online = False
            return
        self.server_online = True
        if run is None or run == self.run_id:
            return
        self.run_id = run
        self.runs_seen += 1
        self._forget_run()
        log.info("the server announces run %s: joining it", run)
        self.schedule_hello()

    # -- the others -------------------------------------------------------------
    def _on_hello(self, m: Mapping[str, Any], rnd: int) -> None:
        """Asked by a (new) server: every model until it assigns this device again."""
        self._follow(["+"], confirm=False)
        self.hello()

    def _on_welcome(self, m: Mapping[str, Any], rnd: int) -> None:
        self._welcomed = True
        if m.get("run"):  # its announcement, if it comes later (another topic), is of a run joined already
            self.run_id = m["run"]
        self._use_architecture(m)
        if m.get("num_classes"):
            self.worker.num_classes = m["num_classes"]
        log.info("admitted: architecture %s, encoder %s, %s classes%s", self.worker.architecture,
                 m.get("encoder"), self.worker.num_classes,
                 "" if m["train"] else f"; not training ({m.get('reason', 'the server says so')})")

    def _on_assign(self, m: Mapping[str, Any], rnd: int) -> None:
        if self.model_key is not None and m["model_key"] != self.model_key and self.feedback.keys:
            log.info("moved from model %s to %s: the unsent part of its updates is dropped", self.model_key,
                     m["model_key"])
            self.feedback.reset()
            self.save_feedback()
        self.model_key = m["model_key"]
        log.info("assigned to model %s", self.model_key)
        if "follow" in m:
            self._follow(m["follow"])

    def _encoder(self, name: str, wait: bool = False):
        if wait and name not in self.encoder_dirs:
            from .artifacts import load_manifest

            try:
                shipped = name in load_manifest()
            except (OSError, ValueError):
                shipped = False
            if not shipped:  # a federated encoder: it may still be on its way
                deadline = time.monotonic() + self.model_timeout_s
                with self._models_cv:
                    while name not in self.encoder_dirs and time.monotonic() < deadline:
                        self._models_cv.wait(timeout=0.5)
        if name not in self._encoders:
            from .encoder import OnnxEncoder

            self._encoders[name] = OnnxEncoder(name, models_dir=self.encoder_dirs.get(name))
        return self._encoders[name]

    def _do_sketch(self, m: Mapping[str, Any], rnd: int) -> None:
        kind = m["summary"]
        if kind != "sketch":
            from .features import SUMMARIES

            if kind not in SUMMARIES:
                raise ValueError(f"unknown summary kind {kind!r}; this client knows {sorted(SUMMARIES)}")
            feats = SUMMARIES[kind](self.worker.x, self.worker.y, num_classes=m["num_classes"], **m["params"])
            self._send(self.topics.sketch(self.cid), Kind.FEATURES, rnd, {"summary": kind},
                       tensors_body({"features": np.ascontiguousarray(feats, dtype=np.float32)}))
            log.info("sent %s summary %s", kind, feats.shape)
            return
        sketcher = self.drift.sketcher(self._encoder(m["encoder"], wait=True), m["num_classes"], m["flip_prob"])
        sk = self.worker.sketch(sketcher)
        self._send(self.topics.sketch(self.cid), Kind.SKETCH, rnd, body=sketch_body(sk))
        self.drift.sent(sk)
        log.info("sent sketch (%d bits, %d bytes)", sk.n_bits, sk.nbytes)

    # -- the application's command: the local data changed ----------------------
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
        most the one it registered.

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
        try:  # wake the loop; a full queue is fine: the change is taken before the next command
            self._cmds.put_nowait(Message(Kind.CMD, self.federation, self.cid, 0, {VIA: LOCAL}))
        except queue.Full:
            pass

    def _apply_data_change(self) -> None:
        """Take the data :meth:`data_changed` offered, if any; send its sketch unasked if it changed enough."""
        data = self.drift.take()
        if data is None:
            return
        try:
            self.worker.replace_data(*data)
            watch = self.drift.watch
            if watch is None or watch.last is None:
                log.info("local data changed (%d samples); no sketch sent yet: nothing to tell", len(self.worker.y))
                return
            new = watch.check(self.worker.x, self.worker.y)
            if new is None:
                log.info("local data changed (%d samples), within the flip noise of the last sketch sent "
                         "(%.1f bits): not told", len(self.worker.y), watch.threshold_bits)
                return
            bits = watch.last.hamming(new)
            self._send(self.topics.sketch(self.cid), Kind.SKETCH, meta={"unasked": True}, body=sketch_body(new))
        except (ValueError, TypeError, ConnectionError) as e:  # the device keeps serving
            log.error("local data change: %s", e)
            return
        self.drift.sent(new)
        self.drift.unasked += 1
        log.info("local data changed: sketch sent unasked (%d bits from the last one sent, noise threshold %.1f)",
                 bits, watch.threshold_bits)

    def _use_architecture(self, m: Mapping[str, Any]) -> None:
        arch = m.get("architecture")
        if arch and arch != self.worker.architecture:
            log.info("architecture %s (from the server)", arch)
            self.worker.architecture = arch

    def _report_progress(self, r: int, done: threading.Event) -> None:
        """Say "training round r" now and every ``progress_interval_s`` until ``done``."""
        while True:
            try:
                self._send(self.topics.status(self.cid), Kind.STATUS, r, {"state": "online", "working": r})
            except (ConnectionError, ValueError) as e:  # offline for a while: the next one will do
                log.debug("progress report for round %d not sent: %s", r, e)
            if done.wait(self.progress_interval_s):
                return

    def _do_train(self, m: Mapping[str, Any], rnd: int) -> None:
        r = m["round"]
        keys = m["models"]
        self._use_architecture(m)
        done = threading.Event()
        beat = threading.Thread(target=self._report_progress, args=(r, done), daemon=True,
                                name=f"{self.cid}-progress")
        beat.start()
        try:
            held = {k: self._wait_model(k, r) for k in keys}
            task = Task(self.cid, r, {k: h.weights for k, h in held.items()}, TrainSettings.from_dict(m),
                        m["evaluate_first"])
            upd = self.worker.fit(task)
        finally:
            done.set()
        meta = {"round": r, "model_key": upd.model_key, "n_samples": upd.n_samples, "loss": upd.loss,
                "metrics": dict(upd.metrics)}
        codec = update_codec(Compression.from_meta(m["compress"]) if "compress" in m else None)
        # the model it started from (a worker that names a model it was not sent is refused by the server)
        start = held.get(upd.model_key) or held[keys[0]]
        try:
            body, extra, _ = codec.encode(upd.model_key, upd.weights, start.weights, start.version, self)
        except ValueError as e:
            raise ValueError(f"round {r}: {e}") from None
        self._send(self.topics.update(self.cid), Kind.UPDATE, r, {**meta, **extra}, body)
        log.info("round %d: trained %s on %d samples, loss %.4f; update sent (%d bytes, %s)", r, upd.model_key,
                 upd.n_samples, upd.loss, len(body), codec.compression)

    def load_feedback(self, comp: Compression) -> None:
        """Once, at the first compressed update: the error feedback the state folder kept, if of this method."""
        if self._feedback_read or self.state_dir is None:
            return
        self._feedback_read = True
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

    def _do_train_ae(self, m: Mapping[str, Any], rnd: int) -> None:
        from .trainer import train_autoencoder_local

        r = m["round"]
        weights = self._wait_model("ae", r).weights
        seed = None if self.seed is None else int(self.seed) * 1000 + r
        res = train_autoencoder_local(m["architecture"], weights, self.worker.x, epochs=m["epochs"],
                                      lr=m["lr"], batch_size=m["batch_size"], seed=seed)
        meta = {"round": r, "model_key": "ae", "n_samples": int(res.n_samples), "loss": float(res.loss)}
        self._send(self.topics.update(self.cid), Kind.UPDATE, r, meta, tensors_body(res.weights))
        log.info("AE round %d: trained, MSE %.5f", r, res.loss)

    def _do_evaluate(self, m: Mapping[str, Any], rnd: int) -> None:
        r, key = m["round"], m.get("model_key")
        if key is None:  # for every device (a broadcast): its assigned model, if it is in the sample
            if self.model_key is None:
                log.debug("evaluate (round %d) for assigned devices: none assigned here, ignored", r)
                return
            if "fraction" in m and not in_sample(self.cid, m["fraction"], m.get("seed", 0)):
                log.debug("evaluate (round %d): not in the sample of %g, ignored", r, m["fraction"])
                return
            key = self.model_key
        self._use_architecture(m)
        res = self.worker.evaluate(self._wait_model(key, r).weights)
        log.info("evaluated %s: accuracy %.4f on %d samples", key, res["accuracy"], res["n_test"])
        self._send(self.topics.metrics(self.cid), Kind.METRICS, r, {"round": r, "model_key": key, **res})

    def _do_keep(self, m: Mapping[str, Any], rnd: int) -> None:
        """Keep the run's model in the device's model folder (:mod:`edge_sdk.client_keep`)."""
        from .client_keep import keep_from_command

        self._use_architecture(m)
        try:
            out = keep_from_command(m, assigned=self.model_key, run_id=self.run_id, wait_model=self._wait_model,
                                    worker=self.worker, keeper=self.keeper)
        except ProtocolError as e:
            self._rejections(e.reason, SERVER_ID, f"keep: {e}")
            return
        if out.refused is not None:
            self._rejections("model-sha", SERVER_ID, out.refused)
        if out.key is not None:
            self.kept = out
        if self.get_model and out.key is not None:  # --get-model: done, with a kept model or not
            self.exit_code = 0 if out.has_model else NO_MODEL
            self.stop()

    def _follow(self, keys: Sequence[str], *, confirm: bool = True) -> None:
        """Keep the model topics of ``keys`` ("+": every model), leave the others; say so on the status topic.

        The status (``confirm``) goes out after the (un)subscriptions on the
        same connection, so the broker has them when the server reads it: from
        then on the server counts on this device getting exactly these topics.
        The server's "hello" request (a new run) puts it back on every model,
        unconfirmed: the new server assumes it of a device it has not assigned.
        """
        want = frozenset({self.topics.model("+")} if "+" in keys else {self.topics.model(k) for k in keys})
        for f in sorted(want - self.followed):
            self.transport.subscribe(f, self._on_model)
        for f in sorted(self.followed - want):
            self.transport.unsubscribe(f)
        self.followed = want
        follow = ["+"] if "+" in keys else sorted(set(keys))
        if not confirm:
            return
        self._send(self.topics.status(self.cid), Kind.STATUS, meta={"state": "online", "follow": follow})
        log.info("following the model topics of %s", ", ".join(follow) or "no model")
