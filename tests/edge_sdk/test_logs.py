"""``--log-format json``: one JSON object per log line, with the run, the round and the device when known."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re

import pytest

from edge_sdk.logs import JsonFormatter, LogFormat, configure_logging, current_format, log_context

ISO_MS = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


@pytest.fixture(autouse=True)
def _fresh_context():
    log_context.clear()
    yield
    log_context.clear()


@contextlib.contextmanager
def bare_root():
    """The root logger without pytest's handlers (configure_logging, like basicConfig, leaves a configured one
    alone); pytest adds them as the test's body starts, so this is entered in the body."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    for h in saved:
        root.removeHandler(h)
    try:
        yield root
    finally:
        for h in root.handlers[:]:
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)


def _json_logger(component: str = "server") -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter(component))
    logger = logging.getLogger(f"test.logs.{component}")
    logger.handlers[:] = [handler]
    logger.propagate, logger.level = False, logging.DEBUG
    return logger, out


def _strict(text: str) -> dict:
    """One line parsed as strict JSON (NaN, Infinity refused)."""
    assert text.endswith("\n") and text.count("\n") == 1, text
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


def test_a_json_line_holds_the_context_the_template_the_args_and_the_extra_fields():
    logger, out = _json_logger()
    log_context.set(run="r-42", round=3, device="d7")
    logger.info("round %d: %d update(s) from %s, %s", 3, 12, "d7", {"c0"}, extra={"model_key": "c0"})
    line = _strict(out.getvalue())
    assert re.fullmatch(ISO_MS, line.pop("time"))
    assert line == {"level": "INFO", "component": "server", "logger": "test.logs.server",
                    "event": "round %d: %d update(s) from %s, %s", "message": "round 3: 12 update(s) from d7, {'c0'}",
                    "run": "r-42", "round": 3, "device": "d7", "args": [3, 12, "d7", "{'c0'}"], "model_key": "c0"}
    out.truncate(0)
    out.seek(0)
    log_context.clear("round", "device")
    logger.warning("two\nlines", extra={"device": "d9"})  # a caller's device wins; the newline stays escaped
    line = _strict(out.getvalue())
    assert (line["run"], line["device"], "round" in line, line["message"], line["args"]) == ("r-42", "d9", False,
                                                                                             "two\nlines", [])


def test_an_exception_goes_in_exc_and_a_non_finite_float_is_null():
    logger, out = _json_logger("device")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logger.exception("training failed after %s s, loss %s, best %s", 1.5, float("nan"), float("-inf"))
    line = _strict(out.getvalue())
    assert line["args"] == [1.5, None, None]
    assert line["message"] == "training failed after 1.5 s, loss nan, best -inf"
    assert line["level"] == "ERROR" and line["component"] == "device"
    assert line["exc"].startswith("Traceback (most recent call last):")
    assert line["exc"].endswith("ZeroDivisionError: boom")


def test_log_context_refuses_unknown_fields_and_forgets_a_none():
    log_context.set(run="r-1", round=2)
    log_context.set(round=None)
    assert log_context.snapshot() == {"run": "r-1"}
    with pytest.raises(ValueError, match=r"log context fields must be among \['run', 'round', 'device'\], got \['rnd'\]"):
        log_context.set(rnd=1)
    with pytest.raises(ValueError, match="log format must be one of"):
        configure_logging("xml", level=logging.INFO, component="server", text_format="%(message)s")


def test_text_format_is_unchanged(capsys):
    with bare_root():
        configure_logging("text", level=logging.INFO, component="device",
                          text_format="%(asctime)s d7 %(levelname)s %(name)s: %(message)s")
        log_context.set(run="r-1")
        logging.getLogger("edge_sdk.client").info("round %d: trained", 2)
        logging.getLogger("edge_sdk.client").debug("not shown")
        assert current_format() is LogFormat.TEXT
    err = capsys.readouterr().err
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} d7 INFO edge_sdk.client: round 2: trained\n", err), err


