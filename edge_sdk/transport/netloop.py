"""One network thread for many MQTT connections, and a small pool for their handlers.

A :class:`~edge_sdk.transport.MqttTransport` runs, by default, paho's own
network thread (``loop_start``: ``select()`` on its socket and a socket pair)
and a dispatcher thread: three descriptors and two threads per connection,
and ``select()`` fails past descriptor 1024, so one process holds about 330
connections. That is right for a device, which has one.

A :class:`NetworkLoop` is what a process with many connections uses instead
(the fleet emulator, :mod:`server_kit.emulate`; a gateway): give it to each
transport (``MqttTransport(..., loop=loop)``) and one thread waits on every
socket at once (``selectors.DefaultSelector``: epoll on Linux, no descriptor
limit but ``RLIMIT_NOFILE``), calling paho's external-loop API: ``loop_read``
when a socket is readable, ``loop_write`` when paho has something to send,
``loop_misc`` (keep-alive) about once a second. paho's
``on_socket_register_write`` callback wakes the loop (a socket pair shared by
all connections) when another thread publishes, so a message is written at
once rather than at the next keep-alive; the loop also re-checks
``want_write()`` when paho withdraws its write interest, which closes the
window where a publish from another thread was left unsent (paho's
``_registered_write`` flag races with its network thread).

Every socket is opened (connect, reconnect with randomised exponential
back-off), registered and closed in the loop's thread. Incoming messages are
validated and handed to the transports' handlers by an
:class:`~edge_sdk.transport.pool.OrderedPool` of a few threads, in order per
transport (one lane each), never in the network thread: a slow handler
delays its own transport only.

>>> loop = NetworkLoop(workers=2)                      # doctest: +SKIP
>>> ts = [MqttTransport(cfg, f"c{i}", federation="f", loop=loop) for i in range(5000)]
>>> for t in ts: t.connect(wait=False)
>>> loop.close()
"""

from __future__ import annotations

import heapq
import itertools
import logging
import selectors
import socket
import threading
import time
from collections import deque
from typing import Any, Callable

from .pool import Lane, OrderedPool

__all__ = ["NetworkLoop", "OrderedPool", "raise_nofile_limit"]

log = logging.getLogger(__name__)


def raise_nofile_limit(target: int | None = None) -> int:
    """Raise this process's soft limit on open descriptors towards the hard limit; returns the new soft limit.

    Parameters
    ----------
    target : int, optional
        The soft limit wanted (default: the hard limit). Never lowered, never
        above the hard limit (raising that needs privileges: ``ulimit -Hn``,
        systemd's ``LimitNOFILE``).
    """
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if target is None else int(target)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if soft != resource.RLIM_INFINITY and want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, want, e)
    return int(soft)


class _Conn:
    """What the loop knows of one paho client."""

    __slots__ = ("owner", "client", "sock", "events")

    def __init__(self, owner: Any, client: Any) -> None:
        self.owner = owner
        self.client = client
        self.sock: Any = None
        self.events = 0


