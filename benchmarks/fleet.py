"""A fleet of N real devices against the real server and the shipped broker settings.

Question: how long do registration, sketch collection, clustering, the
rounds and the final evaluation take as the fleet grows, is every device
still there at the end, are the clusters still right, and what do the server
and the broker spend (CPU per message, peak memory)?

Per size N (``--sizes``, default 100,1000,3550,10000; ``--quick``: 100):

* Mosquitto on a free port with the shipped ``deploy/mosquitto.conf``
  (:func:`server_kit.broker.adapt_deploy_conf`: every limit as shipped; the
  devices' listener made plain, no TLS, which would cost the broker and the
  emulator CPU this benchmark does not measure), the shipped ACL
  (``deploy/acl`` for the federation "fleet") and a password per device:
  every device logs in with its id as user name, as in production;
* N emulated devices (:class:`server_kit.emulate.EmulatedFleet`): real
  ``EdgeClient``\\ s with real MQTT connections, many per process on shared
  epoll network loops, in ``--processes`` child processes; each holds 30 to
  60 digits of scikit-learn (and 20 % more to test on), rotated by its group
  (4 rotation groups, device ``i`` in group ``i mod 4``), and connects before
  the server starts;
* the real server, ``fedsketch-server`` in its own process: fedsketch, the
  shipped ``digits_encoder`` and ``digits_cnn_1x8x8_10``, 3 rounds, about 75
  devices trained per round (``--fraction 75/N``), 1 local epoch, the truth
  given for the ARI. It broadcasts its hello when it starts, so all N devices
  answer at once: the burst the broker's queue must hold.

Reported per N: registration (from the server's log: its connection to its
last "registered" or "admitted" line; results.json's ``register_s`` adds a
0.5 s grace and the admission), sketch collection and clustering (results.json), each round
(its ``seconds``) and the final evaluation (``training_s`` minus the rounds);
messages and bytes per kind at the server; the server's CPU (user + system,
from ``wait4``) per message sent or received and its peak RSS; the broker's
CPU and peak RSS (``/proc``: ``VmHWM``) and the lines where it dropped
messages; the emulator's CPU; clusters found and ARI against the rotation
groups; devices lost (N minus the devices assigned, plus those the server
saw go offline).

Run: ``.venv/bin/python benchmarks/fleet.py --sizes 100,1000`` (``--quick``:
100 devices, about 30 s). Results go to ``--out`` (default reports/fleet):
``results.json`` and, per N, the server's log and report and the broker's
log. A progress line goes to stderr every few seconds. The last line is
JSON: ``register_s_3550``, ``sketch_s_3550``, ``cluster_s_3550``,
``ari_3550``, ``lost_3550``, ``register_s_10000``, ``ari_10000``,
``server_us_per_msg_10000`` (null where that size was not run), and the same
figures for every size run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FEDERATION = "fleet"
ARCH = "digits_cnn_1x8x8_10"
ENCODER = "digits_encoder"
KEY_SIZES = (3550, 10000)
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def _log_time(line: str) -> float | None:
    m = _LOG_TIME.match(line)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def register_from_log(text: str) -> float | None:
    """Seconds from the server's connection (its hello broadcast follows) to its last "registered" (or
    "admitted", when the models are given) line."""
    t0 = last = None
    for line in text.splitlines():
        if t0 is None and " as server " in line and "connected to" in line:
            t0 = _log_time(line)
        elif t0 is not None and re.search(r"client \S+ (registered|admitted) \(", line):
            last = _log_time(line) or last
    return None if t0 is None or last is None else max(0.0, last - t0)


def _vm_hwm_mb(pid: int) -> float | None:
    """Peak resident memory of a running process (VmHWM), MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a running process."""
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    except Exception:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None


class _Watch:
    """Last CPU and peak memory seen of a process that may end (sampled)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.cpu: dict[int, float] = {}
        self.peak: dict[int, float] = {}

    def sample(self) -> None:
        for pid in self.pids:
            c, m = _cpu_s(pid), _vm_hwm_mb(pid)
            if c is not None:
                self.cpu[pid] = c
            if m is not None:
                self.peak[pid] = max(self.peak.get(pid, 0.0), m)

    @property
    def cpu_s(self) -> float:
        return sum(self.cpu.values())

    @property
    def peak_mb(self) -> float:
        return sum(self.peak.values())


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Scraper:
    """Reads the server's ``/metrics`` every second (and, with ``page``, its live page every 2 s), timing each
    answer (ms); a read that fails once the endpoint has answered is counted (but in the last 2 s: the server
    exits at the end of its run)."""

    def __init__(self, port: int, *, page: bool = False) -> None:
        import threading

        self.port = port
        self.page = page
        self.metrics_ms: list[float] = []
        self.page_ms: list[float] = []
        self._failed_at: list[float] = []
        self.largest_series = 0
        self._t0 = time.monotonic()
        #: The watch's own CPU seconds on the server, as its last /metrics answer said.
        self.watch_cpu_s: float | None = None
        #: Seconds from the server's start to the slowest /metrics answer.
        self.slowest_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _get(self, path: str) -> float | None:
        import urllib.request

        t = time.perf_counter()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                body = r.read()
        except OSError:
            return None
        ms = (time.perf_counter() - t) * 1e3
        if path == "/metrics":
            self.largest_series = max(self.largest_series, sum(1 for line in body.splitlines()
                                                               if line and not line.startswith(b"#")))
            self.watch_cpu_s = sum(float(line.split()[-1]) for line in body.splitlines()
                                   if line.startswith(b"fedsketch_watch_cpu_seconds_total"))
        return ms

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(1.0):
            for path, into in (("/metrics", self.metrics_ms),
                               *((("/", self.page_ms),) if self.page and tick % 2 == 0 else ())):
                ms = self._get(path)
                if ms is not None:
                    into.append(ms)
                    if path == "/metrics" and ms >= max(self.metrics_ms):
                        self.slowest_at = time.monotonic() - self._t0
                elif self.metrics_ms:  # before the first answer the server is starting: not a failure
                    self._failed_at.append(time.monotonic())
            tick += 1

    def stop(self) -> dict[str, Any]:
        """The scrapes' figures: count, median and largest answer time, series in the largest answer."""
        import statistics

        self._stop.set()
        self._thread.join(timeout=10)
        # the reads of the last 2 s may have met the server gone: it exits when its run is over
        failed = sum(1 for t in self._failed_at if t < time.monotonic() - 2.0)

        def stats(xs: list[float]) -> tuple[float | None, float | None]:
            return (round(statistics.median(xs), 2), round(max(xs), 2)) if xs else (None, None)

        (m50, mmax), (p50, pmax) = stats(self.metrics_ms), stats(self.page_ms)
        ranked = sorted(self.metrics_ms)
        p90 = round(ranked[int(0.9 * (len(ranked) - 1))], 2) if ranked else None
        return {"scrapes": len(self.metrics_ms), "metrics_ms_p50": m50, "metrics_ms_p90": p90, "metrics_ms_max": mmax,
                "metrics_slowest_at_s": None if self.slowest_at is None else round(self.slowest_at, 1),
                "page_reads": len(self.page_ms), "page_ms_p50": p50, "page_ms_max": pmax,
                "scrapes_failed": failed, "series": self.largest_series,
                "watch_cpu_s": None if self.watch_cpu_s is None else round(self.watch_cpu_s, 3)}


