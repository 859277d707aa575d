"""What a device does for each command of the server: one handler per :class:`~edge_sdk.protocol.commands.Op`.

Each handler is a function of the device's state (:class:`~edge_sdk.client.state.DeviceState`),
the command (:class:`Command`: its fields read by
:func:`edge_sdk.protocol.commands.parse`, the command vocabulary) and the
device's context (:class:`DeviceContext`: its worker, its connection, its
settings); :func:`handles` registers it in :data:`HANDLERS`, and
:func:`handle` runs the one its op names. A handler returns False when the
device should stop serving (``stop``, ``refused``, ``leave``), None otherwise.

Two things are done on the same loop, between two commands, without being
commands: the server's status (:func:`on_server_status`: a new run starts
afresh) and the application's new local data (:func:`apply_data_change`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..compress import Compression
from ..compress.update_codec import update_codec
from ..install import install_hint
from ..logs import log_context
from ..privacy import SketchBudget
from ..protocol import SERVER_ID, Kind, Message, ProtocolError, tensors_body
from ..protocol.commands import Op, parse
from ..rejections import RejectionLog
from ..schema import check_meta
from ..tasks import Task, TrainSettings
from ..training.sampling import in_sample
from .drift import DeviceDrift
from .link import LOCAL, SERVER_STATUS, VIA, DeviceLink
from .state import DeviceState, SentUpdate, kept_label

if TYPE_CHECKING:
    from ..models.keeping import ModelKeeper
    from ..worker import LocalWorker

__all__ = ["HANDLERS", "NO_MODEL", "REFUSED", "SERVER_FAILED", "Command", "DeviceContext", "Handler",
           "handle", "handles", "on_server_status", "send_status"]

# the device's log keeps its one name: these lines were the client's and still are
log = logging.getLogger("edge_sdk.client")

#: What a device outside ``--stay`` exits with when the server refuses it.
REFUSED = 4
#: What a device outside ``--stay`` exits with when the server says it could not finish the run.
SERVER_FAILED = 5
#: What ``--get-model`` exits with when the device ends with no kept model.
NO_MODEL = 6


@dataclass(frozen=True)
class Command:
    """One command of the server, as its handler gets it."""

    #: Its clean fields (:func:`~edge_sdk.protocol.commands.parse`): ``op`` and its declared fields.
    fields: Mapping[str, Any]
    #: The round of its envelope.
    round: int = 0
    #: Whether it came by the broadcast topic (then it may not concern this device).
    broadcast: bool = False
    #: Its envelope's body (an unmask command's request); empty for most.
    body: bytes = b""


@dataclass(eq=False)
class DeviceContext:
    """What a handler works with besides the device's state: its worker, its connection, its settings."""

    #: The device's data and local operations.
    worker: LocalWorker
    #: The connection: it sends, and follows model topics.
    link: DeviceLink
    #: The device's sketch key and its last sketch sent.
    drift: DeviceDrift
    #: Where refused commands and models are counted.
    reject: RejectionLog
    #: Say hello now (:meth:`edge_sdk.client.EdgeClient.hello`).
    hello: Callable[[], None]
    #: Stop serving once this command is done.
    stop: Callable[[], None]
    #: The device's model folder (None: the run's model is not kept).
    keeper: Optional[ModelKeeper] = None
    #: The seed the device was given (None: drawn), which also seeds its autoencoder training.
    seed: Optional[int] = None
    #: How long a command waits for the model it names.
    model_timeout_s: float = 60.0
    #: While training, how often a status says which round it trains.
    progress_interval_s: float = 10.0
    #: Keep serving when the server finishes or refuses this device (the next run may want it).
    stay: bool = False
    #: Leave once a ``keep`` command was done (a cold start).
    get_model: bool = False
    #: The owner's budget for the sketches (``--max-sketch-epsilon``); None: no limit.
    sketch_budget: Optional[SketchBudget] = None


#: A command's handler: ``handler(state, command, context)``; False stops the device.
Handler = Callable[[DeviceState, Command, DeviceContext], Optional[bool]]

#: The handler of every command, by op (:func:`handles` fills it).
HANDLERS: dict[Op, Handler] = {}


def handles(op: Op) -> Callable[[Handler], Handler]:
    """Register the decorated function as the handler of ``op`` in :data:`HANDLERS`."""
    def register(handler: Handler) -> Handler:
        HANDLERS[op] = handler
        return handler

    return register


