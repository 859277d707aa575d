"""The log lines of every FedSketch process: text for a person, or one JSON object per line for a log shipper.

``fedsketch-server``, ``fedsketch-client``, ``fedsketch-aggregator`` and the
server's ingest workers take ``--log-format {text,json}``
(:func:`add_log_format_argument`) and call :func:`configure_logging` instead
of :func:`logging.basicConfig`. In ``json`` each line is one object::

    {"time": "2026-11-28T09:41:07.123Z", "level": "INFO", "component": "server",
     "logger": "server_kit.rounds.training", "event": "round %d: %d update(s)",
     "message": "round 3: 12 update(s)", "run": "r-...", "round": 3, "args": [3, 12]}

``event`` is the message's template (the same kind of line always has the
same event); ``run``, ``round`` and ``device`` come from :data:`log_context`
when known (a caller's ``extra={"device": ...}`` names another); a caller's
other ``extra`` fields follow; ``exc`` holds the traceback of an exception.
Every value is JSON-safe: a number, a string, a bool or null (a non-finite
float is null, anything else its ``str()``).

Standard library only: both sides import it.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import sys
import threading
import time
from collections.abc import Mapping
from enum import Enum
from typing import Any

__all__ = ["JsonFormatter", "LogContext", "LogFormat", "add_log_format_argument", "configure_logging",
           "current_format", "log_context"]


class LogFormat(Enum):
    """How a process writes its log lines."""

    #: The usual lines, each program's own format string.
    TEXT = "text"
    #: One JSON object per line (:class:`JsonFormatter`).
    JSON = "json"

    @classmethod
    def parse(cls, value: LogFormat | str) -> LogFormat:
        """``value`` as a :class:`LogFormat`; anything but ``text`` or ``json`` is a ValueError."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"log format must be one of {[f.value for f in cls]}, got {value!r}") from None


class LogContext:
    """What a process knows of where it is (the run, the round, the device), added to each JSON line.

    Process-wide and thread-safe: the server sets ``run`` when it announces a
    run and ``round`` when its round changes; a device sets ``device`` at its
    start, ``run`` when it joins a run and ``round`` when it trains.
    """

    #: The fields it holds.
    FIELDS = ("run", "round", "device")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fields: dict[str, Any] = {}

    def set(self, **fields: Any) -> None:
        """Set the fields given (a None value forgets that field)."""
        unknown = sorted(set(fields) - set(self.FIELDS))
        if unknown:
            raise ValueError(f"log context fields must be among {list(self.FIELDS)}, got {unknown}")
        with self._lock:
            for name, value in fields.items():
                if value is None:
                    self._fields.pop(name, None)
                else:
                    self._fields[name] = value

    def clear(self, *names: str) -> None:
        """Forget the fields named (every field when none is named)."""
        with self._lock:
            for name in names or self.FIELDS:
                self._fields.pop(name, None)

    def snapshot(self) -> dict[str, Any]:
        """The fields known now, in :attr:`FIELDS` order (a copy)."""
        with self._lock:
            return {name: self._fields[name] for name in self.FIELDS if name in self._fields}


#: The process's one context.
log_context = LogContext()

# what every LogRecord carries: a caller's extra fields are the rest
_RECORD_FIELDS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}
# the keys of a JSON line's own; a caller's extra field of one of these names is written as "extra_<name>"
_OWN_KEYS = frozenset({"time", "level", "component", "logger", "event", "message", "args", "exc", "stack"})


def _safe(value: Any) -> Any:
    """``value`` as JSON can hold it: a bool, None, a string, an int, a finite float (else null); else str()."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        v = float(value)
        return v if math.isfinite(v) else None
    return str(value)


class JsonFormatter(logging.Formatter):
    """Each record as one line of JSON (see the module docstring for its keys).

    Parameters
    ----------
    component : str
        Which process writes: ``server``, ``device``, ``aggregator`` or ``ingest-<p>``.
    context : LogContext, optional
        Where ``run``, ``round`` and ``device`` come from (default: :data:`log_context`).
    """

    def __init__(self, component: str, context: LogContext | None = None) -> None:
        super().__init__()
        self.component = component
        self.context = log_context if context is None else context

    def format(self, record: logging.LogRecord) -> str:
        secs = int(record.created)
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(secs))
                    + f".{int((record.created - secs) * 1000):03d}Z",
            "level": record.levelname, "component": self.component, "logger": record.name,
            "event": str(record.msg), "message": record.getMessage(),
            **{name: _safe(v) for name, v in self.context.snapshot().items()},
        }
        args = record.args
        if isinstance(args, Mapping):
            line["args"] = {str(k): _safe(v) for k, v in args.items()}
        else:
            line["args"] = [_safe(v) for v in (args or ())]
        for name, value in vars(record).items():
            if name not in _RECORD_FIELDS:
                line[f"extra_{name}" if name in _OWN_KEYS else name] = _safe(value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, allow_nan=False)


def configure_logging(fmt: LogFormat | str, *, level: int, component: str, text_format: str) -> None:
    """Configure the root logger as :func:`logging.basicConfig` does (nothing when it has handlers already).

    ``text``: stderr lines of ``text_format``, as before; ``json``: a
    :class:`JsonFormatter` for ``component``. A bad ``fmt`` is a ValueError.
    """
    fmt = LogFormat.parse(fmt)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component) if fmt is LogFormat.JSON else logging.Formatter(text_format))
    logging.basicConfig(level=level, handlers=[handler])


def current_format() -> LogFormat:
    """The format this process's root logger writes (JSON when one of its handlers has a JsonFormatter).

    What a process it starts inherits, as it inherits the log level.
    """
    json_handler = any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)
    return LogFormat.JSON if json_handler else LogFormat.TEXT


def add_log_format_argument(parser: Any, *, defaults_in_help: bool = False) -> None:
    """Add ``--log-format {text,json}`` (default text); ``defaults_in_help`` writes the default into its help."""
    parser.add_argument("--log-format", default=LogFormat.TEXT.value, choices=[f.value for f in LogFormat],
                        help="text: the usual log lines; json: one JSON object per line (time, level, component, "
                             "logger, event, message, run, round, device, args), for a log shipper"
                             + (" (default: %(default)s)" if defaults_in_help else ""))
