"""A fleet of real devices in a few processes: the emulator of ``benchmarks/fleet.py`` and the fleet tests.

Every emulated device is what a Raspberry Pi runs: a real
:class:`~edge_sdk.client.EdgeClient` with its own
:class:`~edge_sdk.worker.LocalWorker` (its data, its sketch, its local
training) and its own :class:`~edge_sdk.transport.MqttTransport`, one TCP
connection to the broker each, with its user name, password, last will and
persistent session. What is shared, so that thousands fit in a process and
the emulation costs less than the server it loads:

* the network: a few :class:`~edge_sdk.netloop.NetworkLoop` threads (epoll)
  run every connection of the process, and their pools run the handlers;
* the commands: a small :class:`~edge_sdk.netloop.OrderedPool` calls
  :meth:`EdgeClient.step` for a device when its transport delivered
  something (``on_delivered``) or when its jittered hello falls due, in
  order per device; no thread waits on any one device;
* the ONNX encoder session (one per encoder and process, thread-safe).

:class:`EmulatedFleet` runs the devices in this process (``processes=0``) or
spreads them over child processes (``multiprocessing`` spawn): each gets its
devices' data as numpy arrays in its process arguments, and reports counts
to the parent as JSON over a pipe (nothing a broker peer sent is ever
unpickled).

>>> clients = fleet_partition(1000, seed=0)            # doctest: +SKIP
>>> with EmulatedFleet(broker.url, clients, federation="fleet", processes=1) as fleet:
...     fleet.wait_connected(60)
...     # start the server; fleet.snapshot() counts what the devices did
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from .data.partition import ClientData, load_digits_images

__all__ = ["EmulatedFleet", "FleetSettings", "fleet_partition"]

log = logging.getLogger(__name__)


def fleet_partition(
    n_clients: int,
    *,
    min_samples: int = 30,
    max_samples: int = 60,
    groups: int = 4,
    test_fraction: float = 0.2,
    seed: int = 0,
    prefix: str = "d",
    images: np.ndarray | None = None,
    labels: np.ndarray | None = None,
) -> list[ClientData]:
    """Devices with ``min_samples`` to ``max_samples`` training digits each, in rotation groups.

    Each device draws its training samples (and ``test_fraction`` as many
    test samples, at least one, disjoint from them) from scikit-learn's 1,797
    digits without replacement; devices draw independently, so a large fleet
    reuses the digits. Device ``i`` is rotated by ``90 * (i mod groups)``
    degrees (its ``group``), ids are ``f"{prefix}{i:05d}"``.
    """
    if n_clients < 1:
        raise ValueError(f"n_clients must be positive, got {n_clients}")
    if not 1 <= min_samples <= max_samples:
        raise ValueError(f"min_samples and max_samples must satisfy 1 <= min <= max, got {min_samples}, "
                         f"{max_samples}")
    if not 1 <= groups <= 4:
        raise ValueError(f"groups must be between 1 and 4 rotations, got {groups}")
    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if images is None or labels is None:
        images, labels = load_digits_images()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n_clients):
        n = int(rng.integers(min_samples, max_samples + 1))
        n_test = max(1, int(round(test_fraction * n)))
        if n + n_test > len(images):
            raise ValueError(f"{n + n_test} samples per device, the data has {len(images)}")
        idx = rng.choice(len(images), size=n + n_test, replace=False)
        g = i % groups
        x = np.rot90(images[idx], k=g, axes=(1, 2)).astype(np.float32)
        y = labels[idx]
        out.append(ClientData(f"{prefix}{i:05d}", x[n_test:], y[n_test:], x[:n_test], y[:n_test], g))
    return out


@dataclass(frozen=True)
class FleetSettings:
    """How the emulated devices reach the broker and behave (plain values: they cross to child processes).

    ``loops`` network threads and ``workers`` handler threads per loop,
    ``steppers`` threads calling :meth:`EdgeClient.step`, per process.
    ``connect_window``: connections opened and not yet acknowledged by the
    broker at once (Mosquitto accepts from a queue of 100: a larger burst
    only makes the kernel drop SYNs, and the devices wait 1 s to retry).
    """

    broker_url: str
    federation: str = "default"
    root: str = "fedsketch"
    loops: int = 2
    workers: int = 2
    steppers: int = 2
    hello_jitter_s: float = 0.0
    model_timeout_s: float = 120.0
    connect_window: int = 64
    connect_timeout_s: float = 120.0
    keepalive: int = 60
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 10.0
    seed: int = 0
    quiet: bool = True

    def __post_init__(self) -> None:
        for name in ("loops", "workers", "steppers", "connect_window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if not self.hello_jitter_s >= 0:
            raise ValueError(f"hello_jitter_s must be >= 0, got {self.hello_jitter_s!r}")


def _sum_into(total: dict[str, Any], part: Mapping[str, Any]) -> None:
    """Add nested counters (dicts of ints) into ``total``."""
    for k, v in part.items():
        if isinstance(v, Mapping):
            _sum_into(total.setdefault(k, {}), v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            total[k] = total.get(k, 0) + v


class _Timer:
    """One thread calling ``fn(item)`` at given times (for the devices' jittered hellos)."""

    def __init__(self, fn: Callable[[int], None]) -> None:
        self._fn = fn
        self._heap: list[tuple[float, int]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="fedsketch-emulate-timer", daemon=True)
        self._thread.start()

    def at(self, when: float, item: int) -> None:
        with self._cv:
            heapq.heappush(self._heap, (when, item))
            if self._heap[0][1] == item:
                self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                if self._closed:
                    return
                _, item = heapq.heappop(self._heap)
            self._fn(item)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5)


