"""A device in service mode: run announcements, what a new run drops, leave, refusals, its temp folder."""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile

import numpy as np

from edge_sdk.client import EdgeClient
from edge_sdk.client.cli import private_tmp
from edge_sdk.client.link import SERVER_STATUS, VIA
from edge_sdk.models.held_models import HeldModel
from edge_sdk.protocol import SERVER_ID, Kind, Message, Topics
from edge_sdk.protocol.commands import Op, build
from edge_sdk.transport import MemoryBroker, MemoryTransport
from edge_sdk.worker import LocalWorker

FED = "svc"


def _device(stay: bool = True) -> EdgeClient:
    rng = np.random.default_rng(0)
    w = LocalWorker("c1", rng.random((20, 8, 8), dtype=np.float32), np.arange(20) % 10,
                    architecture="digits_cnn_1x8x8_10", seed=0)
    return EdgeClient(MemoryTransport(MemoryBroker(), "c1", federation=FED), w, federation=FED, stay=stay)


def _status(state: str, run: str | None) -> Message:
    meta = {"state": state, **({"run": run} if run else {}), VIA: SERVER_STATUS}
    return Message(Kind.STATUS, FED, SERVER_ID, 0, meta)


def _cmd(op: Op, **fields) -> Message:
    return Message(Kind.CMD, FED, SERVER_ID, 0, {**build(op, **fields), VIA: "broadcast"})


def _give_encoder(ec: EdgeClient) -> None:
    body = b"onnx bytes"
    sha = hashlib.sha256(body).hexdigest()
    entry = {"file": "fedae.onnx", "sha256": sha, "role": "encoder", "input_shape": [64], "latent_dim": 20}
    ec.link.on_model(Topics("fedsketch", FED).model("encoder"),
                 Message(Kind.MODEL, FED, SERVER_ID, 0, {"key": "encoder", "name": "fedae", "sha256": sha,
                                                         "entry": entry}, body))


def test_a_new_run_drops_what_the_last_one_left_and_says_hello(caplog):
    ec = _device()
    ec.transport.connect()
    assert ec.handle(_status("online", "run-1"))
    assert ec.run_id == "run-1" and ec.hello_due is not None
    ec.hello()
    ec.state.welcomed, ec.model_key = True, "c0"
    ec.store.put("c0", HeldModel(3, {"w": np.zeros(2, np.float32)}))
    _give_encoder(ec)
    folder = ec.encoder_dirs["fedae"]
    assert (folder / "fedae.onnx").is_file()
    # the same run again (the broker's retained copy): nothing changes, no hello
    assert ec.handle(_status("online", "run-1"))
    assert ec.model_key == "c0" and ec.hello_due is None and folder.is_dir()
    # the server goes away, then announces another run
    with caplog.at_level(logging.INFO, logger="edge_sdk.client"):
        assert ec.handle(_status("offline", "run-1"))
        assert ec.server_online is False
        assert ec.handle(_status("online", "run-2"))
    assert "the server is away (run run-1); waiting for its next run" in caplog.text
    assert "the server announces run run-2: joining it" in caplog.text
    assert (ec.run_id, ec.runs_seen, ec.server_online) == ("run-2", 2, True)
    assert ec.model_key is None and not ec.state.welcomed and not ec.store.keys() and not ec.encoder_dirs
    assert not folder.exists() and not folder.parent.exists()
    assert ec.hello_due is not None


def test_service_mode_stays_through_stop_failure_and_refusal_and_leaves_on_leave(caplog):
    ec = _device(stay=True)
    assert ec.handle(_cmd(Op.STOP, reason="finished"))
    assert ec.handle(_cmd(Op.STOP, reason="the server could not finish the run", failed=True))
    assert ec.handle(_cmd(Op.REFUSED, reason="too few samples"))
    assert ec.exit_code == 0
    with caplog.at_level(logging.WARNING, logger="edge_sdk.client"):
        assert ec.handle(_cmd(Op.LEAVE, reason="retired")) is False
    assert "the server asked this device to leave the fleet: retired" in caplog.text
    assert ec.exit_code == 0
    one_run = _device(stay=False)
    assert one_run.handle(_cmd(Op.REFUSED, reason="too few samples")) is False and one_run.exit_code == 4
    assert _device(stay=False).handle(_cmd(Op.LEAVE)) is False


def test_a_bad_status_is_refused_and_counted():
    ec = _device()
    assert ec.handle(_status("online", "a/run"))  # not an id: refused, the device keeps serving
    assert ec.run_id is None and ec.rejected == {"meta-field": 1}
    ec.link.on_server_status("fedsketch/svc/server/status", Message(Kind.STATUS, FED, "c9", 0, {"state": "online"}))
    assert ec.rejected == {"meta-field": 1, "sender": 1}


def test_closing_removes_the_received_encoders():
    ec = _device()
    ec.transport.connect()
    _give_encoder(ec)
    folder = ec.encoder_dirs["fedae"]
    ec.close()
    assert not folder.exists() and not folder.parent.exists()


def test_the_process_works_in_a_private_temp_folder_removed_at_exit():
    outer = tempfile.gettempdir()
    with private_tmp("c/1") as folder:
        assert folder.name.startswith("fedsketch-c_1-") and folder.parent == type(folder)(outer)
        assert tempfile.gettempdir() == str(folder) == os.environ["TMPDIR"]
        (folder / ".ses").write_text("a library's file")
    assert not folder.exists() and tempfile.gettempdir() == outer
