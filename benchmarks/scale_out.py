"""Scaling out past one server process and one uplink: ingest workers, and a site aggregator's uplink.

Questions:

1. **Ingest workers.** How many large updates per second does the server side
   take in with W = 1, 2, 3 and 4 ingest workers (``--workers``; ``fedsketch-server
   --ingest-workers W``)? A real Mosquitto on a free port with the shipped
   limits, ACL and a password per user; W real worker processes
   (:class:`server_kit.partials.IngestWorkers`), worker p on partition p of
   the update topics; ``--devices`` (40) real MQTT connections, in a process
   of their own, each with one update of a ResNet-18-sized model (11.7 M
   float32 parameters, 46.8 MB; chunked at the shipped 1 MB packets),
   announced and sent when this process, the coordinator, asks for it by the
   server's rule (:class:`server_kit.rounds.reask.Reasks`: at most 256 MB on
   their way to one worker; again after a delay when a worker had no room or
   got it cut). Timed from the first request to the last partial sum, i.e.
   every update received, reassembled, decoded, checked, norm measured,
   receipted, then summed. Before a rate is reported, every device's update
   is checked to be in a partial sum (by device id) and every partial sum to
   be the exact mean of its members' updates; an update refused or lost is
   counted (``ingest_lost``) and named, and the run then reports no rate.
   Measured beside it: the coordinator's CPU per update (``getrusage``) and
   each worker's (``/proc``), and so what one worker takes alone, and each
   worker's peak memory. The devices and the broker run on the same machine:
   on 2 cores they take CPU the workers would use. Each worker's peak memory is
   checked against its configured bound (:func:`memory_bound`: its memory
   before the round, plus ``hold_memory_bytes``, plus ``transfer_budget_bytes``,
   plus three updates' size: the model, one update reassembled, one decoded).
2. **A site's uplink.** A site of ``--site-devices`` devices (LeNet-5-sized
   updates, 61,706 parameters) behind one uplink: the bytes its devices
   publish (flat: what the bridge would carry to the core) over the bytes a
   site aggregator sends the core for them (a receipt per update and one
   partial sum per model). Measured on the wire, one round, with the site's
   devices in 1 and in 2 clusters.

Every process sizes its thread pools as the server would (:mod:`server_kit.cores`): each worker its share of
the cores, the coordinator what they leave, the devices' process one thread; the table says how many.

Prints a table and ends with one JSON line, per worker count W where a key is a mapping: ``ingest_lost`` (updates
not summed, over every W: 0 or no rate is reported), ``ingest_lost_by_workers``, ``ingest_updates_per_s`` and
``ingest_speedup`` (over W = 1; None for a run that lost an update), ``worker_threads``,
``coordinator_threads``, ``cores``, ``worker_cpu_s_per_update`` (the workers' CPU seconds per update),
``ingest_asked`` and ``ingest_asked_again``, ``coordinator_cpu_share`` (its CPU per update over the workers'),
``worker_alone_updates_per_s``, ``worker_peak_rss_mb``, ``worker_memory_bound_mb``, ``worker_within_bound``,
``site_uplink_bytes_ratio`` (1 cluster), ``site_uplink_bytes_ratio_2_clusters`` (None with ``--site-devices 0``).

Run: ``.venv/bin/python benchmarks/scale_out.py`` (about 5 minutes on 2 cores;
``--quick``: 6 devices of a 2 M-parameter model through 1 and 2 workers, and a site of 10, about 20 s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.protocol import BUSY, Kind, Message, parse_tensors, partition_of, tensors_body
from edge_sdk.signing import Signer, Verifier, generate_key
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import MosquittoBroker
from server_kit.cores import Role, available_cores, limit_threads, plan
from server_kit.drivers import ServerConfig
from server_kit.partials import IngestWorkers, PartialAggregator
from server_kit.rounds.reask import Reasks, ReaskWhy

FED = "scale"
#: The server's default bytes of announced updates on their way to one receiver.
BUDGET = ServerConfig().transfer_budget_bytes
HOLD = ServerConfig().hold_memory_bytes
ROOT = Path(__file__).resolve().parents[1]
RESNET18_PARAMS = 11_689_512
LENET5_PARAMS = 61_706


def _model(params: int, seed: int = 0) -> dict[str, np.ndarray]:
    """A model of ``params`` float32 parameters in 16 tensors (the bytes and the work of a real one)."""
    rng = np.random.default_rng(seed)
    sizes = [params // 16] * 15 + [params - 15 * (params // 16)]
    return {f"layer{i:02d}.weight": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}


class _Counter:
    """The server's end: counts receipts and partial sums as they arrive."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.receipts: dict[str, str] = {}
        #: The updates an aggregator refused, with its reason (their receipts say so).
        self.refused: dict[str, str] = {}
        self.partials: list[Message] = []
        #: The devices a worker had no room for (asked again), in order.
        self.busy: list[str] = []

    def __call__(self, topic: str, msg: Message) -> None:
        with self.cond:
            if msg.kind == Kind.RECEIPT and msg.meta.get("refused") == BUSY:
                self.busy.append(msg.meta["client"])
            elif msg.kind == Kind.RECEIPT:
                self.receipts[msg.meta["client"]] = msg.sender
                if msg.meta.get("refused"):
                    self.refused[msg.meta["client"]] = msg.meta["refused"]
            elif msg.kind == Kind.PARTIAL:
                self.partials.append(msg)
            self.cond.notify_all()

    def wait(self, test: Any, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(test, timeout)


def _login(url: str, user: str, logins: dict[str, str] | None) -> BrokerConfig:
    """``user``'s broker config (with its password when the broker has ``logins``)."""
    if logins is None:
        return BrokerConfig.from_url(url)
    return BrokerConfig.from_url(url, username=user, password=logins[user])


def _shipped(n_devices: int, workers: int) -> dict[str, Any]:
    """The shipped broker: deploy/mosquitto.conf's limits, deploy/acl (for this federation), every user's password."""
    logins = {f"d{i:03d}": f"pw-d{i:03d}" for i in range(n_devices)} | {"server": "pw-server"}
    logins |= {f"server-ingest-{i}": "pw-server" for i in range(workers)}
    acl = (ROOT / "deploy" / "acl").read_text().replace("fedsketch/default/", f"fedsketch/{FED}/")
    return {"deploy_conf": True, "passwords": logins, "acl": acl}


def _server(url: str, verifiers: dict[str, Verifier], counter: _Counter,
            logins: dict[str, str] | None = None) -> MqttTransport:
    server = MqttTransport(_login(url, "server", logins), "server", federation=FED)
    server.accept_aggregators(verifiers)
    for leaf in ("receipt", "partial"):
        server.subscribe(server.topics.aggregator("+", leaf), counter)
    server.connect(timeout=10)
    return server


def _devices(url: str, n: int, logins: dict[str, str] | None = None) -> list[MqttTransport]:
    out = []
    for i in range(n):
        t = MqttTransport(_login(url, f"d{i:03d}", logins), f"d{i:03d}", federation=FED)
        t.connect(timeout=10)
        out.append(t)
    return out


def _update(t: MqttTransport, body: bytes, key: str, *, partition: int | None = None) -> None:
    t.publish(t.topics.update(t.client_id, partition), Message(Kind.UPDATE, FED, t.client_id, 1,
                                                    {"round": 1, "model_key": key, "n_samples": 100,
                                                     "metrics": {}}, body))


def _round(server: MqttTransport, counter: _Counter, devices: list[MqttTransport], bodies: list[bytes],
           keys: list[str], timeout: float) -> float:
    """Publish every device's update, wait for the receipts, flush, wait for the partial sums; seconds."""
    t0 = time.perf_counter()
    threads = [threading.Thread(target=_update, args=(d, b, k)) for d, b, k in zip(devices, bodies, keys)]
    for th in threads:
        th.start()
    if not counter.wait(lambda: len(counter.receipts) == len(devices), timeout):
        raise TimeoutError(f"{len(counter.receipts)} of {len(devices)} receipts in {timeout:g} s")
    by_aid: dict[str, dict[str, list]] = {}
    for cid, aid in counter.receipts.items():
        by_aid.setdefault(aid, {})[cid] = [100, 1.0]
    expected = sum(len({keys[int(c[1:])] for c in members}) for members in by_aid.values())
    for aid, members in sorted(by_aid.items()):
        server.publish(server.topics.aggregation(), Message(Kind.FLUSH, FED, "server", 1,
                                                            {"round": 1, "aggregator": aid, "members": members}))
    if not counter.wait(lambda: len(counter.partials) == expected, timeout):
        raise TimeoutError(f"{len(counter.partials)} of {expected} partial sums in {timeout:g} s")
    for th in threads:
        th.join()
    return time.perf_counter() - t0


def summed(counter: _Counter, model: dict[str, np.ndarray], offsets: dict[str, float]) -> tuple[list[str], int]:
    """The devices whose update no partial sum carries, and how many partial sums are not their members' mean.

    Device ``d``'s update is ``model + offsets[d]`` (100 samples each): a
    partial sum must equal ``model`` plus the mean of its members' offsets.
    """
    carried: set[str] = set()
    wrong = 0
    spec = {k: (v.shape, "float32") for k, v in model.items()}
    for p in counter.partials:
        members = list(p.meta["members"])
        carried.update(members)
        got = parse_tensors(p.body, spec=spec)
        shift = np.float32(np.mean([offsets[c] for c in members]))
        if any(not np.allclose(got[k], v + shift, atol=1e-5) for k, v in model.items()):
            wrong += 1
    return sorted(set(offsets) - carried), wrong


def _collect(server: MqttTransport, model: dict[str, np.ndarray], keys: set[str]) -> None:
    for key in sorted(keys):
        server.publish(server.topics.aggregation(), Message(Kind.COLLECT, FED, "server", 1,
                                                            {"round": 1, "model_key": key}, tensors_body(model)),
                       wait=True)


def _offsets(n_devices: int) -> dict[str, float]:
    return {f"d{i:03d}": 0.01 * (i + 1) for i in range(n_devices)}


def _publisher(url: str, n_devices: int, params: int, workers: int, logins: dict[str, str], conn: Any) -> None:
    """The devices, in a process of their own: publish the updates asked for (``conn``), each on its partition."""
    limit_threads(plan(Role.EMULATOR))
    model = _model(params)
    offsets = _offsets(n_devices)
    bodies = {cid: tensors_body({k: v + np.float32(off) for k, v in model.items()}) for cid, off in offsets.items()}
    devices = {t.client_id: t for t in _devices(url, n_devices, logins)}
    conn.send({cid: len(b) for cid, b in bodies.items()})  # every update announced: ready, with its size
    while (cids := conn.recv()) is not None:
        threads = [threading.Thread(target=_update, args=(devices[c], bodies[c], "c0"),
                                    kwargs={"partition": partition_of(c, workers)}) for c in cids]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        conn.send(cids)  # "sent" (a device's status says so)
    for t in devices.values():
        t.close()


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system, from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _peak_rss(pid: int, field: str = "VmHWM") -> int:
    """A process's peak resident memory so far (bytes, VmHWM; ``field="VmRSS"``: its resident memory now)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_bound(start_rss: int, update_bytes: int) -> int:
    """A worker's configured memory bound (bytes): its memory before the round, the updates it may hold in memory
    (``hold_memory_bytes``), the announced updates on their way to it (``transfer_budget_bytes``), and the round's
    model, one update reassembled and that update decoded."""
    return start_rss + HOLD + BUDGET + 3 * update_bytes


def _own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def ingest(workers: int, n_devices: int, params: int, timeout: float) -> dict[str, Any]:
    """One round of ``n_devices`` updates through ``workers`` ingest workers, each on its partition of the updates.

    This process is the coordinator (it takes receipts, asks again for the updates a worker had no room for, by
    :class:`server_kit.rounds.reask.Reasks`, flushes and takes the partial sums); the devices publish from a
    process of their own. Returns the seconds, the rate, the updates lost, the CPU seconds of the coordinator and
    of each worker, each worker's peak memory.
    """
    model = _model(params)
    offsets = _offsets(n_devices)
    ctx = mp.get_context("spawn")
    coordinator = limit_threads(plan(Role.COORDINATOR, workers=workers))
    shipped = _shipped(n_devices, workers)
    logins = shipped["passwords"]
    with MosquittoBroker(**shipped) as broker:  # the shipped limits (queues, packets) and ACL
        pool = IngestWorkers(workers, _login(broker.url, "server", logins), FED)
        counter = _Counter()
        here, there = ctx.Pipe()
        devices = ctx.Process(target=_publisher, args=(broker.url, n_devices, params, workers, logins, there),
                              daemon=True)
        devices.start()
        try:
            server = _server(broker.url, pool.start(), counter, logins)
            start_rss = {aid: _peak_rss(pool.pid(aid), "VmRSS") for aid in pool.ids}
            sizes = here.recv()  # the devices are connected, their updates made and announced
            nbytes = sum(sizes.values())
            _collect(server, model, {"c0"})
            time.sleep(0.5)  # the workers take the round's model
            pids = {aid: pool.pid(aid) for aid in pool.ids}
            cpu0 = {aid: _cpu_s(pid) for aid, pid in pids.items()}
            own0, t0 = _own_cpu_s(), time.perf_counter()
            reasks = Reasks(1, budget_bytes=BUDGET, receiver_of=lambda cid: partition_of(cid, workers))
            ready = {cid: (1, size) for cid, size in sizes.items()}
            awaited = set(offsets)
            sent: dict[str, tuple[int, float]] = {}
            deadline = time.monotonic() + timeout
            while awaited:
                while here.poll():
                    sent.update({c: (1, time.monotonic()) for c in here.recv()})
                counter.wait(lambda left=frozenset(awaited): bool(counter.busy)
                             or any(c in counter.receipts for c in left), 0.2)
                with counter.cond:
                    busy, counter.busy = counter.busy, []
                    awaited -= set(counter.receipts) - set(counter.refused)
                for cid in busy:
                    reasks.busy(cid)
                due = [cid for cid, _ in reasks.due(awaited, sent, ready)]
                if due:
                    here.send(due)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(awaited)} of {n_devices} updates not receipted in {timeout:g} s")
            by_aid: dict[str, dict[str, list]] = {}
            for cid, aid in counter.receipts.items():
                by_aid.setdefault(aid, {})[cid] = [100, 1.0]
            for aid, members in sorted(by_aid.items()):
                server.publish(server.topics.aggregation(), Message(Kind.FLUSH, FED, "server", 1,
                                                                    {"round": 1, "aggregator": aid,
                                                                     "members": members}))
            if not counter.wait(lambda: len(counter.partials) == len(by_aid), timeout):
                raise TimeoutError(f"{len(counter.partials)} of {len(by_aid)} partial sums in {timeout:g} s")
            seconds = time.perf_counter() - t0
            own = _own_cpu_s() - own0
            cpu = {aid: round(_cpu_s(pid) - cpu0[aid], 2) for aid, pid in pids.items()}
            peak = {aid: _peak_rss(pid) for aid, pid in pids.items()}
            here.send(None)
            while here.poll(1.0):
                here.recv()
            devices.join(30)
        finally:
            pool.stop()
            if devices.is_alive():
                devices.kill()
        server.close()
    mb = nbytes / 1e6
    lost, wrong = summed(counter, model, offsets)
    if wrong:
        raise RuntimeError(f"{wrong} partial sum(s) are not the mean of their members' updates")
    if lost:
        print(f"W = {workers}: {len(lost)} of {n_devices} updates not summed ({', '.join(lost[:8])}"
              f"{' ...' if len(lost) > 8 else ''}); refused by the workers: "
              f"{sorted(set(counter.refused.values())) or 'none'}: no rate is reported", file=sys.stderr)
    ok = not lost
    per_worker = {aid: sum(1 for a in counter.receipts.values() if a == aid) for aid in pids}
    worker_cpu_per_update = sum(cpu.values()) / max(1, n_devices)
    return {"workers": workers, "worker_threads": pool.threads.threads, "coordinator_threads": coordinator.threads,
            "devices": n_devices, "mb": round(mb, 1), "seconds": round(seconds, 3),
            "lost": len(lost), "updates_per_s": round(n_devices / seconds, 3) if ok else None,
            "mb_per_s": round(mb / seconds, 1) if ok else None, "partials": len(counter.partials),
            "asked": reasks.asked.get(ReaskWhy.GO, 0),
            "asked_again": sum(n for why, n in reasks.asked.items() if why is not ReaskWhy.GO),
            "coordinator_cpu_s": round(own, 3),
            "coordinator_cpu_ms_per_update": round(1000 * own / n_devices, 2),
            "worker_cpu_s": cpu, "worker_updates": per_worker,
            "worker_cpu_ms_per_update": round(1000 * worker_cpu_per_update, 1),
            "worker_alone_updates_per_s": {aid: round(per_worker[aid] / cpu[aid], 2) if cpu[aid] else None
                                           for aid in pids},
            "worker_peak_rss_mb": {aid: round(b / 1e6) for aid, b in peak.items()},
            "worker_memory_bound_mb": {aid: round(memory_bound(start_rss[aid], 4 * params) / 1e6) for aid in pids},
            "worker_within_bound": all(peak[aid] <= memory_bound(start_rss[aid], 4 * params) for aid in pids)}


def site(n_devices: int, clusters: int, timeout: float) -> dict[str, Any]:
    """A site's round: bytes its devices publish over the bytes its aggregator sends the core."""
    model = _model(LENET5_PARAMS)
    keys = [f"c{i % clusters}" for i in range(n_devices)]
    bodies = [tensors_body({k: v + np.float32(0.01 * (i + 1)) for k, v in model.items()}) for i in range(n_devices)]
    key = generate_key()
    with MosquittoBroker() as broker:
        counter = _Counter()
        server = _server(broker.url, {"site": Verifier(key.public_key())}, counter)
        at = MqttTransport(BrokerConfig.from_url(broker.url), "site", federation=FED)
        at.sign_with(Signer(key))
        agg = PartialAggregator(at, "site")
        agg.start()
        at.connect(timeout=10)
        devices = _devices(broker.url, n_devices)
        _collect(server, model, set(keys))
        time.sleep(0.5)
        _round(server, counter, devices, bodies, keys, timeout)
        flat = sum(d.stats()["sent"]["UPDATE"]["bytes"] for d in devices)
        sent = at.stats()["sent"]
        aggregated = sum(sent[k]["bytes"] for k in ("RECEIPT", "PARTIAL"))
        for t in (*devices, at, server):
            t.close()
    return {"devices": n_devices, "clusters": clusters, "flat_bytes": flat, "aggregated_bytes": aggregated,
            "ratio": round(flat / aggregated, 2)}


def _workers(text: str) -> list[int]:
    try:
        out = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma-separated list of worker counts, got {text!r}") from None
    if not out or any(not 1 <= w <= 64 for w in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"distinct worker counts in [1, 64], got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 devices of a 2 M-parameter model; a site of 10")
    p.add_argument("--workers", type=_workers, default=None, metavar="W,W,...",
                   help="the ingest worker counts to run, each a round of its own (default: 1,2,3,4; --quick: 1,2)")
    p.add_argument("--devices", type=int, default=40, help="updates per ingest round")
    p.add_argument("--params", type=int, default=RESNET18_PARAMS, help="parameters of the ingested model")
    p.add_argument("--site-devices", type=int, default=50, help="devices of the site's uplink run (0: no site run)")
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.quick:
        args.devices, args.params, args.site_devices = 6, 2_000_000, 10
        args.timeout = min(args.timeout, 120.0)  # a quick run that waits longer is stuck: say so
    if args.workers is None:
        args.workers = [1, 2] if args.quick else [1, 2, 3, 4]
    if args.devices < 1 or args.params < 16 or args.site_devices < 0:
        p.error("--devices must be >= 1, --params >= 16, --site-devices >= 0")
    rows = [ingest(w, args.devices, args.params, args.timeout) for w in args.workers]
    print(f"{'workers':>8} {'threads':>8} {'devices':>8} {'lost':>5} {'asked':>6} {'again':>6} {'MB':>8} "
          f"{'seconds':>8} {'updates/s':>10} {'xW=1':>6} {'MB/s':>8} {'coord ms/upd':>13} {'worker ms/upd':>14}",
          file=sys.stderr)
    base = rows[0]["updates_per_s"] if rows[0]["workers"] == 1 else None
    for r in rows:
        speed = round(r["updates_per_s"] / base, 2) if base and r["updates_per_s"] else None
        r["speedup"] = speed
        print(f"{r['workers']:>8} {r['worker_threads']:>8} {r['devices']:>8} {r['lost']:>5} {r['asked']:>6} "
              f"{r['asked_again']:>6} {r['mb']:>8} {r['seconds']:>8} {str(r['updates_per_s']):>10} {str(speed):>6} "
              f"{str(r['mb_per_s']):>8} {r['coordinator_cpu_ms_per_update']:>13} {r['worker_cpu_ms_per_update']:>14}",
              file=sys.stderr)
        for aid in sorted(r["worker_cpu_s"]):
            print(f"    {aid}: {r['worker_updates'][aid]} updates in {r['worker_cpu_s'][aid]} CPU s "
                  f"({r['worker_alone_updates_per_s'][aid]} updates/s alone), peak memory "
                  f"{r['worker_peak_rss_mb'][aid]} MB (bound {r['worker_memory_bound_mb'][aid]} MB)", file=sys.stderr)
    coordinator = ", ".join(f"{r['coordinator_threads']} with W = {r['workers']}" for r in rows)
    print(f"threads: each ingest worker as the table says (server_kit.cores), the coordinator (this process) "
          f"{coordinator}, the devices' process 1; {available_cores()} cores", file=sys.stderr)
    sites = [site(args.site_devices, k, args.timeout) for k in (1, 2)] if args.site_devices else []
    for s in sites:
        print(f"site of {s['devices']} devices in {s['clusters']} cluster(s): flat {s['flat_bytes']:,} B, "
              f"aggregated {s['aggregated_bytes']:,} B, ratio {s['ratio']}", file=sys.stderr)
    by_w = {str(r["workers"]): r for r in rows}
    out = {"ingest_lost": sum(r["lost"] for r in rows),
           "ingest_lost_by_workers": {w: r["lost"] for w, r in by_w.items()},
           "ingest_updates_per_s": {w: r["updates_per_s"] for w, r in by_w.items()},
           "ingest_speedup": {w: r["speedup"] for w, r in by_w.items()},
           "ingest_devices": args.devices, "ingest_params": args.params, "cores": available_cores(),
           "worker_threads": {w: r["worker_threads"] for w, r in by_w.items()},
           "coordinator_threads": {w: r["coordinator_threads"] for w, r in by_w.items()},
           "worker_cpu_s_per_update": {w: round(r["worker_cpu_ms_per_update"] / 1000, 3) for w, r in by_w.items()},
           "ingest_asked": {w: r["asked"] for w, r in by_w.items()},
           "ingest_asked_again": {w: r["asked_again"] for w, r in by_w.items()},
           "coordinator_cpu_share": {w: round(r["coordinator_cpu_ms_per_update"] / r["worker_cpu_ms_per_update"], 4)
                                     if r["worker_cpu_ms_per_update"] else None for w, r in by_w.items()},
           "worker_alone_updates_per_s": {w: r["worker_alone_updates_per_s"] for w, r in by_w.items()},
           "worker_peak_rss_mb": {w: r["worker_peak_rss_mb"] for w, r in by_w.items()},
           "worker_memory_bound_mb": {w: r["worker_memory_bound_mb"] for w, r in by_w.items()},
           "worker_within_bound": all(r["worker_within_bound"] for r in rows),
           "site_uplink_bytes_ratio": sites[0]["ratio"] if sites else None,
           "site_uplink_bytes_ratio_2_clusters": sites[1]["ratio"] if sites else None,
           "site_devices": args.site_devices}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
