"""Scaling out past one server process and one uplink: ingest workers, and a site aggregator's uplink.

Questions:

1. **Ingest workers.** How many large updates per second does the server side
   take in with W = 1 and W = 2 ingest workers (``fedsketch-server
   --ingest-workers W``)? A real Mosquitto on a free port; W real worker
   processes (:class:`server_kit.partials.IngestWorkers`) on its shared
   subscription; ``--devices`` real MQTT connections publishing one update
   each of a ResNet-18-sized model (11.7 M float32 parameters, 46.8 MB; chunked
   at the shipped 1 MB packets); timed from the first publish to the last
   partial sum at the server, i.e. every update received, reassembled,
   decoded, checked, norm measured, receipted, then summed. Before a rate is
   reported, every device's update is checked to be in a partial sum (by
   device id) and every partial sum to be the exact mean of its members'
   updates; an update refused or lost is counted (``ingest_lost``) and named,
   and the run then reports no rate. The publishers and the broker run on the
   same machine: on 2 cores they take CPU the workers would use.
2. **A site's uplink.** A site of ``--site-devices`` devices (LeNet-5-sized
   updates, 61,706 parameters) behind one uplink: the bytes its devices
   publish (flat: what the bridge would carry to the core) over the bytes a
   site aggregator sends the core for them (a receipt per update and one
   partial sum per model). Measured on the wire, one round, with the site's
   devices in 1 and in 2 clusters.

Prints a table and ends with one JSON line: ``ingest_lost`` (updates not
summed, over both runs: 0 or no rate is reported), ``ingest_updates_per_s_w1``,
``ingest_updates_per_s_w2``, ``ingest_speedup_w2`` (each None when its run
lost an update), ``site_uplink_bytes_ratio`` (1 cluster),
``site_uplink_bytes_ratio_2_clusters``.

Run: ``.venv/bin/python benchmarks/scale_out.py`` (``--quick``: 6 devices
of a 2 M-parameter model and a site of 10, about 20 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import numpy as np

from edge_sdk.protocol import Kind, Message, parse_tensors, tensors_body
from edge_sdk.signing import Signer, Verifier, generate_key
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import MosquittoBroker
from server_kit.partials import IngestWorkers, PartialAggregator

FED = "scale"
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

    def __call__(self, topic: str, msg: Message) -> None:
        with self.cond:
            if msg.kind == Kind.RECEIPT:
                self.receipts[msg.meta["client"]] = msg.sender
                if msg.meta.get("refused"):
                    self.refused[msg.meta["client"]] = msg.meta["refused"]
            elif msg.kind == Kind.PARTIAL:
                self.partials.append(msg)
            self.cond.notify_all()

    def wait(self, test: Any, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(test, timeout)


def _server(url: str, verifiers: dict[str, Verifier], counter: _Counter) -> MqttTransport:
    server = MqttTransport(BrokerConfig.from_url(url), "server", federation=FED)
    server.accept_aggregators(verifiers)
    for leaf in ("receipt", "partial"):
        server.subscribe(server.topics.aggregator("+", leaf), counter)
    server.connect(timeout=10)
    return server


def _devices(url: str, n: int) -> list[MqttTransport]:
    out = []
    for i in range(n):
        t = MqttTransport(BrokerConfig.from_url(url), f"d{i:03d}", federation=FED)
        t.connect(timeout=10)
        out.append(t)
    return out


def _update(t: MqttTransport, body: bytes, key: str) -> None:
    t.publish(t.topics.update(t.client_id), Message(Kind.UPDATE, FED, t.client_id, 1,
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


def ingest(workers: int, n_devices: int, params: int, timeout: float) -> dict[str, Any]:
    """One round of ``n_devices`` updates through ``workers`` ingest workers: seconds and updates per second."""
    model = _model(params)
    offsets = {f"d{i:03d}": 0.01 * (i + 1) for i in range(n_devices)}
    bodies = [tensors_body({k: v + np.float32(offsets[f"d{i:03d}"]) for k, v in model.items()})
              for i in range(n_devices)]
    with MosquittoBroker() as broker:
        pool = IngestWorkers(workers, BrokerConfig.from_url(broker.url), FED)
        counter = _Counter()
        try:
            server = _server(broker.url, pool.start(), counter)
            time.sleep(1.5)  # the workers connect and subscribe
            devices = _devices(broker.url, n_devices)
            _collect(server, model, {"c0"})
            time.sleep(0.5)
            seconds = _round(server, counter, devices, bodies, ["c0"] * n_devices, timeout)
        finally:
            pool.stop()
        for d in devices:
            d.close()
        server.close()
    mb = sum(map(len, bodies)) / 1e6
    lost, wrong = summed(counter, model, offsets)
    if wrong:
        raise RuntimeError(f"{wrong} partial sum(s) are not the mean of their members' updates")
    if lost:
        print(f"W = {workers}: {len(lost)} of {n_devices} updates not summed ({', '.join(lost[:8])}"
              f"{' ...' if len(lost) > 8 else ''}); refused by the workers: "
              f"{sorted(set(counter.refused.values())) or 'none'}: no rate is reported", file=sys.stderr)
    ok = not lost
    return {"workers": workers, "devices": n_devices, "mb": round(mb, 1), "seconds": round(seconds, 3),
            "lost": len(lost), "updates_per_s": round(n_devices / seconds, 3) if ok else None,
            "mb_per_s": round(mb / seconds, 1) if ok else None, "partials": len(counter.partials)}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="6 devices of a 2 M-parameter model; a site of 10")
    p.add_argument("--devices", type=int, default=20, help="updates per ingest round")
    p.add_argument("--params", type=int, default=RESNET18_PARAMS, help="parameters of the ingested model")
    p.add_argument("--site-devices", type=int, default=50)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args(argv)
    if args.quick:
        args.devices, args.params, args.site_devices = 6, 2_000_000, 10
    rows = [ingest(w, args.devices, args.params, args.timeout) for w in (1, 2)]
    print(f"{'workers':>8} {'devices':>8} {'lost':>5} {'MB':>8} {'seconds':>8} {'updates/s':>10} {'MB/s':>8}",
          file=sys.stderr)
    for r in rows:
        print(f"{r['workers']:>8} {r['devices']:>8} {r['lost']:>5} {r['mb']:>8} {r['seconds']:>8} "
              f"{str(r['updates_per_s']):>10} {str(r['mb_per_s']):>8}", file=sys.stderr)
    sites = [site(args.site_devices, k, args.timeout) for k in (1, 2)]
    for s in sites:
        print(f"site of {s['devices']} devices in {s['clusters']} cluster(s): flat {s['flat_bytes']:,} B, "
              f"aggregated {s['aggregated_bytes']:,} B, ratio {s['ratio']}", file=sys.stderr)
    w1, w2 = rows[0]["updates_per_s"], rows[1]["updates_per_s"]
    out = {"ingest_lost": rows[0]["lost"] + rows[1]["lost"], "ingest_lost_w1": rows[0]["lost"],
           "ingest_lost_w2": rows[1]["lost"], "ingest_updates_per_s_w1": w1, "ingest_updates_per_s_w2": w2,
           "ingest_speedup_w2": round(w2 / w1, 3) if w1 and w2 else None,
           "ingest_devices": args.devices, "ingest_params": args.params,
           "site_uplink_bytes_ratio": sites[0]["ratio"], "site_uplink_bytes_ratio_2_clusters": sites[1]["ratio"],
           "site_devices": args.site_devices}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