def handle(state: DeviceState, msg: Message, ctx: DeviceContext,
           handlers: Mapping[Op, Handler] = HANDLERS) -> bool:
    """Do one message of the client's loop; returns False when the device should stop serving.

    The application's new data comes first (:func:`apply_data_change`). A
    command is read with :func:`parse`, counted in ``state.handled`` and
    given to its handler; a command that fails is logged, and the device
    keeps serving. A broadcast that does not concern this device (an
    evaluation of devices it is not among, a sketch request before it was
    admitted) is ignored, logged at DEBUG.
    """
    sketching.apply_data_change(ctx)  # the application's change comes before the next command
    if msg.meta.get(VIA) == LOCAL:
        return True  # data_changed's wake-up: done above
    if msg.meta.get(VIA) == SERVER_STATUS:
        on_server_status(state, msg, ctx)
        return True
    try:
        m = parse(msg)  # every field checked: types, ranges, lengths; unknown ops refused
    except ProtocolError as e:
        ctx.reject(e.reason, msg.sender, f"command {str(msg.meta.get('op'))[:32]!r}: {e}")
        return True
    op = m["op"]
    state.handled[op] = state.handled.get(op, 0) + 1
    try:
        return handlers[op](state, Command(m, msg.round, msg.meta.get(VIA) == "broadcast", msg.body), ctx) is not False
    except ImportError as e:  # e.g. a train command on a device without torch
        log.error("command %s needs a missing package (%s); for local training: %s", op, e,
                  install_hint("train"))
    except (ValueError, KeyError, TypeError, TimeoutError, RuntimeError) as e:
        log.error("command %s failed: %s", op, e)
    except Exception as e:  # whatever a command triggers, the device keeps serving
        log.debug("command %s raised", op, exc_info=True)
        ctx.reject("handler-error", msg.sender, f"command {op}: {type(e).__name__}: {e}")
    return True


# -- the commands that may end the service -------------------------------------------
@handles(Op.STOP)
def stop(state: DeviceState, cmd: Command, ctx: DeviceContext) -> bool:
    """The server has finished (or failed): stop serving, unless the device stays or the run is not its own."""
    m = cmd.fields
    run = m.get("run")
    if (not m["failed"] and run is not None and run != state.run_id
            and (state.run_id is not None or not state.welcomed)):
        # the end of a run this device is not in (it arrived as that run ended): not its stop. A failed
        # run's stop is heeded whatever it names: the device may have said hello to it, unanswered
        log.info("the server's run %s has ended; this device was not in it: waiting for its own", run)
        return True
    if m["failed"]:
        log.error("the server could not finish the run: %s%s", m["reason"],
                  "; staying for the next run" if ctx.stay else "")
        if not ctx.stay:
            state.exit_code = SERVER_FAILED
        return ctx.stay
    if ctx.stay:
        log.info("the server has finished (%s); staying for the next run", m["reason"])
        return True
    log.info("the server has finished (%s)", m["reason"])
    return False


@handles(Op.REFUSED)
def refused(state: DeviceState, cmd: Command, ctx: DeviceContext) -> bool:
    """The server does not admit this device: stop serving, unless it stays for the next run."""
    reason = cmd.fields["reason"]
    state.refused_reason = reason
    if ctx.stay:  # this run does not want the device; the next one may
        log.error("the server refused this device for this run: %s; staying for the next run", reason)
        return True
    state.exit_code = REFUSED
    log.error("the server refused this device: %s", reason)
    return False


@handles(Op.LEAVE)
def leave(state: DeviceState, cmd: Command, ctx: DeviceContext) -> bool:
    """The owner retires the device: stop serving, in service mode too."""
    log.warning("the server asked this device to leave the fleet: %s", cmd.fields["reason"])
    return False


# -- the server's own status: its runs ------------------------------------------------
def on_server_status(state: DeviceState, msg: Message, ctx: DeviceContext) -> None:
    """The server's announcement on its status topic: a run began, or the server is away.

    A run this device has not seen yet (another run id) starts afresh: what the last run left
    (admission, assignment, models, encoders received and their folders) is dropped, the device
    follows every model again, and says hello (after its jitter, unless the server's own hello
    request comes first).
    """
    try:
        m = check_meta(msg)
    except ProtocolError as e:
        ctx.reject(e.reason, msg.sender, f"server status: {e}")
        return
    run = m.get("run")
    if m["state"] == "offline":
        log.info("the server is away%s; waiting for its next run", f" (run {run})" if run else "")
        state.server_online = False
        return
    state.server_online = True
    if run is None or run == state.run_id:
        return
    state.run_id = run
    log_context.set(run=run, round=None)  # in each log line from now on (--log-format json)
    state.runs_seen += 1
    ctx.link.follow(["+"], confirm=False)
    state.forget_run()
    log.info("the server announces run %s: joining it", run)
    ctx.link.schedule_hello()


