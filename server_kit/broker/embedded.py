"""amqtt in this process, on its own event loop thread: the broker for machines without Mosquitto."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from .ports import free_port, wait_listening

__all__ = ["EmbeddedBroker"]

log = logging.getLogger(__name__)


class EmbeddedBroker:
    """amqtt running in this process, on its own event loop thread.

    Anonymous clients are allowed and messages have no size limit. amqtt
    speaks MQTT 3.1.1 only, and drops the session of an anonymous client when
    it disconnects: use :class:`MosquittoBroker` to test persistent sessions.

    Parameters
    ----------
    session_expiry_s : int, optional
        Seconds amqtt keeps a disconnected (authenticated) session.
    """

    def __init__(self, *, session_expiry_s: int | None = None) -> None:
        self.session_expiry_s = session_expiry_s
        self.host: str | None = None
        self.port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None

    def __repr__(self) -> str:
        return f"EmbeddedBroker(url={self.url!r}, running={self.running})"

    @property
    def url(self) -> str:
        """``mqtt://host:port``."""
        return f"mqtt://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the broker is serving."""
        return self._broker is not None

    def _config(self) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{self.port}"}},
            # Only anonymous authentication: no $SYS publisher, no packet logger.
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        if self.session_expiry_s is not None:
            conf["session_expiry_interval"] = int(self.session_expiry_s)
        return conf

    async def _start(self) -> Any:
        from amqtt.broker import Broker

        broker = Broker(self._config())
        await broker.start()
        return broker

    def start(self, host: str = "127.0.0.1", port: int | None = None, timeout: float = 10.0) -> str:
        """Start serving on ``host:port`` (a free port by default); returns the URL."""
        if self.running:
            return self.url
        self.host = host
        self.port = port if port is not None else free_port(host)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=_run_loop, args=(loop,), name="fedsketch-amqtt", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._broker = asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout)
            wait_listening(self.host, self.port, timeout)  # no probe connection: amqtt would log it
        except BaseException:
            self._stop_loop(timeout)
            raise
        log.info("amqtt broker listening on %s", self.url)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Shut the broker down and end its thread."""
        broker, self._broker = self._broker, None
        if broker is not None and self._loop is not None:
            try:
                asyncio.run_coroutine_threadsafe(broker.shutdown(), self._loop).result(timeout)
            except Exception as e:  # a failed shutdown must not stop the loop from ending
                log.warning("amqtt shutdown failed: %s", e)
        self._stop_loop(timeout)

    def _stop_loop(self, timeout: float) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

