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
and what each command does is in :mod:`edge_sdk.client_commands`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .client_commands import SERVER_STATUS, VIA, ClientCommands, DeviceDrift
from .protocol import SERVER_ID, Kind, Message, ProtocolError, Topics, parse_tensors
from .rejections import RejectionLog
from .schema import check_meta
from .transport import BrokerConfig
from .worker import LocalWorker

__all__ = ["EdgeClient", "main"]

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
        if int(max_models) < 1:
            raise ValueError(f"max_models must be a positive integer, got {max_models!r}")
        self.max_models = int(max_models)
        self.model_key: str | None = None
        #: The model topic filters this device subscribes to (every model until an assign narrows it).
        self.followed: frozenset[str] = frozenset({self.topics.model("+")})
        self._welcomed = False
        self._models: dict[str, tuple[int, dict[str, np.ndarray]]] = {}
        self._models_cv = threading.Condition()
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
        #: The run the server last announced (its retained status), None before the first announcement.
        self.run_id: str | None = None
        #: Runs announced while this device served (the first one included).
        self.runs_seen = 0
        #: Whether the server's last status said it is online (None: no status seen yet).
        self.server_online: bool | None = None
        #: Why the server refused this device (None while admitted or not yet answered).
        self.refused_reason: str | None = None
        self._connections = 0
        self._rejections = RejectionLog(log)
        #: Refused commands and models per reason (logged once per reason per interval).
        self.rejected: dict[str, int] = self._rejections.counts

    # -- transport callbacks (network thread: enqueue only) ---------------
    def _on_cmd(self, topic: str, msg: Message) -> None:
        if msg.kind == Kind.MODEL and msg.sender == SERVER_ID and topic == self.topics.cmd(self.cid):
            self._on_model(topic, msg)  # a model for this client alone, ahead of the command that uses it
            return
        if msg.kind != Kind.CMD or msg.sender != SERVER_ID:
            self._rejections("sender", msg.sender, f"ignoring {msg.kind.name} on {topic}")
            return
        # which topic it came by (a broadcast may not concern this device); set here, never by the sender
        msg = dataclasses.replace(msg, meta={**msg.meta, VIA: "broadcast" if topic == self.topics.broadcast()
                                             else "cmd"})
        try:
            self._cmds.put_nowait(msg)
        except queue.Full:
            self._rejections("queue-full", msg.sender, f"command queue full; dropping {msg.meta.get('op')!r}")

    def _on_model(self, topic: str, msg: Message) -> None:
        if msg.kind != Kind.MODEL or msg.sender != SERVER_ID:
            return
        try:
            meta = check_meta(msg)
            key = meta["key"]
            if key == "encoder":  # raw ONNX bytes, not tensors
                self._on_encoder(msg)
                return
            weights = parse_tensors(msg.body)
        except ProtocolError as e:
            self._rejections(e.reason, msg.sender, f"model for round {msg.round}: {e}")
            return
        except Exception as e:  # never let a message end the device
            self._rejections("handler-error", msg.sender, f"model: {type(e).__name__}: {e}")
            return
        with self._models_cv:
            self._models.pop(key, None)
            self._models[key] = (msg.round, weights)
            while len(self._models) > self.max_models:  # forget the oldest round first
                oldest = min(self._models, key=lambda k: self._models[k][0])
                del self._models[oldest]
            self._models_cv.notify_all()

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

    def _wait_model(self, key: str, rnd: int) -> dict[str, np.ndarray]:
        deadline = time.monotonic() + self.model_timeout_s
        with self._models_cv:
            while True:
                got = self._models.get(key)
                if got is not None and got[0] >= rnd:
                    return got[1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"model {key!r} for round {rnd} did not arrive within {self.model_timeout_s:g} s")
                self._models_cv.wait(timeout=min(left, 0.5))

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
        self._send(self.topics.hello(self.cid), Kind.HELLO, meta={**self.worker.hello(), **self.bench})

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
        msg = dataclasses.replace(msg, meta={**msg.meta, VIA: SERVER_STATUS})
        try:
            self._cmds.put_nowait(msg)
        except queue.Full:
            self._rejections("queue-full", msg.sender, "command queue full; dropping the server's status")

    def _forget_run(self) -> None:
        """A new run: drop what the last one left (admission, model, models and encoders received)."""
        self._welcomed = False
        self.model_key = None
        self.refused_reason = None
        self._follow(["+"], confirm=False)
        with self._models_cv:
            self._models.clear()
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fedsketch-client", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="A FedSketch edge client over MQTT. It learns the model, encoder, classes and training "
                    "settings from the server; exits 0 when the server finishes (with --serve: on SIGTERM or the "
                    "server's leave), 4 when it refuses this device, 5 when the server could not finish the run (the reason is logged), 3 when the broker cannot "
                    "be reached, 2 for bad arguments or data.")
    p.add_argument("--broker", default="mqtt://127.0.0.1:1883", help="mqtt://host:port or mqtts://host:port")
    p.add_argument("--federation", default="default", help="the federation's id (the server's --federation)")
    p.add_argument("--root", default="fedsketch", help="topic root")
    p.add_argument("--client-id", required=True, help="this device's id (its broker user name)")
    p.add_argument("--data", required=True, help=".npz with x, y (and x_test, y_test); read without pickle")
    p.add_argument("--architecture", default=None,
                   help="classifier architecture; default: the one the server says (recommended)")
    p.add_argument("--num-classes", type=int, default=None, help="default: the number the server says")
    p.add_argument("--seed", type=int, default=None, help="sketch and training seed (default: OS)")
    BrokerConfig.add_arguments(p)
    p.add_argument("--threads", type=int, default=1, help="torch threads for local training")
    p.add_argument("--bench", default=None, metavar="FILE",
                   help="send the figures of this device's own benchmark (fedsketch bench --json FILE) with its "
                        "hello: the server's report lists each device's speed")
    p.add_argument("--max-idle", type=float, default=None, help="leave after this many idle seconds")
    p.add_argument("--hello-jitter", type=float, default=3.0, metavar="S",
                   help="say hello after a random wait of up to S seconds after every (re)connection, so that a "
                        "fleet booting at once (or back after a broker restart) does not reach the broker in one "
                        "instant; 0: at once")
    p.add_argument("--serve", "--stay", dest="stay", action="store_true",
                   help="service mode (the systemd unit's): serve run after run. The device joins each run the "
                        "server announces, stays through its stop, a failed run or a refusal, waits while the "
                        "server is away, and leaves only on SIGTERM or a leave the server sends")
    p.add_argument("--server-key", default=None, metavar="PEM",
                   help="the server's Ed25519 public key (given at enrolment): obey only messages it signed")
    p.add_argument("--fedcref", action="store_true",
                   help="take part in a FedCRef federation (fedsketch-server --strategy fedcref): unlabelled data, "
                        "only x is read from --data")
    p.add_argument("--set", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="with --fedcref: a FedCRefClient parameter, the value in TOML syntax (repeatable), "
                        "for example --set n_clusters=3 --set epochs=10")
    p.add_argument("--labels-out", default=None,
                   help="with --fedcref: write the final local cluster of each sample here (.npz, 'labels')")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: debug logs")
    p.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    return p