class _Shard:
    """The devices of one process."""

    def __init__(self, settings: FleetSettings, clients: Sequence[ClientData],
                 passwords: Mapping[str, str] | None = None) -> None:
        self.s = settings
        self.clients = list(clients)
        self.passwords = dict(passwords or {})
        self.edges: list[Any] = []
        self.transports: list[Any] = []
        self.loops: list[Any] = []
        self.done: dict[str, int] = {}  # device -> exit code, once it stopped
        self._lanes: list[Any] = []
        self._steps: Any = None
        self._timer: _Timer | None = None
        self._closed = False
        self.started_s: float | None = None

    def start(self) -> None:
        """Create every device, connect them (``connect_window`` at a time), start each client."""
        from edge_sdk.client import EdgeClient
        from edge_sdk.netloop import NetworkLoop, OrderedPool, raise_nofile_limit
        from edge_sdk.protocol import Kind, Message, Topics, encode_message
        from edge_sdk.transport import BrokerConfig, MqttTransport
        from edge_sdk.worker import LocalWorker

        s = self.s
        need = len(self.clients) + 256
        soft = raise_nofile_limit()
        if 0 < soft < need:
            raise OSError(f"{len(self.clients)} devices need about {need} open files; this process may open "
                          f"{soft} (ulimit -Hn): raise the hard limit or use more processes")
        t0 = time.monotonic()
        self.loops = [NetworkLoop(workers=s.workers, name=f"fedsketch-emu{i}") for i in range(s.loops)]
        self._steps = OrderedPool(s.steppers, name="fedsketch-emu-step").start()
        self._timer = _Timer(self._wake)
        topics = Topics(s.root, s.federation)
        encoders: dict[str, Any] = {}  # one ONNX session per encoder for the whole process (thread-safe)
        for i, c in enumerate(self.clients):
            pw = self.passwords.get(c.cid)
            cfg = BrokerConfig.from_url(s.broker_url, username=c.cid if pw is not None else None, password=pw,
                                        keepalive=s.keepalive, reconnect_min_s=s.reconnect_min_s,
                                        reconnect_max_s=s.reconnect_max_s)
            will = encode_message(Message(Kind.STATUS, s.federation, c.cid, 0, {"state": "offline"}))
            t = MqttTransport(cfg, c.cid, federation=s.federation, root=s.root,
                              will_topic=topics.status(c.cid), will_payload=will, loop=self.loops[i % s.loops])
            w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, seed=s.seed + i)
            ec = EdgeClient(t, w, federation=s.federation, root=s.root, seed=s.seed + i,
                            model_timeout_s=s.model_timeout_s, hello_jitter_s=s.hello_jitter_s,
                            encoders=encoders)  # one ONNX Runtime session per encoder in the process
            t.on_delivered(partial(self._wake, i))
            self.transports.append(t)
            self.edges.append(ec)
            self._lanes.append(self._steps.lane(c.cid))
        waiting: list[int] = []
        for i, t in enumerate(self.transports):
            t.connect(wait=False)
            waiting.append(i)
            if len(waiting) >= s.connect_window:
                self._start_client(waiting.pop(0))
        for i in waiting:
            self._start_client(i)
        self.started_s = time.monotonic() - t0

    def _start_client(self, i: int) -> None:
        t, ec = self.transports[i], self.edges[i]
        if not t.wait_connected(self.s.connect_timeout_s):
            raise ConnectionError(f"device {ec.cid} not connected to {self.s.broker_url} within "
                                  f"{self.s.connect_timeout_s:g} s")
        ec.start()  # subscribes, then schedules its hello (jittered)
        t.on_connected(partial(self._after_connect, i))  # after the client's own listener: its hello is due
        self._schedule(i)

    def _after_connect(self, i: int) -> None:
        self._schedule(i)

    def _schedule(self, i: int) -> None:
        due = self.edges[i].hello_due
        if due is not None and self._timer is not None:
            self._timer.at(due, i)

    def _wake(self, i: int) -> None:
        if not self._closed:
            self._steps.submit(self._lanes[i], partial(self._step, i))

    def _step(self, i: int) -> None:
        ec = self.edges[i]
        if ec.cid in self.done:
            return
        if ec.step(0):
            self._schedule(i)
        else:
            self.done[ec.cid] = ec.exit_code

    def snapshot(self, totals: bool = False) -> dict[str, Any]:
        """Counts: devices, connected, done (and exit codes), commands handled per op; ``totals``: traffic too."""
        handled: dict[str, int] = {}
        for ec in self.edges:
            for op, n in list(ec.handled.items()):
                handled[op] = handled.get(op, 0) + n
        codes: dict[str, int] = {}
        for code in list(self.done.values()):
            codes[str(code)] = codes.get(str(code), 0) + 1
        out: dict[str, Any] = {
            "devices": len(self.clients), "connected": sum(t.is_connected for t in self.transports),
            "done": len(self.done), "exit_codes": codes, "handled": handled,
            "started_s": self.started_s,
        }
        if totals:
            traffic: dict[str, Any] = {}
            for t in self.transports:
                st = t.stats()
                _sum_into(traffic, {"sent": st["sent"], "received": st["received"], "rejected": st["rejected"],
                                    "errors": st["errors"]})
            out["traffic"] = traffic
            loops: dict[str, Any] = {}
            for lp in self.loops:
                _sum_into(loops, lp.stats())
            out["loops"] = loops
            out["rejected_by_clients"] = {}
            for ec in self.edges:
                _sum_into(out["rejected_by_clients"], dict(ec.rejected))
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Disconnect every device cleanly (no last will), stop the threads."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.close()
        if self._steps is not None:
            self._steps.close(timeout)
        for t in self.transports:
            try:
                t.close(timeout=min(timeout, 1.0))
            except Exception as e:  # keep closing the others
                log.warning("closing %s: %s", t.client_id, e)
        for lp in self.loops:
            lp.close(timeout)