def _count_messages(table: dict[str, Any]) -> int:
    return sum(int(v.get("messages", 0)) for v in (table or {}).values())


class _Broker:
    """The broker of one size: where devices connect, its processes, its log, how to stop it."""

    def __init__(self, server: Any, pids: list[int]) -> None:
        self.server = server
        self.url: str = server.url
        self.pids = pids

    def log_text(self) -> str:
        return str(self.server.log_text())

    def cleanup(self) -> None:
        self.server.cleanup()


def _make_users() -> Any:
    """``deploy/nats/make_users.py`` as a module (the devices' and the server's NATS permissions)."""
    spec = importlib.util.spec_from_file_location("make_users", ROOT / "deploy" / "nats" / "make_users.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def start_broker(kind: str, d: Path, passwords: dict[str, str], server_pw: str,
                 max_connections: int | None) -> _Broker:
    """Mosquitto with ``deploy/mosquitto.conf`` and ``deploy/acl``, or the three-node NATS cluster of
    ``deploy/nats/`` with the users of ``make_users.py`` (passwords in the clear: a bcrypt check per
    connection would cost the broker CPU at connection, before anything this benchmark times)."""
    if kind == "nats":
        from server_kit.broker import ShippedNatsCluster

        mu = _make_users()
        users = [("server", server_pw, mu.server_permissions([FEDERATION], "fedsketch"))]
        users += [(cid, pw, mu.device_permissions(cid, [FEDERATION], "fedsketch")) for cid, pw in passwords.items()]
        conf = mu.render(users)
        if max_connections is not None:
            conf += f"max_connections: {max_connections}\n"
        cluster = ShippedNatsCluster(conf, login=("server", server_pw))
        cluster.start(timeout=60)
        return _Broker(cluster, [node.pid for node in cluster.nodes if node.pid is not None])
    from server_kit.broker import MosquittoBroker

    acl = (ROOT / "deploy" / "acl").read_text().replace("fedsketch/default/", f"fedsketch/{FEDERATION}/")
    conf: Any = True  # the shipped deploy/mosquitto.conf
    if max_connections is not None:
        shipped = (ROOT / "deploy" / "mosquitto.conf").read_text()
        conf = d / "mosquitto.conf"
        conf.write_text(re.sub(r"(?m)^max_connections .*$", f"max_connections {max_connections}", shipped))
    broker = MosquittoBroker(deploy_conf=conf, passwords={**passwords, "server": server_pw}, acl=acl)
    broker.start(timeout=30)
    assert broker.pid is not None
    return _Broker(broker, [broker.pid])


