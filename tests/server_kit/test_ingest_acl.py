"""Any number of ingest workers on the shipped deployment, or a refusal at the start that names the user and topic.

A real Mosquitto with deploy/mosquitto.conf, the ACL deploy/make_acl.py writes (the shipped deploy/acl is its
default output) and a password per user; W real worker processes, worker p on partition p of the update topics.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_sdk.transport import BrokerConfig
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.partials import IngestRefused, IngestWorkers

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.broker, pytest.mark.slow,
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")]


def _module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def make_acl():
    return _module(ROOT / "deploy" / "make_acl.py", "fedsketch_make_acl")


def test_the_shipped_acl_is_what_make_acl_writes_and_names_eight_workers(make_acl):
    shipped = (ROOT / "deploy" / "acl").read_text()
    assert shipped == make_acl.render(["default"])
    for i in range(8):
        assert (f"user server-ingest-{i}\ntopic read fedsketch/default/clients/+/update/{i}\n"
                f"topic read fedsketch/default/aggregation/cmd\n"
                f"topic write fedsketch/default/aggregators/ingest-{i}/#\n") in shipped
    assert "server-ingest-8" not in shipped
    assert "user server-ingest-11\ntopic read fedsketch/lab/clients/+/update/11\n" in make_acl.render(
        ["lab"], workers=12)


def test_three_and_four_workers_lose_nothing_on_the_shipped_files():
    """The benchmark's own rounds (deploy/mosquitto.conf, deploy/acl, a password per user): every update summed."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale_out.py"), "--workers", "3,4",
                          "--devices", "12", "--params", "50000", "--site-devices", "0", "--timeout", "60"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ingest_lost"] == 0 and summary["ingest_lost_by_workers"] == {"3": 0, "4": 0}
    assert summary["ingest_asked"] == {"3": 12, "4": 12}
    assert all(summary["ingest_updates_per_s"][w] > 0 for w in ("3", "4"))
    cores = summary["cores"]
    assert summary["worker_threads"] == {w: max(1, min(2, cores // (int(w) + 1))) for w in ("3", "4")}
    assert "the devices' process 1" in out.stderr


def _broker(acl: str, workers: int, with_users: int):
    fed = "probe"
    logins = {"server": "pw-server"} | {f"server-ingest-{i}": "pw-server" for i in range(with_users)}
    return fed, logins, MosquittoBroker(deploy_conf=True, passwords=logins,
                                        acl=acl.replace("fedsketch/default/", f"fedsketch/{fed}/"))


def test_a_worker_the_acl_does_not_name_stops_the_start_naming_its_user_and_topic(make_acl):
    fed, logins, broker = _broker(make_acl.render(["default"], workers=2), 3, 3)
    with broker:
        pool = IngestWorkers(3, BrokerConfig.from_url(broker.url, username="server", password="pw-server"), fed)
        t0 = time.monotonic()
        with pytest.raises(IngestRefused) as e:
            pool.start(probe_timeout=3.0)
        waited = time.monotonic() - t0
        assert not any(pool.alive(aid) for aid in pool.ids)  # stopped
    said = str(e.value)
    assert said.startswith("ingest worker ingest-2 (broker user server-ingest-2) did not answer a probe on "
                           f"fedsketch/{fed}/clients/probe-ingest-2/update/2 within 3 s: the broker must let it "
                           f"read fedsketch/{fed}/clients/+/update/2 and write fedsketch/{fed}/aggregators/ingest-2/#")
    assert "ingest-0 (" not in said and "ingest-1 (" not in said
    assert said.endswith("deploy/make_acl.py --ingest-workers 3 (a NATS cluster: deploy/nats/make_users.py "
                         "--ingest-workers 3)")
    assert waited < 30


def test_a_worker_the_broker_does_not_know_stops_the_start(make_acl):
    fed, logins, broker = _broker(make_acl.render(["default"]), 2, 1)  # no user server-ingest-1
    with broker:
        pool = IngestWorkers(2, BrokerConfig.from_url(broker.url, username="server", password="pw-server"), fed)
        with pytest.raises(IngestRefused, match=r"^ingest worker ingest-1 \(broker user server-ingest-1\) exited "
                                                r"with code \d+ before it subscribed"):
            pool.start(timeout=30)
        assert not any(pool.alive(aid) for aid in pool.ids)