def test_server_json_keeps_its_paho_filter_and_the_ingest_workers_inherit_json(capsys):
    from edge_sdk.transport import BrokerConfig
    from server_kit.cli import PAHO_LOGGER, _configure_logging, _PahoNotConnected
    from server_kit.partials.ingest import IngestWorkers

    paho = logging.getLogger(PAHO_LOGGER)
    level = paho.level
    paho.setLevel(logging.NOTSET)
    try:
        with bare_root():
            _configure_logging(0, "json")
            paho.error("Client is not connected. Socket: None).")
            logging.getLogger("server_kit.drivers.orchestrator").info("run %s: %d device(s)", "r-9", 4)
            assert current_format() is LogFormat.JSON
            spec = IngestWorkers(2, BrokerConfig.from_url("mqtt://127.0.0.1:1883"), "fed")._specs[1]
        [line] = [_strict(t + "\n") for t in capsys.readouterr().err.splitlines()]
        assert (line["component"], line["logger"], line["args"]) == ("server", "server_kit.drivers.orchestrator",
                                                                    ["r-9", 4])
        assert (spec.log_format, spec.log_level) == ("json", logging.INFO)
    finally:
        paho.setLevel(level)
        for f in [f for f in paho.filters if isinstance(f, _PahoNotConnected)]:
            paho.removeFilter(f)


def test_the_server_sets_the_run_when_it_announces_it_and_the_round_when_it_changes():
    from edge_sdk.protocol import Topics
    from edge_sdk.transport.memory import MemoryBroker, MemoryTransport
    from server_kit.drivers.link import ServerLink
    from server_kit.drivers.phase import Phase, RunPhase

    transport = MemoryTransport(MemoryBroker(), "server", federation="fed")
    transport.connect()
    link = ServerLink(transport, Topics("fedsketch", "fed"), "fed", handler=lambda t, m: None,
                      rejections=lambda *a: None)
    link.announce("r-7")
    phase = RunPhase()
    phase.enter(Phase.TRAIN, rnd=1)
    assert log_context.snapshot() == {"run": "r-7", "round": 1}
    phase.begin_round(2)
    link.announce("r-7", online=False)
    assert log_context.snapshot() == {"run": "r-7", "round": 2}


@pytest.mark.parametrize("module", ["server_kit.cli", "edge_sdk.client.cli", "server_kit.partials.cli"])
def test_a_bad_log_format_is_refused_by_argparse(module, capsys):
    import importlib

    cli = importlib.import_module(module)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--log-format", "xml"])
    assert exc.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert re.fullmatch(r"fedsketch-\w+: error: argument --log-format: invalid choice: 'xml' \(choose from .+\)",
                        last), last


def test_a_device_sets_the_run_it_joins_or_is_welcomed_to_and_the_round_it_trains():
    import numpy as np

    from edge_sdk.client import EdgeClient
    from edge_sdk.client.link import SERVER_STATUS, VIA
    from edge_sdk.protocol import SERVER_ID, Kind, Message
    from edge_sdk.protocol.commands import Op, build
    from edge_sdk.transport import MemoryBroker, MemoryTransport
    from edge_sdk.worker import LocalWorker

    from helpers import ARCH

    w = LocalWorker("c1", np.zeros((12, 8, 8), np.float32), np.arange(12) % 10, architecture=ARCH)
    ec = EdgeClient(MemoryTransport(MemoryBroker(), "c1", federation="fed"), w, federation="fed",
                    model_timeout_s=0.01)
    ec.transport.connect()
    log_context.set(round=9)
    ec.handle(Message(Kind.STATUS, "fed", SERVER_ID, 0, {"state": "online", "run": "r-2", VIA: SERVER_STATUS}))
    assert log_context.snapshot() == {"run": "r-2"}  # a new run: the last one's round is forgotten
    ec.handle(Message(Kind.CMD, "fed", SERVER_ID, 0, {**build(Op.WELCOME, architecture=ARCH, run="r-3"),
                                                      VIA: "broadcast"}))
    ec.handle(Message(Kind.CMD, "fed", SERVER_ID, 4, {**build(Op.TRAIN, round=4, architecture=ARCH, models=["c0"]),
                                                      VIA: "cmd"}))  # no model comes: refused, its round known
    assert log_context.snapshot() == {"run": "r-3", "round": 4}
