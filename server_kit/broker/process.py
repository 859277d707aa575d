"""One broker subprocess (Mosquitto, a NATS node): started, watched, stopped by PID, never left behind."""

from __future__ import annotations

import logging
import signal
import subprocess
import weakref
from collections.abc import Sequence

__all__ = ["BrokerProcess"]

log = logging.getLogger(__name__)


class BrokerProcess:
    """A broker's process: ``spawn`` it, ask whether it is ``running``, ``stop`` it with a signal.

    Its stderr is kept for the error message of a failed start; a process
    still running when its owner is garbage-collected is terminated.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """Process id (None when stopped)."""
        return self._proc.pid if self.running and self._proc is not None else None

    def spawn(self, argv: Sequence[str], owner: object) -> None:
        """Start ``argv``; the process is terminated when ``owner`` is garbage-collected without :meth:`stop`."""
        self._proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE)
        self._finalizer = weakref.finalize(owner, _terminate, self._proc, self.name)

    def stderr_text(self) -> str:
        """What the process wrote to stderr, once it has exited ("" while it runs)."""
        if self._proc is None or self._proc.stderr is None or self._proc.poll() is None:
            return ""
        try:
            return self._proc.stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def stop(self, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` and wait; kill the process if it is still there after ``timeout`` seconds."""
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _terminate(proc, self.name, timeout, sig)


def _terminate(proc: subprocess.Popen[bytes], name: str, timeout: float = 10.0, sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) ignored signal %d; killing it", name, proc.pid, sig)
            proc.kill()
            proc.wait(timeout)
    if proc.stderr is not None:
        proc.stderr.close()