# -- child processes ---------------------------------------------------------------------


def _pack(clients: Sequence[ClientData]) -> dict[str, Any]:
    """Devices' data as a few arrays (what crosses to a child process)."""
    n_train = np.array([len(c.y_train) for c in clients], dtype=np.int64)
    n_test = np.array([len(c.y_test) for c in clients], dtype=np.int64)
    return {
        "cids": [c.cid for c in clients], "groups": [int(c.group) for c in clients],
        "n_train": n_train, "n_test": n_test,
        "x_train": np.concatenate([c.x_train for c in clients]).astype(np.float32),
        "y_train": np.concatenate([c.y_train for c in clients]).astype(np.int64),
        "x_test": np.concatenate([c.x_test for c in clients]).astype(np.float32),
        "y_test": np.concatenate([c.y_test for c in clients]).astype(np.int64),
    }


def _unpack(p: Mapping[str, Any]) -> list[ClientData]:
    out = []
    a = b = 0
    for cid, g, n, m in zip(p["cids"], p["groups"], p["n_train"], p["n_test"]):
        out.append(ClientData(cid, p["x_train"][a:a + n], p["y_train"][a:a + n], p["x_test"][b:b + m],
                              p["y_test"][b:b + m], int(g)))
        a, b = a + int(n), b + int(m)
    return out


