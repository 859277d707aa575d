"""Devices in service mode serve run after run, across a server crash, with nothing left behind.

Four ``fedsketch-client --serve`` processes (two rotation groups of the
digits, the server's public key) over Mosquitto; ``fedsketch-server``
processes one after the other: two runs, a run killed (SIGKILL) as it
clusters, and a run after the restart. No device is restarted or told
anything by hand. Forged announcements and leaves (unsigned) are ignored,
and the signed ``fedsketch-server --leave all`` ends every device with 0.
"""

from __future__ import annotations

import re
import time

import pytest

from edge_sdk.protocol import SERVER_ID, Kind, Message, Topics
from edge_sdk.protocol.commands import Op, build
from edge_sdk.signing import write_keypair
from server_kit import cli
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.service_fleet import (
    run_server,
    start_service_devices,
    stop_devices,
    write_rotated_digits,
)

from helpers import ari_against

FED = "svc"
N = 4
pytestmark = pytest.mark.skipif(find_mosquitto() is None, reason="needs the mosquitto binary")


def _forge(broker_url: str, topic: str, meta: dict, kind: Kind = Kind.STATUS, retain: bool = False) -> None:
    """An intruder without the server's key publishes as 'server' (no signature)."""
    from edge_sdk.transport import BrokerConfig, MqttTransport

    t = MqttTransport(BrokerConfig.from_url(broker_url), "intruder", federation=FED)
    t.connect()
    t.publish(topic, Message(kind, FED, SERVER_ID, 0, meta), retain=retain, wait=True)
    t.close()


def _wait_for(pred, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_service_devices_serve_runs_and_a_restart_after_a_crash(tmp_path):
    key, pub = tmp_path / "server.key", tmp_path / "server.pub"
    write_keypair(key, pub)
    data = write_rotated_digits(tmp_path / "data", N, groups=2)
    truth = {f"c{i:02d}": i % 2 for i in range(N)}
    topics = Topics("fedsketch", FED)
    with MosquittoBroker() as broker:
        devices = start_service_devices(broker.url, data, tmp_path / "devices", federation=FED,
                                        server_key=str(pub))
        try:
            runs = []
            for i in range(2):
                runs.append(run_server(broker.url, tmp_path / f"run{i}", federation=FED, min_clients=N,
                                       signing_key=str(key)))
            crashed = run_server(broker.url, tmp_path / "crash", federation=FED, min_clients=N,
                                 signing_key=str(key), kill_when="registration closed")
            # an intruder's announcements and leave, unsigned: ignored by every device
            _forge(broker.url, topics.server_status(), {"state": "online", "run": "forged-run"})
            _forge(broker.url, topics.broadcast(), build(Op.LEAVE, reason="forged"), kind=Kind.CMD)
            runs.append(run_server(broker.url, tmp_path / "restart", federation=FED, min_clients=N,
                                   signing_key=str(key)))
            assert all(d.proc.poll() is None for d in devices), "a device left before it was told to"
            rss = [d.rss_kib() for d in devices]
            assert cli.main(["--broker", broker.url, "--federation", FED, "--signing-key", str(key),
                             "--leave", "all"]) == 0
            assert _wait_for(lambda: all(d.proc.poll() is not None for d in devices))
            codes = [d.proc.returncode for d in devices]
        finally:
            stop_devices(devices)
        logs = {d.cid: d.log() for d in devices}

    assert crashed.killed and crashed.results is None
    for r in runs:
        assert r.rc == 0, r.log[-2000:]
        assert sorted(r.results["assignment"]) == sorted(truth)
        assert ari_against(truth, r.results["assignment"]) == 1.0
    run_ids = [r.results["run_id"] for r in runs]
    assert len(set(run_ids)) == 3
    assert codes == [0] * N  # the signed leave; the forged one changed nothing
    for cid, text in logs.items():
        joined = re.findall(r"the server announces run (\S+): joining it", text)
        # every run, the crashed one included, each once; never the forged one. The first announcement is not
        # retained: a device still subscribing when it went out joins the first run by the server's hello request
        first = run_ids[0] in joined
        assert [j for j in joined if j in run_ids] == run_ids[0 if first else 1:2] + [run_ids[2]], (cid, joined)
        assert len(joined) == 3 + first and "forged-run" not in joined, (cid, joined)
        assert "the server is away" in text  # the crashed server's last will (signed at its connection)
        assert "unsigned" in text  # the forgeries, counted as refusals
        assert "asked this device to leave the fleet: the fleet's owner retired this device" in text
        assert "Traceback" not in text
    assert all(r > 0 for r in rss)
    assert [d.files() for d in devices] == [[]] * N  # nothing left in the devices' temporary folders