@contextlib.contextmanager
def private_tmp(cid: str) -> Iterator[Path]:
    """A temporary-files folder of this device process's own, removed when it ends.

    What the libraries write there (ONNX Runtime's session file, torch's
    kernel cache) and the encoders received go with the process, instead of
    piling up in ``/tmp`` over months of runs and restarts.
    """
    folder = Path(tempfile.mkdtemp(prefix=f"fedsketch-{re.sub(r'[^A-Za-z0-9_.-]', '_', cid)[:64]}-"))
    before = (os.environ.get("TMPDIR"), tempfile.tempdir)
    os.environ["TMPDIR"] = tempfile.tempdir = str(folder)
    try:
        yield folder
    finally:
        if before[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[0]
        tempfile.tempdir = before[1]
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with private_tmp(args.client_id):
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    level = logging.WARNING if args.quiet else logging.INFO - 10 * min(args.verbose, 1)
    logging.basicConfig(level=level, format=f"%(asctime)s {args.client_id} %(levelname)s %(name)s: %(message)s")
    # paho's own lines ("Client is not connected" while it reconnects) repeat what the transport says
    logging.getLogger("edge_sdk.transport.paho").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    if args.fedcref:
        return _run_fedcref(args)
    if args.params or args.labels_out:
        print("fedsketch-client: error: --set and --labels-out go with --fedcref", file=sys.stderr)
        return 2
    try:
        with np.load(args.data, allow_pickle=False) as f:
            x, y = f["x"], f["y"]
            x_test = f["x_test"] if "x_test" in f.files else None
            y_test = f["y_test"] if "y_test" in f.files else None
        bench = _bench_fields(args)
        cfg = _broker_config(args)
        worker = LocalWorker(args.client_id, x, y, x_test, y_test, architecture=args.architecture,
                             num_classes=args.num_classes or 10, seed=args.seed)
        transport = _transport(args, cfg)
    except (OSError, KeyError, ValueError) as e:
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        pass
    else:
        from .cpu import torch_threads

        threads = torch_threads(args.threads or None)  # 1 on a CPU without LSE atomics (Pi 4)
        if threads:
            torch.set_num_threads(threads)
    if not args.hello_jitter >= 0:
        print(f"fedsketch-client: error: --hello-jitter must be >= 0 seconds, got {args.hello_jitter:g}",
              file=sys.stderr)
        return 2
    client = EdgeClient(transport, worker, federation=args.federation, root=args.root, seed=args.seed,
                        stay=args.stay, hello_jitter_s=args.hello_jitter, bench=bench)
    _stop_on_sigterm(client.stop)
    rc = _serve(args, lambda: client.run(max_idle_s=args.max_idle))
    return client.exit_code if rc == 0 else rc


def _bench_fields(args: argparse.Namespace) -> dict[str, Any]:
    """``--bench FILE``: the hello fields of that ``fedsketch bench --json`` file (ValueError, OSError if unfit)."""
    if not args.bench:
        return {}
    from .bench.summary import hello_fields, load_bench_summary

    return hello_fields(load_bench_summary(args.bench, architecture=args.architecture))


def _broker_config(args: argparse.Namespace) -> Any:
    return BrokerConfig.from_args(args, args.broker)


def _transport(args: argparse.Namespace, cfg: Any) -> Any:
    """The device's MQTT transport, with an "offline" last will on its status topic."""
    from .protocol import encode_message
    from .transport import MqttTransport

    topics = Topics(args.root, args.federation)
    offline = Message(Kind.STATUS, args.federation, args.client_id, 0, {"state": "offline"})
    transport = MqttTransport(cfg, args.client_id, federation=args.federation, root=args.root,
                              will_topic=topics.status(args.client_id), will_payload=encode_message(offline))
    if args.server_key:
        from .signing import load_verifier

        transport.verify_with(load_verifier(args.server_key))
    else:
        log.warning("no --server-key: this device obeys any message whose sender says 'server'; "
                    "only the broker's ACL protects it")
    return transport


def _stop_on_sigterm(stop: Any) -> None:
    """SIGTERM (systemd's stop) ends the device's loop cleanly: it disconnects and removes its files, exit 0."""
    def on_term(signum: int, frame: Any) -> None:
        log.info("SIGTERM: leaving")
        stop()

    try:
        signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # not the main thread (a test calling main): the caller's own handling stays
        pass


def _serve(args: argparse.Namespace, run: Any) -> int:
    try:
        run()
    except ConnectionError as e:
        print(f"fedsketch-client: cannot connect to {args.broker}: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        return 130
    return 0


def _run_fedcref(args: argparse.Namespace) -> int:
    """``--fedcref``: this device in a FedCRef federation (unlabelled ``x`` from ``--data``)."""
    from .cli import parse_params
    from .fedcref import FedCRefClient
    from .fedcref.mqtt import FedCRefEdge

    try:
        with np.load(args.data, allow_pickle=False) as f:
            x = f["x"]
        params = parse_params(args.params)
        if str(params.get("encoder", "")).lower() == "none":  # TOML has no null: K-means on the pixels
            params["encoder"] = None
        from .cpu import torch_threads

        params["threads"] = torch_threads(params.get("threads", args.threads or None))  # 1 on a Pi 4
        if args.seed is not None:
            params.setdefault("seed", args.seed)
        fc = FedCRefClient(args.client_id, x, **params)
        cfg = _broker_config(args)
        edge = FedCRefEdge(fc, _transport(args, cfg))
    except (OSError, KeyError, ValueError, TypeError, ImportError) as e:
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    try:
        rc = _serve(args, lambda: edge.run(max_idle_s=args.max_idle))
    except (KeyError, ValueError, FileNotFoundError) as e:  # e.g. an unknown encoder, met at initialisation
        print(f"fedsketch-client: error: {e}", file=sys.stderr)
        return 2
    if rc == 0 and args.labels_out:
        np.savez(args.labels_out, labels=np.asarray(fc.labels_, dtype=np.int64))
        log.warning("final local clusters of %d samples written to %s", len(fc.labels_), args.labels_out)
    return rc


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