class NetworkLoop:
    """One thread running the sockets of many paho clients; a pool running their handlers.

    Parameters
    ----------
    workers : int
        Threads of the :class:`OrderedPool` that validates incoming messages
        and runs the transports' handlers (in order per transport).
    misc_interval_s : float
        How often every connection gets ``loop_misc`` (keep-alive pings,
        the check that the broker answers them) and its transport a tick
        (expiry of stalled chunked transfers).
    name : str
        Name of the network thread (and prefix of the workers').

    The loop starts with the first transport that connects through it and
    runs until :meth:`close`. Use it as a context manager, or close it after
    the transports.
    """

    def __init__(self, *, workers: int = 2, misc_interval_s: float = 1.0, name: str = "fedsketch-net") -> None:
        if not float(misc_interval_s) > 0:
            raise ValueError(f"misc_interval_s must be a positive number of seconds, got {misc_interval_s!r}")
        self.misc_interval_s = float(misc_interval_s)
        self.name = name
        self.pool = OrderedPool(workers, name=f"{name}-worker")
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._woken = False
        self._ops: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_lock = threading.Lock()
        self._seq = itertools.count()
        self._conns: dict[int, _Conn] = {}
        self._conns_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._start_lock = threading.Lock()
        self._closing = False
        self._counts = {"wakeups": 0, "reads": 0, "writes": 0, "misc_passes": 0, "errors": 0}

    def __repr__(self) -> str:
        return (f"NetworkLoop(name={self.name!r}, connections={len(self._conns)}, "
                f"sockets={self.sockets}, running={self.running})")

    # -- life cycle ------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the network thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def sockets(self) -> int:
        """Sockets currently watched (connected or connecting clients)."""
        return max(0, len(self._sel.get_map()) - 1)

    def start(self) -> NetworkLoop:
        """Start the network thread and the pool (idempotent)."""
        with self._start_lock:
            if self._closing:
                raise RuntimeError("the network loop is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self.pool.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and the pool. Close the transports first: sockets still open are closed here."""
        if self._closing:
            return
        self._closing = True
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.pool.close(timeout)
        for key in list(self._sel.get_map().values()):
            try:
                key.fileobj.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self._sel.close()
        self._wake_w.close()

    def __enter__(self) -> NetworkLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Counters: connections, sockets, wakeups, reads, writes, misc passes, errors, pool jobs and backlog."""
        return {"connections": len(self._conns), "sockets": self.sockets, **self._counts,
                "jobs": self.pool.done, "job_errors": self.pool.errors, "backlog": self.pool.backlog()}

    # -- scheduling (thread-safe) -------------------------------------------------------
    def in_loop(self) -> bool:
        """Whether the caller runs in the network thread."""
        return threading.get_ident() == self._thread_id

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in the network thread, soon (thread-safe)."""
        self._ops.append(fn)
        self._wake()

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in the network thread after ``delay`` seconds (thread-safe)."""
        with self._timer_lock:
            heapq.heappush(self._timers, (time.monotonic() + max(0.0, float(delay)), next(self._seq), fn))
        if not self.in_loop():
            self._wake()

    def submit(self, lane: Lane, job: Callable[[], None]) -> None:
        """Run ``job()`` on the pool, after the jobs already on ``lane``."""
        self.pool.submit(lane, job)

    def _wake(self) -> None:
        if self._woken or self.in_loop():
            return
        self._woken = True
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):  # full (a wake-up is pending anyway) or closed
            pass

    # -- the paho side (MqttTransport calls these) -----------------------------------
    def attach(self, owner: Any, client: Any) -> None:
        """Run paho ``client`` here (``owner``: its transport, ticked every ``misc_interval_s``).

        Sets paho's socket callbacks; connect with ``client.reconnect()`` in
        the network thread (:meth:`call_soon`) after ``connect_async``.
        """
        self.start()
        conn = _Conn(owner, client)
        with self._conns_lock:
            self._conns[id(client)] = conn
        client.on_socket_open = self._on_socket_open
        client.on_socket_close = self._on_socket_close
        client.on_socket_register_write = self._on_register_write
        client.on_socket_unregister_write = self._on_unregister_write

    def detach(self, client: Any) -> None:
        """Forget ``client`` (in the network thread): its socket, if still open, is unwatched and closed."""
        def forget() -> None:
            with self._conns_lock:
                conn = self._conns.pop(id(client), None)
            sock = None if conn is None else conn.sock
            if sock is not None:
                self._unwatch(conn)  # forgets conn.sock: close the socket held here
                try:
                    sock.close()
                except OSError:
                    pass
        if self.in_loop():
            forget()
        elif self.running:
            self.call_soon(forget)
        else:
            with self._conns_lock:
                self._conns.pop(id(client), None)

    def _conn(self, client: Any) -> _Conn | None:
        return self._conns.get(id(client))

    def _on_socket_open(self, client: Any, userdata: Any, sock: Any) -> None:
        conn = self._conn(client)
        if conn is None:
            return
        if not self.in_loop():  # only connect() outside the loop: the socket is not closed meanwhile
            self.call_soon(lambda: self._watch(conn, sock))
            return
        self._watch(conn, sock)

    def _watch(self, conn: _Conn, sock: Any) -> None:
        if conn.client.socket() is not sock or sock.fileno() < 0:
            return  # closed (or replaced) before we got to it
        if conn.sock is not None:
            self._unwatch(conn)
        conn.sock = sock
        conn.events = selectors.EVENT_READ | (selectors.EVENT_WRITE if conn.client.want_write() else 0)
        self._sel.register(sock, conn.events, conn)

    def _unwatch(self, conn: _Conn) -> None:
        if conn.sock is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        conn.sock = None
        conn.events = 0

    def _on_socket_close(self, client: Any, userdata: Any, sock: Any) -> None:
        # paho closes sockets in the thread that runs its loop functions: ours (see the module docstring)
        # (when another thread closes one, unwatching it now, before paho closes the fd, is still right)
        conn = self._conn(client)
        if conn is not None and conn.sock is sock:
            self._unwatch(conn)

    def _on_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        conn = self._conn(client)
        if conn is None:
            return
        if self.in_loop():
            self._want_write(conn)
        else:  # a publish from another thread: write it now, not at the next keep-alive
            self.call_soon(lambda: self._flush(conn))

    def _on_unregister_write(self, client: Any, userdata: Any, sock: Any) -> None:
        conn = self._conn(client)
        if conn is None or not self.in_loop():
            return  # outside the loop only while closing: the socket is unwatched on close
        if conn.sock is not None and conn.events & selectors.EVENT_WRITE and not client.want_write():
            self._set_events(conn, selectors.EVENT_READ)
        # else a publish slipped in after paho's own check: keep watching for writability

    def _want_write(self, conn: _Conn) -> None:
        if conn.sock is not None and not conn.events & selectors.EVENT_WRITE:
            self._set_events(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _set_events(self, conn: _Conn, events: int) -> None:
        try:
            self._sel.modify(conn.sock, events, conn)
            conn.events = events
        except (KeyError, ValueError, OSError):  # closed meanwhile
            conn.events = 0

    def _flush(self, conn: _Conn) -> None:
        if conn.sock is None or not conn.client.want_write():
            return
        self._counts["writes"] += 1
        conn.client.loop_write()  # what the socket takes now; the rest when it is writable again
        if conn.sock is not None and conn.client.want_write():
            self._want_write(conn)

    # -- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        self._thread_id = threading.get_ident()
        next_misc = time.monotonic() + self.misc_interval_s
        while not self._closing:
            now = time.monotonic()
            timeout = next_misc - now
            with self._timer_lock:
                if self._timers:
                    timeout = min(timeout, self._timers[0][0] - now)
            if self._ops:
                timeout = 0
            try:
                events = self._sel.select(max(0.0, timeout))
            except OSError as e:  # pragma: no cover - EINTR is retried by Python
                log.error("network loop: select failed: %s", e)
                events = []
            for key, mask in events:
                conn = key.data
                if conn is None:
                    self._drain_wakeups()
                    continue
                self._serve(conn, mask)
            self._run_ops()
            self._run_timers()
            if time.monotonic() >= next_misc:
                self._misc()
                next_misc = time.monotonic() + self.misc_interval_s
        self._run_ops()

    def _drain_wakeups(self) -> None:
        self._counts["wakeups"] += 1
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        # only now: a wake-up asked for after the drain sends a byte, one asked for before it is in _ops
        self._woken = False

    def _serve(self, conn: _Conn, mask: int) -> None:
        client = conn.client
        try:
            if mask & selectors.EVENT_READ and conn.sock is not None:
                self._counts["reads"] += 1
                client.loop_read()
                # TLS: bytes already decrypted inside the SSL object never wake epoll again; read them now
                for _ in range(64):
                    pending = getattr(conn.sock, "pending", None)
                    if conn.sock is None or pending is None or pending() <= 0:
                        break
                    client.loop_read()
            if mask & selectors.EVENT_WRITE and conn.sock is not None:
                self._counts["writes"] += 1
                client.loop_write()
        except Exception:  # a paho or callback bug must not end the loop of every connection
            self._counts["errors"] += 1
            log.exception("network loop: error serving %r", conn.owner)

    def _run_ops(self) -> None:
        for _ in range(len(self._ops)):
            try:
                op = self._ops.popleft()
            except IndexError:
                return
            try:
                op()
            except Exception:
                self._counts["errors"] += 1
                log.exception("network loop: operation failed")

    def _run_timers(self) -> None:
        now = time.monotonic()
        due = []
        with self._timer_lock:
            while self._timers and self._timers[0][0] <= now:
                due.append(heapq.heappop(self._timers)[2])
        for fn in due:
            try:
                fn()
            except Exception:
                self._counts["errors"] += 1
                log.exception("network loop: timer failed")

    def _misc(self) -> None:
        self._counts["misc_passes"] += 1
        with self._conns_lock:
            conns = list(self._conns.values())
        for conn in conns:
            try:
                if conn.sock is not None:
                    conn.client.loop_misc()
                tick = getattr(conn.owner, "_tick", None)
                if tick is not None:
                    tick()
            except Exception:
                self._counts["errors"] += 1
                log.exception("network loop: periodic work of %r failed", conn.owner)