def _device_qos(args: argparse.Namespace) -> int:
    """The devices' subscriptions' QoS: ``--device-qos``, else 0 on NATS (no JetStream consumer each) and 1 on
    Mosquitto."""
    return args.device_qos if args.device_qos is not None else (0 if args.broker == "nats" else 1)


def run_size(n: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One fleet of ``n`` devices, broker and server; returns its figures."""
    from server_kit.cores import Role, plan
    from server_kit.emulate import EmulatedFleet, fleet_partition

    d = out / f"n{n}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    t_setup = time.monotonic()
    clients = fleet_partition(n, min_samples=args.min_samples, max_samples=args.max_samples, groups=4,
                              seed=args.seed)
    passwords = {c.cid: secrets.token_urlsafe(12) for c in clients}
    server_pw = secrets.token_urlsafe(16)
    (d / "truth.json").write_text(json.dumps({c.cid: c.group for c in clients}))
    pw_file = d / "server.password"
    pw_file.write_text(server_pw)
    pw_file.chmod(0o600)
    per_round = min(1.0, args.per_round / n)
    toml = d / "run.toml"
    toml.write_text(f"eval_timeout_s = {args.timeout:g}\n")
    row: dict[str, Any] = {"devices": n, "processes": args.processes, "broker": args.broker}
    if args.max_connections is not None:  # past the 12,000 it is sized for: say so in the results
        row["max_connections"] = args.max_connections
    broker = start_broker(args.broker, d, passwords, server_pw, args.max_connections)
    fleet = None
    try:
        broker_watch = _Watch(broker.pids)
        processes = args.processes if args.processes is not None else (1 if n <= 4000 else 2)
        row["processes"] = processes
        fleet = EmulatedFleet(broker.url, clients, passwords=passwords, processes=processes,
                              federation=FEDERATION, loops=args.loops, workers=2, steppers=args.steppers,
                              connect_window=args.connect_window, connect_timeout_s=args.connect_timeout,
                              hello_jitter_s=args.hello_jitter, model_timeout_s=args.timeout, seed=args.seed,
                              subscribe_qos=_device_qos(args))
        row["device_subscribe_qos"] = _device_qos(args)
        _progress(n, time.monotonic() - t_setup, f"threads: {processes or 1} emulator process(es), each with 1 "
                                                  f"pool thread (server_kit.cores); the server: its share, "
                                                  f"{plan(Role.COORDINATOR).threads} (its log says)")
        fleet.start()
        row["fleet_connect_s"] = round(fleet.start_s or 0.0, 2)
        emu_watch = _Watch(fleet.pids)
        emu_watch.sample()
        emu_cpu0 = emu_watch.cpu_s
        broker_watch.sample()
        broker_cpu0 = broker_watch.cpu_s
        _progress(n, time.monotonic() - t_setup, f"{n} devices connected in {row['fleet_connect_s']} s; "
                                                  "starting the server")
        cmd = [sys.executable, "-m", "server_kit.cli", "--config", str(toml), "--broker", broker.url,
               "--username", "server", "--password-file", str(pw_file), "--federation", FEDERATION,
               "--strategy", "fedsketch", "--min-clients", str(n), "--rounds", str(args.rounds),
               "--architecture", ARCH, "--encoder", ENCODER, "--fraction", f"{per_round:.6g}",
               "--epochs", "1", "--lr", "0.01", "--batch-size", "16", "--seed", str(args.seed),
               "--register-timeout", f"{args.timeout:g}", "--sketch-timeout", f"{args.timeout:g}",
               "--round-timeout", f"{args.timeout:g}", "--report-dir", str(d / "report"),
               "--truth", str(d / "truth.json"), *args.server_arg]
        scraper = None
        if args.watch:  # the metrics and the live page on, read as Prometheus and a person would
            scraper = Scraper(free_port(), page=args.watch == "page")
            cmd += ["--metrics-port", str(scraper.port)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        t0 = time.monotonic()
        with open(d / "server.log", "w") as logf:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=logf, stderr=subprocess.STDOUT, env=env)
        if scraper is not None:
            scraper.start()
        server_watch = _Watch([proc.pid])
        rusage = None
        deadline = t0 + args.timeout * (args.rounds + 4)
        next_note = time.monotonic() + args.progress_s
        while True:
            pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
            if pid == proc.pid:
                rc = os.waitstatus_to_exitcode(status)
                proc.returncode = rc
                break
            server_watch.sample()
            broker_watch.sample()
            emu_watch.sample()
            now = time.monotonic()
            if now >= deadline:
                proc.kill()
                _, status, rusage = os.wait4(proc.pid, 0)
                rc = -9
                row["error"] = "server killed at the benchmark's deadline"
                break
            if now >= next_note:
                next_note = now + args.progress_s
                snap = fleet.snapshot()
                h = snap.get("handled", {})
                last = _last_line(d / "server.log")
                _progress(n, now - t_setup, f"devices: hello {h.get('hello', 0)}, sketch {h.get('sketch', 0)}, "
                                            f"train {h.get('train', 0)}, evaluate {h.get('evaluate', 0)} | "
                                            f"server: {_clip(last, 90)}")
            time.sleep(0.2)
        row["server_wall_s"] = round(time.monotonic() - t0, 2)
        row["server_rc"] = rc
        if scraper is not None:
            row.update(scraper.stop())
        fleet.wait_done(30)
        emu_watch.sample()
        broker_watch.sample()
        device_totals = fleet.close()
        fleet = None
        row["server_cpu_s"] = round(rusage.ru_utime + rusage.ru_stime, 2)
        row["server_peak_rss_mb"] = round(rusage.ru_maxrss / 1024, 1)  # Linux: kB
        row["broker_cpu_s"] = round(broker_watch.cpu_s - broker_cpu0, 2)
        row["broker_peak_rss_mb"] = round(broker_watch.peak_mb, 1)
        row["emulator_cpu_s"] = round(emu_watch.cpu_s - emu_cpu0, 2)
        row["emulator_peak_rss_mb"] = round(emu_watch.peak_mb, 1)
        row["devices_done"] = device_totals.get("done", 0)
        row["device_exit_codes"] = device_totals.get("exit_codes", {})
        row["device_commands"] = device_totals.get("handled", {})
        row["device_traffic"] = device_totals.get("traffic", {})
        row["emulator_loops"] = device_totals.get("loops", {})
    finally:
        if fleet is not None:
            fleet.close()
        broker_log = broker.log_text()
        broker.cleanup()
    (d / f"{args.broker}.log").write_text(broker_log)
    dropped = [line for line in broker_log.splitlines() if "dropp" in line.lower() or "slow consumer" in line.lower()]
    row["broker_drop_lines"] = len(dropped)
    if dropped:
        row["broker_drop_example"] = dropped[0][:200]
    log_text = (d / "server.log").read_text(errors="replace")
    results_path = d / "report" / "results.json"
    if not results_path.is_file():
        row.setdefault("error", f"the server wrote no results.json (exit {row.get('server_rc')}); see "
                                f"{d / 'server.log'}: {log_text[-500:]}")
        return row
    res = json.loads(results_path.read_text())
    timings = res.get("timings") or {}
    rounds = [float(h.get("seconds", 0.0)) for h in res.get("history") or []]
    reg_log = register_from_log(log_text)
    row.update({
        "register_s": round(reg_log, 3) if reg_log is not None else None,
        "register_s_results": _r(timings.get("register_s")),
        "sketch_s": _r(timings.get("sketch_collect_s")),
        "cluster_s": _r(timings.get("clustering_s")),
        "round_s": [round(x, 2) for x in rounds],
        "final_eval_s": _r(timings.get("training_s") - sum(rounds)) if timings.get("training_s") else None,
        "total_s": _r(timings.get("total_s")),
        "clusters": len(set((res.get("assignment") or {}).values())),
        "ari": _r((res.get("clustering") or {}).get("ari"), 4),
        "final_accuracy": _r((res.get("final_evaluation") or {}).get("mean"), 4),
    })
    assigned = set(res.get("assignment") or {})
    dropped_devices = set(res.get("dropped") or {})
    row["lost"] = len((set(passwords) - assigned) | dropped_devices)
    row["not_assigned"] = n - len(assigned)
    row["went_offline"] = len(dropped_devices)
    b = res.get("bytes") or {}
    row["server_received"] = b.get("received_by_server", {})
    row["server_sent"] = b.get("sent_by_server", {})
    row["downloaded_by_devices"] = b.get("downloaded_by_devices", {})
    row["rejected"] = res.get("rejected", {})
    msgs = _count_messages(row["server_received"]) + _count_messages(row["server_sent"])
    row["server_messages"] = msgs
    row["server_us_per_msg"] = round(row["server_cpu_s"] * 1e6 / msgs, 1) if msgs else None
    return row


def _r(v: Any, nd: int = 3) -> float | None:
    return None if v is None else round(float(v), nd)


def _last_line(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
        return lines[-1].split(": ", 1)[-1] if lines else ""
    except OSError:
        return ""


def _progress(n: int, t: float, text: str) -> None:
    print(f"[fleet N={n} {t:7.1f} s] {text}", file=sys.stderr, flush=True)


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [("devices", "devices"), ("register_s", "register s"), ("sketch_s", "sketches s"),
            ("cluster_s", "cluster s"), ("round_s", "rounds s"), ("final_eval_s", "final eval s"),
            ("clusters", "clusters"), ("ari", "ARI"), ("lost", "lost"), ("server_cpu_s", "server CPU s"),
            ("server_us_per_msg", "server us/msg"), ("server_peak_rss_mb", "server peak MB"),
            ("broker_cpu_s", "broker CPU s"), ("broker_peak_rss_mb", "broker peak MB"),
            ("emulator_cpu_s", "emulator CPU s"), ("broker_drop_lines", "broker drops")]
    print("| " + " | ".join(h for _, h in cols) + " |")
    print("|" + "|".join(" ---: " for _ in cols) + "|")
    for row in rows:
        cells = []
        for key, _ in cols:
            v = row.get(key)
            if isinstance(v, list):
                v = "/".join(f"{x:g}" for x in v)
            cells.append("-" if v is None else str(v))
        print("| " + " | ".join(cells) + " |")
    for row in rows:
        recv, sent = row.get("server_received") or {}, row.get("server_sent") or {}
        if recv or sent:
            kinds = sorted(set(recv) | set(sent))
            parts = [f"{k} in {recv.get(k, {}).get('messages', 0)}/{recv.get(k, {}).get('bytes', 0)} B, "
                     f"out {sent.get(k, {}).get('messages', 0)}/{sent.get(k, {}).get('bytes', 0)} B" for k in kinds]
            print(f"N={row['devices']} messages/bytes at the server: " + "; ".join(parts))
        why = incomplete(row)
        if why:
            print(f"N={row['devices']}: not a measurement: {why} (its timings are left out of the last line)")


#: Figures that are timings or rates: a run that lost a device, or whose server failed, reports them as null.
TIMED = ("register_s", "sketch_s", "cluster_s", "server_us_per_msg")


def incomplete(row: dict[str, Any]) -> str | None:
    """Why a size's run is not a measurement (a device lost, the server failed), or None."""
    if row.get("error"):
        return str(row["error"])
    if row.get("server_rc") != 0:
        return f"the server exited with {row.get('server_rc')}"
    if row.get("lost") != 0:
        return f"{row.get('lost')} device(s) lost"
    return None


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The last line's figures; a run that is :func:`incomplete` gives no timing, and says why."""
    rows = [{**r, **dict.fromkeys(TIMED)} if incomplete(r) else r for r in rows]
    by_n = {r["devices"]: r for r in rows}
    out: dict[str, Any] = {}
    for n in KEY_SIZES:
        r = by_n.get(n, {})
        out[f"register_s_{n}"] = r.get("register_s")
        if n == 3550:
            for key in ("sketch_s", "cluster_s", "ari", "lost"):
                out[f"{key}_{n}"] = r.get(key)
        else:
            out[f"ari_{n}"] = r.get("ari")
            out[f"server_us_per_msg_{n}"] = r.get("server_us_per_msg")
    for r in rows:
        n = r["devices"]
        for key in ("register_s", "sketch_s", "cluster_s", "ari", "lost", "server_us_per_msg", "metrics_ms_p50",
                    "metrics_ms_max", "page_ms_p50", "scrapes"):
            out.setdefault(f"{key}_{n}", r.get(key))
    for r in rows:
        why = incomplete(r)
        if why:
            out[f"incomplete_{r['devices']}"] = why
    out["broker"] = rows[0].get("broker") if rows else None
    out["sizes"] = [r["devices"] for r in rows]
    return out


def build_parser() -> argparse.ArgumentParser:
    """The options (benchmarks/watch.py runs this fleet with them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100,1000,3550,10000", help="fleet sizes, comma-separated")
    p.add_argument("--quick", action="store_true", help="one fleet of 100 devices")
    p.add_argument("--out", default="reports/fleet", help="results folder")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=75, help="devices trained per round (about)")
    p.add_argument("--min-samples", type=int, default=30)
    p.add_argument("--max-samples", type=int, default=60)
    p.add_argument("--processes", type=int, default=None,
                   help="emulator processes (default: 1 up to 4,000 devices, else 2)")
    p.add_argument("--loops", type=int, default=2, help="network loops per emulator process")
    p.add_argument("--steppers", type=int, default=2,
                   help="threads per emulator process running the devices' commands (sketch, train, evaluate)")
    p.add_argument("--hello-jitter", type=float, default=0.0,
                   help="devices' boot hello jitter (s); they answer the server's hello at once either way")
    p.add_argument("--timeout", type=float, default=300.0, help="the server's phase deadlines (s)")
    p.add_argument("--broker", choices=("mosquitto", "nats"), default="mosquitto",
                   help="Mosquitto (deploy/mosquitto.conf) or the three-node NATS cluster (deploy/nats/), "
                        "devices spread over its nodes")
    p.add_argument("--device-qos", type=int, choices=(0, 1), default=None,
                   help="QoS of the devices' subscriptions (fedsketch-client --subscribe-qos; default: 0 on NATS, "
                        "where a QoS 1 subscription is a JetStream consumer, 1 on Mosquitto)")
    p.add_argument("--connect-window", type=int, default=64,
                   help="devices connecting, and devices subscribing, at once per emulator process")
    p.add_argument("--connect-timeout", type=float, default=120.0,
                   help="seconds a device may take to connect and subscribe (the fleet's start waits this "
                        "long plus 120 s)")
    p.add_argument("--max-connections", type=int, default=None,
                   help="the broker's max_connections instead of the shipped 12,000 (for fleets past it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-s", type=float, default=5.0, help="seconds between progress lines (stderr)")
    p.add_argument("--watch", choices=("metrics", "page"), default=None,
                   help="start the server with --metrics-port and read /metrics every second (page: and the live "
                        "page every 2 s), timing each answer")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="one more fedsketch-server argument (repeatable), e.g. --server-arg=--min-cluster-size=20")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from server_kit.broker import find_mosquitto, find_nats_server

    if (find_nats_server() if args.broker == "nats" else find_mosquitto()) is None:
        print(f"fleet.py: {'nats-server' if args.broker == 'nats' else 'mosquitto'} is not installed", file=sys.stderr)
        return 2
    sizes = [100] if args.quick else [int(s) for s in args.sizes.split(",") if s.strip()]
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sizes:
        t0 = time.monotonic()
        row = run_size(n, args, out)
        row["wall_s"] = round(time.monotonic() - t0, 1)
        rows.append(row)
        _progress(n, row["wall_s"], f"done: register {row.get('register_s')} s, sketches {row.get('sketch_s')} s, "
                                    f"cluster {row.get('cluster_s')} s, ARI {row.get('ari')}, lost {row.get('lost')}")
        (out / "results.json").write_text(json.dumps({"rows": rows, "args": vars(args)}, indent=1))
    print_table(rows)
    print(f"results: {out / 'results.json'}; each size's server log, broker log and report: "
          + ", ".join(str(out / f"n{r['devices']}" / "report" / "report.html") for r in rows))
    s = summary(rows)
    print(json.dumps(s))
    return 0 if all(r.get("server_rc") == 0 for r in rows) else 1


def _clip(text: str, width: int) -> str:
    """``text`` cut at a word before ``width`` characters, with an ellipsis when cut."""
    if len(text) <= width:
        return text
    return text[: text.rfind(" ", 0, width - 1) if " " in text[: width - 1] else width - 1].rstrip(" ,;:(") + "…"


if __name__ == "__main__":
    raise SystemExit(main())
