"""Secure aggregation over a real Mosquitto against the plain rounds: the same sums, the bytes and time it costs.

Imported by ``privacy.py`` (its ``secure`` part). One fleet (scikit-learn's digits in 4 rotation groups, one
EdgeClient thread with its own socket per device, a Mosquitto on a free port) runs twice with the same seed:
plain (int4 updates, the default) and ``--secure``; in both a tenth of the devices take their train command
and never answer (dropped mid-round). The integers each device masks are recorded in this process (the
quantiser wrapped), and each cluster's unmasked sum is compared with the plain sum of those integers: equal
bit for bit or the run is reported as not equal. Bytes are the server transport's counts.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "digits_cnn_1x8x8_10"
FED = "privacy"
#: The rounds' report goal: a group of 4 closes at 3 answers, one of 13 at 10.
REPORT_GOAL = 0.75


def _silent(state: Any, cmd: Any, ctx: Any) -> None:
    """A device that drops mid-round: it takes its train command and never answers."""


def _devices(url: str, clients: list, dropping: set[str], idle_s: float) -> list[threading.Thread]:
    from edge_sdk.client import EdgeClient
    from edge_sdk.client.commands import HANDLERS
    from edge_sdk.protocol.commands import Op
    from edge_sdk.transport import BrokerConfig, MqttTransport
    from edge_sdk.worker import LocalWorker

    threads = []
    for i, c in enumerate(clients):
        w = LocalWorker(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, architecture=ARCH, seed=i)
        t = MqttTransport(BrokerConfig.from_url(url, reconnect_min_s=0.1), c.cid, federation=FED)
        handlers = {**HANDLERS, Op.TRAIN: _silent} if c.cid in dropping else None
        ec = EdgeClient(t, w, federation=FED, seed=i, model_timeout_s=60, handlers=handlers)
        th = threading.Thread(target=ec.run, kwargs={"max_idle_s": idle_s}, daemon=True)
        th.start()
        threads.append(th)
    return threads


class Recorder:
    """The integers each device masked and each group's unmasked sum, by the round's context."""

    def __init__(self) -> None:
        self.masked: dict[tuple[int, str], dict[str, np.ndarray]] = defaultdict(dict)
        self.unmasked: dict[bytes, tuple[tuple[str, ...], np.ndarray]] = {}
        self._lock = threading.Lock()

    def install(self) -> None:
        import edge_sdk.client.secure as device_secure
        from edge_sdk.secure import ServerSecureRound

        real_mask, real_unmask, encode = (device_secure.masked_update, ServerSecureRound.unmask,
                                          device_secure.SecureQuantizer.encode)
        rec = self

        def mask(state, cid, fields, rnd, key, weights, start):
            with rec._lock:  # the devices' threads share the wrapped quantiser
                def enc(self, x, rng):
                    q, clipped = encode(self, x, rng)
                    rec.masked[(rnd, key)][cid] = q.copy()
                    return q, clipped
                device_secure.SecureQuantizer.encode = enc
                try:
                    return real_mask(state, cid, fields, rnd, key, weights, start)
                finally:
                    device_secure.SecureQuantizer.encode = encode

        def unmask(self):
            out = real_unmask(self)
            rec.unmasked[self.params.ctx] = (self.survivors, out.copy())
            return out

        device_secure.masked_update = mask
        ServerSecureRound.unmask = unmask

    def equal(self, run_id: str) -> tuple[int, int]:
        """(groups whose sum equals the plain sum of their survivors' integers, groups)."""
        from edge_sdk.secure import round_context

        ok = 0
        for (rnd, key), qs in self.masked.items():
            got = self.unmasked.get(round_context(run_id, rnd, key))
            if got is not None and sorted(got[0]) == sorted(qs) and np.array_equal(
                    got[1], np.sum([qs[c] for c in got[0]], axis=0)):
                ok += 1
        return ok, len(self.masked)


def stop_devices(threads: list[threading.Thread]) -> None:
    """The devices leave when the server stops them (its last command); those that dropped, on their idle time."""
    for th in threads:
        th.join(timeout=5)


def run_fleet(args: argparse.Namespace, clients: list, dropping: set[str], secure: bool, out: Path) -> dict:
    """One run over a fresh Mosquitto; its results.json."""
    from server_kit.broker import MosquittoBroker
    from server_kit.cli import main

    report = out / ("secure" if secure else "plain")
    argv = ["--federation", FED, "--min-clients", str(len(clients)), "--rounds", str(args.secure_rounds),
            "--epochs", "2", "--lr", "0.01", "--encoder", "digits_encoder", "--architecture", ARCH,
            "--min-cluster-size", "3", "--round-timeout", "60", "--first-round-timeout", "90",
            "--report-goal", str(REPORT_GOAL), "--report-dir", str(report), "--seed", "0"]
    if secure:
        argv += ["--secure", "--secure-clip", str(args.secure_clip)]
    with MosquittoBroker() as broker:
        threads = _devices(broker.url, clients, dropping, idle_s=600)
        t0 = time.perf_counter()
        rc = main(["--broker", broker.url, *argv])
        seconds = time.perf_counter() - t0
        stop_devices(threads)
    if rc != 0:
        raise RuntimeError(f"the {'secure' if secure else 'plain'} run ended with exit code {rc}")
    results = json.loads((report / "results.json").read_text())
    results["_seconds"] = seconds
    return results


def _ari(results: dict, clients: list) -> float:
    from sklearn.metrics import adjusted_rand_score

    return float(adjusted_rand_score([c.group for c in clients], [results["assignment"][c.cid] for c in clients]))


def secure_part(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Plain, then secure; the figures the issue's goals name."""
    from server_kit.data.partition import load_digits_images, rotation_partition

    images, labels = load_digits_images()
    clients = rotation_partition(images, labels, args.secure_devices, groups=4, seed=0)
    n_drop = max(1, round(0.1 * len(clients)))
    dropping = {clients[(5 * i) % len(clients)].cid for i in range(n_drop)}  # device i is in group i mod 4
    plain = run_fleet(args, clients, dropping, False, out)
    rec = Recorder()
    rec.install()
    sec = run_fleet(args, clients, dropping, True, out)
    equal, groups = rec.equal(sec["run_id"])
    rounds = args.secure_rounds
    survivors = len(clients) - len(dropping)

    def closed_at_goal(res: dict) -> bool:
        return all(h["updates"] == survivors and h.get("close") in ("goal", "all-answered") for h in res["history"])

    s = sec["privacy"]["secure"]
    # the rates below divide by every survivor's update of every round: only when each was summed
    lost = [(name, h["round"], h["updates"]) for name, res in (("plain", plain), ("secure", sec))
            for h in res["history"] if h["updates"] != survivors]
    if len(plain["history"]) != rounds or len(sec["history"]) != rounds:
        lost.append(("rounds run", len(plain["history"]), len(sec["history"])))
    if s["failed"] or s["rounds"] != 4 * rounds or s["survivors"] != rounds * survivors:
        lost.append(("secure sums", s["rounds"], s["survivors"]))
    if lost:
        print(f"  work lost, no rates reported: {lost}", flush=True)
    up_plain = plain["bytes"]["received_by_server"].get("UPDATE", {}).get("bytes", 0) / (rounds * survivors)
    secure_bytes = (s["bytes_masked_updates"] + s["bytes_unmask_requests"] + s["bytes_reveals"]) / (rounds * survivors)
    per_round = [h["seconds"] for h in plain["history"]], [h["seconds"] for h in sec["history"]]
    if lost:
        up_plain = secure_bytes = 0.0
    return {
        "lost": lost,
        "devices": len(clients), "dropping": sorted(dropping), "rounds": rounds, "groups": groups,
        "groups_equal": equal, "secure_sum_equals_plain": int(groups > 0 and equal == groups),
        "secure_rounds_closed_with_dropout": int(closed_at_goal(sec) and s["failed"] == 0),
        "plain_rounds_closed_with_dropout": int(closed_at_goal(plain)),
        "close_reasons": {"plain": [h.get("close") for h in plain["history"]],
                          "secure": [h.get("close") for h in sec["history"]]},
        "update_bytes_int4": up_plain, "secure_bytes_per_device_round": secure_bytes,
        "extra_bytes_over_int4_update": (secure_bytes - up_plain) / up_plain if up_plain else None,
        "round_seconds": {"plain": per_round[0], "secure": per_round[1]},
        "round_time_ratio": None if lost else float(np.mean(per_round[1]) / np.mean(per_round[0])),
        "aggregate_s": {"plain": [h.get("aggregate_s") for h in plain["history"]],
                        "secure": [h.get("aggregate_s") for h in sec["history"]]},
        "unmask_s": s["unmask_s"],
        "accuracy": {"plain": plain["final_evaluation"]["mean"], "secure": sec["final_evaluation"]["mean"]},
        "ari": {"plain": _ari(plain, clients), "secure": _ari(sec, clients)},
        "secure": s,
    }
