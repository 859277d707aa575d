"""The watch's HTTP endpoint: ``/metrics`` for Prometheus, ``/`` the live page, ``/state.json`` the run so far.

:class:`WatchServer` listens on one address (127.0.0.1 unless told
otherwise) in threads of its own; nothing it serves touches the run's state
(it reads the watch's last view). Once the run is over, ``/`` is the final
``report.html``, ``/state.json`` its ``results.json``, and the files of the
report folder (its plots, ``models/models.json``) are served beside it.
An address that cannot be listened on (in use, not permitted, unknown) is a
:class:`WatchError` with one line saying so, raised before the run starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..report.results import json_text
from .live import final_page, live_page
from .options import WatchError
from .watch import Watch

__all__ = ["WatchServer"]

log = logging.getLogger(__name__)

#: Seconds a page read waits for a view that carries the run's result (the driver takes one within 0.2 s
#: while it waits for messages; busy clustering, it may take longer: the page then shows the run's state only).
RESULT_WAIT_S = 1.0

_TYPES = {".png": "image/png", ".json": "application/json", ".html": "text/html; charset=utf-8",
          ".svg": "image/svg+xml"}


class WatchServer:
    """Serves a :class:`~.watch.Watch` over HTTP (see the module docstring).

    Parameters
    ----------
    watch : Watch or None
        The run's watch (None: an aggregator's endpoint, ``/metrics`` only).
    registry : CollectorRegistry
        What ``/metrics`` exposes.
    results_of : callable
        ``results_of(result)``: the content of ``results.json`` from a run's result so far
        (:func:`server_kit.report.build_results` with the run's target and truth).
    host, port : str, int
        Where to listen (port 0: a free one, :attr:`port` says which).
    """

    def __init__(self, watch: Watch | None, registry: CollectorRegistry, results_of: Callable[[Mapping[str, Any]], Any], *,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.watch, self.registry, self.results_of = watch, registry, results_of
        handler = type("WatchHandler", (_Handler,), {"server_side": self})
        try:
            self.httpd = ThreadingHTTPServer((host, int(port)), handler)
        except OSError as e:
            raise WatchError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
        except OverflowError:
            raise WatchError(f"cannot listen on {host}:{port}: a port is 0 to 65535") from None
        self.httpd.daemon_threads = True
        self.host = host
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name=f"watch-{self.port}", daemon=True)
        #: CPU seconds its answers took (each in its request's thread).
        self.cpu_s = 0.0
        self._cpu_lock = threading.Lock()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def start(self) -> WatchServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> WatchServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what each path answers -----------------------------------------------------
    def answer(self, path: str) -> tuple[int, str, bytes]:
        """(status, content type, body) of a GET of ``path`` (its CPU time added to :attr:`cpu_s`)."""
        cpu = time.thread_time()
        try:
            return self._answer(path)
        finally:
            spent = time.thread_time() - cpu
            with self._cpu_lock:
                self.cpu_s += spent

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        watch = self.watch
        if watch is None:
            return 404, "text/plain; charset=utf-8", b"not found: this endpoint serves /metrics\n"
        if path in ("/", "/index.html", "/report.html"):
            if watch.final is not None:
                return 200, _TYPES[".html"], final_page(watch.final, watch.report_dir)
            view = self._view_with_result()
            results = None if view is None or view.result is None else self.results_of(view.result)
            return 200, _TYPES[".html"], live_page(view, results).encode("utf-8")
        if path in ("/state.json", "/results.json"):
            return 200, _TYPES[".json"], self._state()
        if watch.final is not None and watch.report_dir is not None:
            found = _inside(watch.report_dir, path)
            if found is not None:
                return 200, _TYPES.get(found.suffix, "application/octet-stream"), found.read_bytes()
        return 404, "text/plain; charset=utf-8", b"not found\n"

    def _view_with_result(self) -> Any:
        """The last view, after asking for the run's result in views: a page read after a while waits (at most
        :data:`RESULT_WAIT_S`) for the driver's next view to carry it."""
        watch = self.watch
        assert watch is not None
        watch.page_read()
        deadline = time.monotonic() + RESULT_WAIT_S
        view = watch.view
        while (view is None or view.result is None) and watch.final is None and time.monotonic() < deadline:
            time.sleep(0.05)
            view = watch.view
        return view

    def _state(self) -> bytes:
        watch = self.watch
        assert watch is not None
        if watch.final is not None:
            if watch.report_dir is not None and (watch.report_dir / "results.json").is_file():
                return (watch.report_dir / "results.json").read_bytes()
            return _json(watch.final)
        view = self._view_with_result()
        if view is None or view.result is None:
            return _json({"phase": None if view is None else view.phase.value,
                          "round": None if view is None else view.round})
        return _json(self.results_of(view.result))


def _json(data: Mapping[str, Any]) -> bytes:
    return json_text(data).encode("utf-8")


def _inside(folder: Path, path: str) -> Path | None:
    """The file ``path`` names inside ``folder`` (None for anything outside it, hidden, or not a file)."""
    parts = [p for p in path.split("/") if p]
    if not parts or any(p.startswith(".") for p in parts):
        return None
    root = folder.resolve()
    found = root.joinpath(*parts).resolve()
    if root not in found.parents or not found.is_file():
        return None
    return found


class _Handler(BaseHTTPRequestHandler):
    server_side: WatchServer
    server_version = "fedsketch-watch"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        try:
            status, ctype, body = self.server_side.answer(urlsplit(self.path).path)
        except Exception:  # a bug in a page must not stop the endpoint
            log.exception("the watch could not answer %s", self.path)
            status, ctype, body = 500, "text/plain; charset=utf-8", b"the watch could not answer; see the log\n"
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        log.debug("watch: " + format, *args)