def _shard_main(conn: Any, settings: dict[str, Any], packed: dict[str, Any], passwords: dict[str, str]) -> None:
    """A child process: run one shard, answer the parent's requests ("snapshot", "totals", "close") in JSON."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    s = FleetSettings(**settings)
    logging.basicConfig(level=logging.WARNING if s.quiet else logging.INFO,
                        format="%(asctime)s emulator %(levelname)s %(name)s: %(message)s")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
    shard = _Shard(s, _unpack(packed), passwords)
    try:
        shard.start()
        conn.send_bytes(json.dumps({"ok": True, "snapshot": shard.snapshot()}).encode())
    except Exception as e:
        conn.send_bytes(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}).encode())
        shard.close()
        return
    while True:
        try:
            req = conn.recv_bytes().decode()
        except (EOFError, OSError):
            req = "close"
        if req == "close":
            final = shard.snapshot(totals=True)
            shard.close()
            try:
                conn.send_bytes(json.dumps(final).encode())
            except (OSError, ValueError):
                pass
            return
        conn.send_bytes(json.dumps(shard.snapshot(totals=req == "totals")).encode())


class EmulatedFleet:
    """Real devices in this process or a few child processes.

    Parameters
    ----------
    broker_url : str
        ``mqtt://host:port`` of the broker.
    clients : sequence of ClientData
        One device each (:func:`fleet_partition`, or any partition).
    passwords : mapping, optional
        Device id -> broker password (the device logs in with its id as user
        name); None: no credentials (an anonymous broker).
    processes : int
        0: the devices run in this process; n >= 1: in n child processes
        (spawned), devices dealt out in turn.
    **settings
        :class:`FleetSettings` fields: ``federation``, ``root``, ``loops``,
        ``workers``, ``steppers``, ``hello_jitter_s``, ``model_timeout_s``,
        ``connect_window``, ``seed``...

    :meth:`start` returns once every device is connected and subscribed (its
    hello scheduled); :meth:`close` disconnects them cleanly.
    """

    def __init__(self, broker_url: str, clients: Sequence[ClientData], *,
                 passwords: Mapping[str, str] | None = None, processes: int = 0, **settings: Any) -> None:
        if isinstance(processes, bool) or not isinstance(processes, int) or processes < 0:
            raise ValueError(f"processes must be a non-negative integer, got {processes!r}")
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(FleetSettings)})
        if unknown:
            raise TypeError(f"unknown settings {unknown}; known: "
                            f"{sorted(f.name for f in dataclasses.fields(FleetSettings))}")
        self.settings = FleetSettings(broker_url=broker_url, **settings)
        self.clients = list(clients)
        if not self.clients:
            raise ValueError("an emulated fleet needs at least one device")
        self.passwords = dict(passwords) if passwords is not None else None
        self.processes = min(processes, len(self.clients))
        self._shard: _Shard | None = None
        self._procs: list[tuple[Any, Any]] = []
        self._final: list[dict[str, Any]] = []
        self.start_s: float | None = None

    def __repr__(self) -> str:
        return (f"EmulatedFleet({len(self.clients)} devices, processes={self.processes}, "
                f"broker={self.settings.broker_url!r})")

    def start(self) -> EmulatedFleet:
        """Create and connect every device; returns when all are connected and subscribed."""
        t0 = time.monotonic()
        if self.processes == 0:
            self._shard = _Shard(self.settings, self.clients, self.passwords)
            try:
                self._shard.start()
            except BaseException:
                self._shard.close()
                raise
        else:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            settings = dataclasses.asdict(self.settings)
            for k in range(self.processes):
                part = self.clients[k::self.processes]
                pw = {c.cid: self.passwords[c.cid] for c in part} if self.passwords is not None else {}
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_shard_main, args=(child, settings, _pack(part), pw),
                                   name=f"fedsketch-emulator-{k}", daemon=True)
                proc.start()
                child.close()
                self._procs.append((proc, parent))
            errors = []
            for proc, conn in self._procs:
                if not conn.poll(self.settings.connect_timeout_s + 120):
                    errors.append(f"{proc.name}: no answer")
                    continue
                answer = json.loads(conn.recv_bytes().decode())
                if not answer.get("ok"):
                    errors.append(f"{proc.name}: {answer.get('error')}")
            if errors:
                self.close()
                raise RuntimeError("emulator processes failed to start: " + "; ".join(errors))
        self.start_s = time.monotonic() - t0
        return self

    @property
    def pids(self) -> list[int]:
        """Process ids running the devices (this process's own with ``processes=0``)."""
        if self._procs:
            return [proc.pid for proc, _ in self._procs if proc.pid is not None]
        return [os.getpid()]

    def _ask(self, req: str) -> list[dict[str, Any]]:
        out = []
        for proc, conn in self._procs:
            try:
                conn.send_bytes(req.encode())
                if conn.poll(60):
                    out.append(json.loads(conn.recv_bytes().decode()))
            except (OSError, EOFError, ValueError):
                log.warning("emulator process %s does not answer", proc.name)
        return out

    def snapshot(self, totals: bool = False) -> dict[str, Any]:
        """Counts over every device: connected, done, exit codes, commands handled per op (see :class:`_Shard`)."""
        if self._shard is not None:
            return self._shard.snapshot(totals)
        parts = self._final or self._ask("totals" if totals else "snapshot")
        out: dict[str, Any] = {}
        for p in parts:
            _sum_into(out, p)
        return out

    def wait_connected(self, timeout: float = 60.0) -> bool:
        """Wait until every device is connected; returns whether they are."""
        deadline = time.monotonic() + timeout
        while True:
            snap = self.snapshot()
            if snap.get("connected", 0) >= len(self.clients):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def wait_done(self, timeout: float = 60.0) -> bool:
        """Wait until every device stopped (the server said stop, or refused it)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.snapshot().get("done", 0) >= len(self.clients):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def close(self, timeout: float = 30.0) -> dict[str, Any]:
        """Disconnect every device cleanly and end the processes; returns the final counts with traffic."""
        if self._shard is not None:
            final = self._shard.snapshot(totals=True)
            self._shard.close()
            self._shard = None
            self._final = [final]
            return final
        if self._procs and not self._final:
            self._final = self._ask("close")
            for proc, conn in self._procs:
                proc.join(timeout)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
                conn.close()
            self._procs = []
        out: dict[str, Any] = {}
        for p in self._final:
            _sum_into(out, p)
        return out

    def __enter__(self) -> EmulatedFleet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
