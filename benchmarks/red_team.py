"""Red team: do the receiver's chunk-reassembly defences hold against never-finished and huge transfers?

Question: with 3,000 never-finished chunked transfers and 1,000 transfers that
announce a huge total in flight, do the honest devices' updates still arrive
whole (none starved), and does the receiver's memory stay within its bound?
The defences under test are the receiving side's (:class:`edge_sdk.protocol.chunks.Reassembler`
behind :class:`edge_sdk.transport.inbox.Inbox`): at most
``chunk_pending_per_sender`` transfers in progress per sender, at most 64
transfers in progress in all, a memory cap on the bytes the pending transfers
*declare* (``chunk_memory_bytes``), one sender's declared bytes capped at one
transfer's limit (``max_message``), the idle timeout (``chunk_timeout_s``)
and the deadline, and ``busy`` back-pressure: a transfer with no room is
refused as ``busy`` and its sender asked for it again later.

What runs, all real parts over real sockets (no mocks, no pickle):

- a Mosquitto on a free port with the shipped ``deploy/mosquitto.conf``
  (``MosquittoBroker(deploy_conf=True)``: its queue, inflight and 1 MB packet
  limits), a password per user and no ACL, so that a few attacker connections
  can speak for hundreds of hostile sender ids (with the shipped ACL each id
  would need an account of its own: that only makes the attack harder);
- the receiver, in a process of its own (its peak memory is its own): an
  :class:`MqttTransport` with the chunk limits of :class:`BrokerConfig`'s
  defaults, subscribed to ``clients/+/update`` as the server's intake is,
  reporting each update it gets (sender, sha256 of the body) and each
  ``busy`` refusal on an update topic (the server's re-ask listener);
- the attackers, in a process of their own (4 connections): first chunks of
  transfers crafted by hand (headers and declared totals, as in
  ``tests/edge_sdk/test_chunk_limits.py``), never followed by the rest.
  Attack 1: ``--never-finished`` (3,000) transfers that declare an honest
  update's size and send its first chunk only, full size (``--attack-chunk-bytes``,
  about the shipped 1 MB packet); attack 2: ``--huge`` (1,000) transfers whose
  first chunk declares the largest total a transfer may have (``max_message``,
  300 MB; a larger one is refused outright as ``oversized`` and holds
  nothing). The first transfer of every hostile sender goes before the honest
  devices start; the rest are sent at an even pace over ``--attack-s``
  seconds (90: longer than the 60 s idle timeout, so the attackers refill the
  receiver's slots when their first transfers expire);
- ``--honest`` (20) honest devices, in this process, each with one update of
  ``--params`` (1.25 M) float32 parameters (5 MB, ``tensors_body``, 6 chunks
  at the shipped packet size) sent through :meth:`MqttTransport.publish`.
  This process plays the server's part in asking for them: each is announced
  and asked for (``GO``) by :class:`server_kit.rounds.reask.Reasks` under the
  server's ``transfer_budget_bytes``; one refused as ``busy`` is asked again
  after a growing delay (1 s, doubling, at most 8 s, +-25 %) as often as it
  takes, and one said sent that never arrived is asked again once after
  ``reask_lost_s`` (the server's rule: ``Reasks``'s defaults and
  ``ServerConfig``'s).

Scenarios, each on a fresh broker and receiver: ``baseline`` (no attack),
``many`` (attack 1 from 300 senders x 10 transfers, attack 2 from 100 x 10)
and ``few`` (attack 1 from 10 senders x 300, attack 2 from 10 x 100).
Measured per scenario: honest updates received whole (by device id, their
body's sha256 compared), the seconds from the first request to the last
honest update, the honest devices told ``busy`` and the resends, the
receiver's peak memory (``/proc`` ``VmHWM``) and its growth over its idle
size against the memory bound, the most bytes its pending transfers declared
and held (sampled every 50 ms), its rejections by reason, and the broker's
log lines about dropped messages. An honest update not received whole within
``--timeout`` (lost or corrupt) is counted in ``honest_lost``; a run with
``honest_lost > 0`` reports no time for that scenario. An update that came
after the server's round timeout (``ServerConfig().round_timeout_s``, 120 s)
would have missed its round: counted in ``honest_late``.

Prints a table, then one JSON line: ``never_finished``, ``huge_announced``,
``honest``, ``honest_lost`` (over the attack scenarios), ``honest_late``,
``honest_busy`` (devices told busy at least once), ``honest_resent``
(requests after the first), ``last_honest_s`` (the slowest attack scenario;
None when one lost an update), ``baseline_last_honest_s``,
``slowdown_vs_baseline``, ``receiver_peak_rss_mb``, ``receiver_growth_mb``,
``memory_bound_mb``, ``within_bound``, ``rejected`` (per scenario), and
``scenarios`` (every figure of every scenario).

Run: ``.venv/bin/python benchmarks/red_team.py`` (about 4 minutes; the
attacked scenarios last as long as the attack plus the 60 s idle timeout).
``--quick``: 4 honest devices of 1.6 MB, 120 never-finished and 20 huge
transfers of 64 KiB first chunks, over 3 s, with the idle timeout cut to 2 s
(the only limit changed from the shipped ones; the JSON says so), about 12 s.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from edge_sdk.protocol import BUSY, Kind, Message, tensors_body
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import MosquittoBroker
from server_kit.drivers import ServerConfig
from server_kit.rounds.reask import Reasks

FED = "redteam"
#: The shipped receiver's limits (the server's transport takes BrokerConfig's defaults).
SHIPPED = BrokerConfig()
#: The server's budget of announced updates on their way to one receiver, and its round timeout.
BUDGET = ServerConfig().transfer_budget_bytes
ROUND_TIMEOUT_S = ServerConfig().round_timeout_s
LOST_AFTER_S = ServerConfig().reask_lost_s
#: Transfers the reassembler holds in progress at once (Inbox leaves the Reassembler's default).
MAX_PENDING = 64
ATTACKERS = 4
SCENARIOS = {  # name: (attack-1 senders, attack-2 senders), None: no attack
    "baseline": None,
    "many": (300, 100),
    "few": (10, 10),
}


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _vm(pid: str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process (bytes)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key = line.split(":", 1)[0]
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(line.split()[1]) * 1024
    return out


def _config(url: str, user: str, password: str, limits: dict[str, Any]) -> BrokerConfig:
    return BrokerConfig.from_url(url, username=user, password=password, reconnect_min_s=0.2,
                                 reconnect_max_s=2.0, **limits)


# -- the receiver (a process of its own) -----------------------------------------


def _receiver(url: str, password: str, limits: dict[str, Any], honest: list[str], conn: Any) -> None:
    """The server's intake: reports ``("got", sender, sha256, t)`` and ``("busy", sender, t)`` to ``conn``."""
    # a warning per expired or refused hostile transfer (thousands): counted in the stats instead
    for name in ("edge_sdk.protocol.chunks", "edge_sdk.transport.inbox"):
        logging.getLogger(name).setLevel(logging.ERROR)
    lock = threading.Lock()
    honest_ids = frozenset(honest)

    def send(item: Any) -> None:
        with lock:
            conn.send(item)

    t = MqttTransport(_config(url, "server", password, limits), "server", federation=FED)
    topics = t.topics

    def on_update(topic: str, msg: Message) -> None:
        send(("got", msg.sender, hashlib.sha256(msg.body).hexdigest(), time.monotonic()))

    def on_rejected(topic: str, reason: str, detail: str) -> None:
        parsed = topics.parse(topic)
        if reason == BUSY and parsed is not None and parsed[2] == "update" and parsed[1] in honest_ids:
            send(("busy", parsed[1], time.monotonic()))

    t.on_rejected(on_rejected)
    t.subscribe(topics.all_clients("update"), on_update)
    t.connect(timeout=20)
    t.wait_subscribed(10)
    peak = {"pending": 0, "pending_bytes": 0, "held_bytes": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            s = t.stats()["chunks"]
            for k in peak:
                peak[k] = max(peak[k], s[k])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    idle = _vm()
    send(("ready", idle["VmRSS"]))
    while (cmd := conn.recv()) is not None:
        if cmd == "stats":
            stats = t.stats()
            send(("stats", {"vm": _vm(), "idle_rss": idle["VmRSS"], "peak": dict(peak),
                            "rejected": stats["rejected"], "chunks": stats["chunks"],
                            "errors": stats["errors"], "received": stats["received"]}))
    stop.set()
    t.close(timeout=2)


# -- the attackers (a process of their own) --------------------------------------


def _plan(nf_senders: int, never_finished: int, huge_senders: int, huge: int, *, nf_size: int, huge_size: int,
          body: int, step: int) -> list[tuple[str, dict[str, Any], int]]:
    """Every hostile transfer's first chunk: ``(sender, meta, body bytes)``, round-robin over the senders.

    Attack 1: ``never_finished`` transfers declaring ``nf_size`` bytes; attack 2: ``huge`` transfers declaring
    ``huge_size``. Each sends chunk 0 of its ``ceil(size / step)`` and never more.
    """
    out = []
    for attack, senders, count, size in (("n", nf_senders, never_finished, nf_size),
                                         ("h", huge_senders, huge, huge_size)):
        n = math.ceil(size / step)
        for j in range(count):
            sender = f"{attack}{j % senders:04d}"
            digest = hashlib.sha256(f"{attack}{j}".encode()).hexdigest()  # the transfer's claim, never checked
            meta = {"id": f"{attack}{j}", "i": 0, "n": n, "size": size, "sha256": digest, "k": int(Kind.UPDATE)}
            out.append((sender, meta, min(body, size)))
    return out


def _attacker(url: str, logins: dict[str, str], plan: list[tuple[str, dict[str, Any], int]], first: int,
              attack_s: float, conn: Any) -> None:
    """Send the first ``first`` chunks of ``plan`` (then say so), the rest at an even pace over ``attack_s``."""
    junk = np.random.default_rng(7).integers(0, 256, max((b for _, _, b in plan), default=1),
                                             dtype=np.uint8).tobytes()
    conns = []
    for i in range(ATTACKERS):
        t = MqttTransport(_config(url, f"evil{i}", logins[f"evil{i}"], {}), f"evil{i}", federation=FED)
        t.connect(timeout=20)
        conns.append(t)

    def send(k: int, *, wait: bool = False) -> None:
        sender, meta, nbytes = plan[k]
        t = conns[k % ATTACKERS]
        t.publish(t.topics.update(sender), Message(Kind.CHUNK, FED, sender, 1, meta, junk[:nbytes]), wait=wait,
                  timeout=120)

    conn.recv()  # go
    for k in range(first):
        send(k, wait=k >= first - ATTACKERS)
    conn.send(("wave", first, time.monotonic()))
    rest = len(plan) - first
    t0 = time.monotonic()
    for j in range(rest):
        due = t0 + attack_s * j / max(1, rest)
        if (pause := due - time.monotonic()) > 0:
            time.sleep(pause)
        send(first + j, wait=j >= rest - ATTACKERS)
        if j % 500 == 0:
            conn.send(("sent", first + j + 1, time.monotonic()))
    conn.send(("done", len(plan), time.monotonic()))
    conn.recv()
    for t in conns:
        t.close(timeout=5)


# -- one scenario --------------------------------------------------------------------


def _model(params: int, seed: int) -> dict[str, np.ndarray]:
    """``params`` float32 parameters in 8 tensors."""
    rng = np.random.default_rng(seed)
    sizes = [params // 8] * 7 + [params - 7 * (params // 8)]
    return {f"layer{i}.weight": rng.standard_normal(n).astype(np.float32) for i, n in enumerate(sizes)}


def _update(t: MqttTransport, body: bytes) -> None:
    t.publish(t.topics.update(t.client_id), Message(Kind.UPDATE, FED, t.client_id, 1,
                                                    {"round": 1, "model_key": "c0", "n_samples": 100,
                                                     "metrics": {}}, body))


def scenario(name: str, args: argparse.Namespace, bodies: dict[str, bytes], limits: dict[str, Any]) -> dict[str, Any]:
    """Run one scenario on a fresh broker and receiver; its figures."""
    senders = SCENARIOS[name]
    honest = sorted(bodies)
    digests = {cid: hashlib.sha256(b).hexdigest() for cid, b in bodies.items()}
    logins = {"server": "pw-server"} | {cid: f"pw-{cid}" for cid in honest}
    logins |= {f"evil{i}": f"pw-evil{i}" for i in range(ATTACKERS)}
    ctx = mp.get_context("spawn")
    row: dict[str, Any] = {"scenario": name, "honest": len(honest)}
    with MosquittoBroker(deploy_conf=True, passwords=logins) as broker:
        here, there = ctx.Pipe()
        recv = ctx.Process(target=_receiver, args=(broker.url, logins["server"], limits, honest, there), daemon=True)
        recv.start()
        attack = None
        try:
            kind, idle_rss = here.recv()
            assert kind == "ready"
            devices = {}
            for cid in honest:
                d = MqttTransport(_config(broker.url, cid, logins[cid], {}), cid, federation=FED)
                d.connect(timeout=20)
                devices[cid] = d
            plan: list = []
            if senders is not None:
                nf_s, huge_s = senders
                nf_s, huge_s = min(nf_s, args.never_finished) or 1, min(huge_s, args.huge) or 1
                step = SHIPPED.max_payload - 4096  # about what one chunk of the shipped packet carries
                plan = _plan(nf_s, args.never_finished, huge_s, args.huge, nf_size=len(next(iter(bodies.values()))),
                             huge_size=limits.get("max_message", SHIPPED.max_message),
                             body=args.attack_chunk_bytes, step=step)
                # first, one transfer per hostile sender (the plan is round-robin over them)
                nf_first, huge_first = min(nf_s, args.never_finished), min(huge_s, args.huge)
                first = nf_first + huge_first
                nf_end = args.never_finished
                plan = (plan[:nf_first] + plan[nf_end:nf_end + huge_first]
                        + plan[nf_first:nf_end] + plan[nf_end + huge_first:])
                row |= {"never_finished_senders": nf_s, "huge_senders": huge_s,
                        "attack_chunk_bytes": args.attack_chunk_bytes, "attack_s": args.attack_s}
                a_here, a_there = ctx.Pipe()
                attack = ctx.Process(target=_attacker, args=(broker.url, logins, plan, first, args.attack_s, a_there),
                                     daemon=True)
                attack.start()
                a_here.send("go")
                _progress(f"[{name}] attack: {first} first transfers (one per hostile sender) ...")
                while True:  # the first wave is in before any honest device sends
                    kind, *_ = a_here.recv()
                    if kind == "wave":
                        break
            attack_state = {"sent": 0, "done": senders is None}
            reasks = Reasks(1, budget_bytes=BUDGET, lost_after_s=LOST_AFTER_S)
            ready = {cid: (1, len(b)) for cid, b in bodies.items()}
            awaited, sent, arrived, corrupt = set(honest), {}, {}, {}
            busy: dict[str, int] = {}
            asked: dict[str, int] = {}
            t0 = time.monotonic()
            deadline = t0 + args.timeout
            next_note = t0 + 5.0
            while awaited and time.monotonic() < deadline:
                while here.poll(0.05):
                    kind, cid, *rest_ = here.recv()
                    if kind == "got" and cid in awaited:
                        if rest_[0] == digests[cid]:
                            arrived[cid] = rest_[1] - t0
                            awaited.discard(cid)
                            corrupt.pop(cid, None)
                        else:
                            corrupt[cid] = corrupt.get(cid, 0) + 1
                    elif kind == "busy" and cid in awaited:
                        busy[cid] = busy.get(cid, 0) + 1
                        reasks.busy(cid)
                if attack is not None:
                    while a_here.poll():
                        kind, count, _ = a_here.recv()
                        attack_state["sent"] = count
                        attack_state["done"] = kind == "done"
                for cid, _why in reasks.due(awaited, sent, ready):
                    asked[cid] = asked.get(cid, 0) + 1
                    _update(devices[cid], bodies[cid])
                    sent[cid] = (1, time.monotonic())
                if time.monotonic() >= next_note:
                    next_note += 5.0
                    _progress(f"[{name}] {time.monotonic() - t0:.0f} s: {len(arrived)}/{len(honest)} honest in, "
                              f"{sum(busy.values())} busy, attack sent {attack_state['sent']}/{len(plan)}")
            last = max(arrived.values(), default=None)
            if attack is not None:  # the attack's whole schedule is sent before the receiver is read
                while not attack_state["done"]:
                    kind, count, _ = a_here.recv()
                    attack_state["sent"], attack_state["done"] = count, kind == "done"
                    if kind == "sent":
                        _progress(f"[{name}] attack sent {count}/{len(plan)}")
                a_here.send("stop")
                attack.join(30)
            time.sleep(1.0)  # the receiver takes what is still on its way
            here.send("stats")
            while True:
                kind, *payload = here.recv()
                if kind == "stats":
                    stats = payload[0]
                    break
            here.send(None)
            recv.join(10)
            for d in devices.values():
                d.close(timeout=2)
        finally:
            for p in (recv, attack):
                if p is not None and p.is_alive():
                    p.kill()
        log = broker.log_text()
    dropped = [line for line in log.splitlines() if "dropp" in line.lower() or "slow consumer" in line.lower()]
    lost = sorted(set(honest) - set(arrived))
    vm = stats["vm"]
    growth = vm["VmHWM"] - stats["idle_rss"]
    bound = limits.get("chunk_memory_bytes", SHIPPED.chunk_memory_bytes)
    row |= {
        "attack_sent": attack_state["sent"], "honest_lost": len(lost), "lost_ids": lost,
        "honest_corrupt": sum(corrupt.values()),
        "honest_late": sum(1 for s in arrived.values() if s > ROUND_TIMEOUT_S),
        "last_honest_s": round(last, 2) if last is not None and not lost else None,
        "first_honest_s": round(min(arrived.values()), 2) if arrived else None,
        "honest_busy": len(busy), "busy_refusals": sum(busy.values()),
        "honest_resent": sum(n - 1 for n in asked.values()),
        "asked": reasks.to_dict(),
        "receiver_idle_rss_mb": round(stats["idle_rss"] / 1e6, 1),
        "receiver_peak_rss_mb": round(vm["VmHWM"] / 1e6, 1), "receiver_growth_mb": round(growth / 1e6, 1),
        "memory_bound_mb": round(bound / 1e6, 1), "within_bound": growth <= bound,
        "peak_pending": stats["peak"]["pending"],
        "peak_declared_mb": round(stats["peak"]["pending_bytes"] / 1e6, 1),
        "peak_held_mb": round(stats["peak"]["held_bytes"] / 1e6, 1),
        "rejected": stats["rejected"], "receiver_errors": stats["errors"],
        "chunks_end": {k: stats["chunks"][k] for k in ("pending", "expired", "expired_deadline",
                                                        "deferred_chunks", "gaps", "evicted")},
        "broker_drop_lines": len(dropped),
    }
    if dropped:
        row["broker_drop_example"] = dropped[0][:200]
    if lost or row["honest_corrupt"]:
        _progress(f"[{name}] {len(lost)} honest update(s) not received whole within {args.timeout:g} s "
                  f"({', '.join(lost[:8])}); {row['honest_corrupt']} arrived corrupt: no time is reported")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few seconds: small numbers, a 2 s idle timeout")
    p.add_argument("--honest", type=int, default=20, help="honest devices, one update each")
    p.add_argument("--params", type=int, default=1_250_000, help="float32 parameters of an honest update")
    p.add_argument("--never-finished", type=int, default=3000, help="attack 1: transfers never finished")
    p.add_argument("--huge", type=int, default=1000, help="attack 2: transfers announcing a huge total")
    p.add_argument("--attack-chunk-bytes", type=int, default=SHIPPED.max_payload - 4096,
                   help="bytes of each hostile first chunk (default: about the shipped packet)")
    p.add_argument("--attack-s", type=float, default=90.0,
                   help="seconds over which the attack's transfers after the first wave are sent")
    p.add_argument("--scenarios", default="baseline,many,few", help="comma-separated: " + ",".join(SCENARIOS))
    p.add_argument("--timeout", type=float, default=400.0, help="seconds an honest update may take (else lost)")
    args = p.parse_args(argv)
    limits: dict[str, Any] = {}
    if args.quick:
        args.honest, args.params, args.never_finished, args.huge = 4, 400_000, 120, 20
        args.attack_chunk_bytes, args.attack_s, args.timeout = 64 * 1024, 3.0, min(args.timeout, 60.0)
        limits["chunk_timeout_s"] = 2.0
    names = [s for s in args.scenarios.split(",") if s]
    if bad := [s for s in names if s not in SCENARIOS]:
        p.error(f"unknown scenarios {bad}; choose from {sorted(SCENARIOS)}")
    model = _model(args.params, 0)
    bodies = {f"d{i:03d}": tensors_body({k: v + np.float32(0.01 * (i + 1)) for k, v in model.items()})
              for i in range(args.honest)}
    cfg = BrokerConfig(**limits)
    _progress(f"honest update {len(next(iter(bodies.values()))) / 1e6:.2f} MB; receiver limits: "
              f"{cfg.chunk_pending_per_sender} pending per sender, {MAX_PENDING} in all, "
              f"{cfg.chunk_memory_bytes / 2**20:.0f} MiB declared, {cfg.max_message / 1e6:.0f} MB per transfer, "
              f"idle timeout {cfg.chunk_timeout_s:g} s, deadline {cfg.chunk_deadline_s:g} s")
    rows = []
    for name in names:
        _progress(f"[{name}] starting")
        rows.append(scenario(name, args, bodies, limits))
    base = next((r for r in rows if r["scenario"] == "baseline"), None)
    print(f"{'scenario':>9} {'senders':>9} {'lost':>5} {'late':>5} {'busy':>5} {'resent':>7} {'first s':>8} "
          f"{'last s':>8} {'x base':>7} {'peak RSS':>9} {'growth':>7} {'declared':>9} {'held':>6} "
          f"{'pending':>8}  rejected")
    for r in rows:
        ratio = (round(r["last_honest_s"] / base["last_honest_s"], 1)
                 if base and base["last_honest_s"] and r["last_honest_s"] is not None else None)
        r["slowdown_vs_baseline"] = ratio
        who = f"{r.get('never_finished_senders', '-')}/{r.get('huge_senders', '-')}"
        print(f"{r['scenario']:>9} {who:>9} {r['honest_lost']:>5} {r['honest_late']:>5} {r['honest_busy']:>5} "
              f"{r['honest_resent']:>7} {str(r['first_honest_s']):>8} {str(r['last_honest_s']):>8} "
              f"{str(ratio):>7} {r['receiver_peak_rss_mb']:>8}M {r['receiver_growth_mb']:>6}M "
              f"{r['peak_declared_mb']:>8}M {r['peak_held_mb']:>5}M {r['peak_pending']:>8}  {r['rejected']}")
    attacked = [r for r in rows if r["scenario"] != "baseline"] or rows
    times = [r["last_honest_s"] for r in attacked]
    last = None if any(t is None for t in times) else max(times)
    out = {
        "never_finished": args.never_finished, "huge_announced": args.huge, "honest": args.honest,
        "honest_bytes": len(next(iter(bodies.values()))),
        "honest_lost": sum(r["honest_lost"] + r["honest_corrupt"] for r in attacked),
        "honest_late": sum(r["honest_late"] for r in attacked),
        "honest_busy": max(r["honest_busy"] for r in attacked),
        "honest_resent": max(r["honest_resent"] for r in attacked),
        "last_honest_s": last,
        "baseline_last_honest_s": base["last_honest_s"] if base else None,
        "slowdown_vs_baseline": (round(last / base["last_honest_s"], 1)
                                 if last is not None and base and base["last_honest_s"] else None),
        "round_timeout_s": ROUND_TIMEOUT_S,
        "receiver_peak_rss_mb": max(r["receiver_peak_rss_mb"] for r in rows),
        "receiver_growth_mb": max(r["receiver_growth_mb"] for r in rows),
        "memory_bound_mb": round(cfg.chunk_memory_bytes / 1e6, 1),
        "within_bound": all(r["within_bound"] for r in rows),
        "peak_declared_mb": max(r["peak_declared_mb"] for r in rows),
        "rejected": {r["scenario"]: r["rejected"] for r in rows},
        "shipped_limits": not limits, "chunk_timeout_s": cfg.chunk_timeout_s,
        "scenarios": rows,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
