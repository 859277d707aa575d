"""Local TCP ports for the test brokers: a free one to listen on, and waiting until one accepts."""

from __future__ import annotations

import socket
import time
from typing import Any

__all__ = ["free_port", "wait_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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