# -- admission and assignment -----------------------------------------------------------
@handles(Op.HELLO)
def hello(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Asked by a (new) server: every model until it assigns this device again."""
    ctx.link.follow(["+"], confirm=False)
    ctx.hello()


@handles(Op.WELCOME)
def welcome(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Admitted: the run, the architecture and classes to use."""
    m = cmd.fields
    state.welcomed = True
    if m.get("run"):  # its announcement, if it comes later (another topic), is of a run joined already
        state.run_id = m["run"]
        log_context.set(run=m["run"])
    use_architecture(ctx.worker, m)
    if m.get("num_classes"):
        ctx.worker.num_classes = m["num_classes"]
    log.info("admitted: architecture %s, encoder %s, %s classes%s", ctx.worker.architecture,
             m.get("encoder"), ctx.worker.num_classes,
             "" if m["train"] else f"; not training ({m.get('reason', 'the server says so')})")


@handles(Op.ASSIGN)
def assign(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """The device's model (its cluster) and the model topics it follows."""
    m = cmd.fields
    if state.model_key is not None and m["model_key"] != state.model_key and state.feedback.keys:
        log.info("moved from model %s to %s: the unsent part of its updates is dropped", state.model_key,
                 m["model_key"])
        state.feedback.reset()
        state.save_feedback()
    state.model_key = m["model_key"]
    log.info("assigned to model %s", state.model_key)
    if "follow" in m:
        ctx.link.follow(m["follow"])


def use_architecture(worker: LocalWorker, m: Mapping[str, Any]) -> None:
    """Take the architecture a command names, if it names one."""
    arch = m.get("architecture")
    if arch and arch != worker.architecture:
        log.info("architecture %s (from the server)", arch)
        worker.architecture = arch


# -- the sketch, and the application's new data -------------------------------------------
# -- training, evaluation, keeping ---------------------------------------------------------
def send_status(ctx: DeviceContext, r: int, fields: Mapping[str, Any], state: DeviceState | None = None) -> None:
    """Send a status of round ``r`` (online, with ``fields``) and, given the device's state, its health."""
    link = ctx.link
    meta = {"state": "online", **fields}
    health = {} if state is None else state.health().to_meta()
    if health:
        meta["health"] = health
    link.send(link.topics.status(link.cid), Kind.STATUS, r, meta)


def send_update(state: DeviceState, ctx: DeviceContext, r: int, meta: Mapping[str, Any], body: bytes, *,
                partition: int | None = None, announce_above: int | None = None,
                started: float | None = None) -> None:
    """Send round ``r``'s update (on the update topics' ``partition``, if the server named one), keep it (until
    the next) for a ``resend``, and say it went out; one above ``announce_above`` bytes is only announced (the
    server asks for it when its receiver has room). ``started``: when the round's command came
    (``time.monotonic()``), for the health's ``round_s``."""
    link = ctx.link
    if started is not None:
        state.round_s = time.monotonic() - started
    sent = state.last_update = SentUpdate(r, link.topics.update(link.cid, partition), dict(meta), body)
    if announce_above is not None and len(body) > announce_above:
        send_status(ctx, r, {"ready": r, "size": len(body)}, state)
        log.info("round %d: update of %d bytes ready, sent when the server asks for it", r, len(body))
        return
    _publish(state, ctx, sent)


def _publish(state: DeviceState, ctx: DeviceContext, sent: SentUpdate) -> None:
    ctx.link.send(sent.topic, Kind.UPDATE, sent.round, sent.meta, sent.body)
    send_status(ctx, sent.round, {"sent": sent.round}, state)


@handles(Op.RESEND)
def resend(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Send the kept update of the round named: announced, or again (the receiver lost it, or had no room)."""
    r, sent = cmd.fields["round"], state.last_update
    if sent is None or sent.round != r:  # still training it (the server lost its link meanwhile), or never tasked
        log.info("the server asks for round %d's update; this device holds %s: nothing sent now", r,
                 "none" if sent is None else f"round {sent.round}'s")
        return
    _publish(state, ctx, sent)
    log.info("round %d: update sent, as the server asked (%d bytes)", r, len(sent.body))


def report_progress(ctx: DeviceContext, r: int, done: threading.Event, state: DeviceState | None = None) -> None:
    """Say "training round r" (with the device's health, given its state) now and every ``progress_interval_s``
    until ``done``."""
    while True:
        try:
            send_status(ctx, r, {"working": r}, state)
        except (ConnectionError, ValueError) as e:  # offline for a while: the next one will do
            log.debug("progress report for round %d not sent: %s", r, e)
        if done.wait(ctx.progress_interval_s):
            return


@handles(Op.TRAIN)
def train(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Train the round's models, saying it trains meanwhile, and send the update (whole or compressed)."""
    started = time.monotonic()
    m, link = cmd.fields, ctx.link
    r = m["round"]
    log_context.set(round=r)
    keys = m["models"]
    use_architecture(ctx.worker, m)
    done = threading.Event()
    beat = threading.Thread(target=report_progress, args=(ctx, r, done, state), daemon=True,
                            name=f"{link.cid}-progress")
    beat.start()
    try:
        held = {k: state.store.wait(k, r, ctx.model_timeout_s) for k in keys}
        task = Task(link.cid, r, {k: h.weights for k, h in held.items()}, TrainSettings.from_dict(m),
                    m["evaluate_first"])
        upd = ctx.worker.fit(task)
    finally:
        done.set()
    meta = {"round": r, "model_key": upd.model_key, "n_samples": upd.n_samples, "loss": upd.loss,
            "metrics": dict(upd.metrics)}
    codec = update_codec(Compression.from_meta(m["compress"]) if "compress" in m else None)
    # the model it started from (a worker that names a model it was not sent is refused by the server)
    start = held.get(upd.model_key) or held[keys[0]]
    try:
        if "secure" in m:  # masked: the server sums it with its peers' and never reads it alone
            body = secure.masked_update(state, link.cid, m["secure"], r, upd.model_key, upd.weights, start.weights)
            extra = {"secure": True, **({} if start.version is None else {"version": start.version})}
        else:
            body, extra, _ = codec.encode(upd.model_key, upd.weights, start.weights, start.version, state,
                                          lean=True)
    except ValueError as e:
        raise ValueError(f"round {r}: {e}") from None
    send_update(state, ctx, r, {**meta, **extra}, body, partition=m.get("partition"),
                announce_above=m.get("announce_above"), started=started)
    log.info("round %d: trained %s on %d samples, loss %.4f; update sent (%d bytes, %s)", r, upd.model_key,
             upd.n_samples, upd.loss, len(body), codec.compression)


@handles(Op.TRAIN_AE)
def train_ae(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Train the sketch autoencoder of the round (federated pre-training) and send its weights."""
    from ..training.trainer import train_autoencoder_local

    started = time.monotonic()
    m = cmd.fields
    r = m["round"]
    log_context.set(round=r)
    weights = state.store.wait("ae", r, ctx.model_timeout_s).weights
    seed = None if ctx.seed is None else int(ctx.seed) * 1000 + r
    res = train_autoencoder_local(m["architecture"], weights, ctx.worker.x, epochs=m["epochs"],
                                  lr=m["lr"], batch_size=m["batch_size"], seed=seed)
    meta = {"round": r, "model_key": "ae", "n_samples": int(res.n_samples), "loss": float(res.loss)}
    send_update(state, ctx, r, meta, tensors_body(res.weights), started=started)
    log.info("AE round %d: trained, MSE %.5f", r, res.loss)


@handles(Op.EVALUATE)
def evaluate(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Evaluate the model named (or the assigned one, if in the sample) and send the metrics."""
    m, link = cmd.fields, ctx.link
    r, key = m["round"], m.get("model_key")
    if key is None:  # for every device (a broadcast): its assigned model, if it is in the sample
        if state.model_key is None:
            log.debug("evaluate (round %d) for assigned devices: none assigned here, ignored", r)
            return
        if "fraction" in m and not in_sample(link.cid, m["fraction"], m.get("seed", 0)):
            log.debug("evaluate (round %d): not in the sample of %g, ignored", r, m["fraction"])
            return
        key = state.model_key
    use_architecture(ctx.worker, m)
    res = ctx.worker.evaluate(state.store.wait(key, r, ctx.model_timeout_s).weights)
    log.info("evaluated %s: accuracy %.4f on %d samples", key, res["accuracy"], res["n_test"])
    link.send(link.topics.metrics(link.cid), Kind.METRICS, r, {"round": r, "model_key": key, **res})


@handles(Op.KEEP)
def keep(state: DeviceState, cmd: Command, ctx: DeviceContext) -> None:
    """Keep the run's model in the device's model folder (:mod:`edge_sdk.client.keep`)."""
    from .keep import keep_from_command

    m = cmd.fields
    use_architecture(ctx.worker, m)
    try:
        out = keep_from_command(m, assigned=state.model_key, run_id=state.run_id,
                                wait_model=lambda k, r: state.store.wait(k, r, ctx.model_timeout_s),
                                worker=ctx.worker, keeper=ctx.keeper)
    except ProtocolError as e:
        ctx.reject(e.reason, SERVER_ID, f"keep: {e}")
        return
    if out.refused is not None:
        ctx.reject("model-sha", SERVER_ID, out.refused)
    if out.key is not None:
        state.kept = out
    if out.decision is not None:  # the kept model, as the device's health says it from now on
        state.kept_model = kept_label(ctx.keeper)
    if ctx.get_model and out.key is not None:  # --get-model: done, with a kept model or not
        state.exit_code = 0 if out.has_model else NO_MODEL
        ctx.stop()


# the handlers of the other modules register themselves in HANDLERS
from . import secure, sketching  # noqa: E402
