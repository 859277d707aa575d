"""Local TCP ports for the test brokers: a free one to listen on, and waiting until one accepts."""

from __future__ import annotations

import socket
import time
from typing import Any

__all__ = ["free_port", "free_ports", "wait_listening", "wait_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago: all held open together while the OS picks them,
    so no two are the same (calling :func:`free_port` ``n`` times may give one port twice)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_port(host: str, port: int, timeout: float, alive: Any = None) -> None:
    """Wait until ``host:port`` accepts TCP connections; ``alive()`` False aborts."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"broker process exited before listening on {host}:{port}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:g} s") from None
            time.sleep(0.02)



def wait_listening(host: str, port: int, timeout: float) -> None:
    """Wait until something listens on ``host:port``, without connecting to it.

    For a broker in this process (:class:`~server_kit.broker.embedded.EmbeddedBroker`): a connection that
    sends nothing would be logged by the broker as an error. The port is known taken when binding it fails.
    """
    import errno

    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:g} s")
        time.sleep(0.02)


def find_binary(name: str) -> str | None:
    """Path of a broker binary: on PATH, else ``/usr/sbin/<name>``, else None."""
    import os
    import shutil

    found = shutil.which(name)
    if found:
        return found
    fallback = f"/usr/sbin/{name}"
    return fallback if os.access(fallback, os.X_OK) else None
