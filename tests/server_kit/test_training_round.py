"""A training round end to end with a scripted port and clock: no broker, no network, real strategy and screening."""

from __future__ import annotations

import time

import numpy as np

from edge_sdk.tasks import Task, Update
from server_kit.rounds.closing import ClosePolicy, wait_round
from server_kit.rounds.pace import Pace
from server_kit.rounds.round_wait import RoundWait
from server_kit.rounds.training import RoundReport, TrainingRound
from server_kit.strategies.base import ClientInfo
from server_kit.strategies.fedavg import FedAvg

DEVICES = [f"d{i}" for i in range(6)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ScriptedIntake:
    """The intake's part in a round: what it records as the port lets answers in."""

    def __init__(self, clock) -> None:
        self.clock, self.updates, self.held_elsewhere, self.tasked, self.wait = clock, {}, {}, set(), None

    def open_round(self, rnd, tasks, online, *, report_goal=1.0):
        self.updates, self.tasked = {}, {t.cid for t in tasks}
        self.wait = RoundWait(rnd, tasks, online, report_goal=report_goal, clock=self.clock)
        return self.wait

    def close_round(self):
        self.wait = None

    def arrivals(self):
        return [self.updates[c] for c in sorted(self.updates)], []


class ScriptedPort:
    """Each device answers after its scripted delay with its scripted change; ``silent`` never answers."""

    def __init__(self, intake, clock, changes, delays, silent=()) -> None:
        self.intake, self.clock, self.changes, self.delays, self.silent = intake, clock, changes, delays, set(silent)
        self.sent: list[tuple[int, list[str]]] = []
        self.benched: dict[str, str] = {}
        self.tasks: dict[str, Task] = {}

    def online_ids(self):
        return set(DEVICES)

    def send(self, rnd, tasks):
        self.sent.append((rnd, sorted(t.cid for t in tasks)))
        self.tasks = {t.cid: t for t in tasks}
        return 100 * len(tasks), {"cluster_topic": 1, "per_device": 0}

    def pump(self, until, timeout):
        """The answers due within ``timeout``, in their order; the clock moves to each, then to the timeout."""
        end = self.clock.now + timeout
        for cid in sorted(self.tasks, key=lambda c: self.delays[c]):
            if until():
                return True
            wait = self.intake.wait
            if cid in self.silent or cid not in wait.left or self.delays[cid] > end:
                continue
            self.clock.now = max(self.clock.now, self.delays[cid])
            t = self.tasks[cid]
            w = {n: v + self.changes[cid] for n, v in t.models["global"].items()}
            self.intake.updates[cid] = Update(cid, t.round, "global", w, 10, 0.5, {"acc_before": 0.25})
            wait.answer("update", cid)
        if until():
            return True
        self.clock.now = end
        return until()

    def wait(self, rnd, wait):
        policy = ClosePolicy(deadline_s=30.0, max_round_s=300.0, progress_grace_s=5.0, straggler_grace=0.5)
        return wait_round(self.pump, wait, policy, Pace(), lambda: {}, clock=self.clock)

    def remote(self):
        return None

    def bench(self, cid, reason):
        self.benched[cid] = reason


def one_round(changes, delays, silent=(), report_goal=1.0) -> tuple[RoundReport, FedAvg, ScriptedPort]:
    strategy = FedAvg(seed=0)
    strategy.setup([ClientInfo(c, n_samples=10) for c in DEVICES], {"w": np.zeros((2, 3), np.float32)})
    clock = Clock()
    intake = ScriptedIntake(clock)
    port = ScriptedPort(intake, clock, changes, delays, silent)
    rnd = TrainingRound(strategy, intake, port, Pace(), report_goal=report_goal, clock=clock)
    return rnd.run(1, DEVICES), strategy, port


def test_a_round_plans_sends_waits_combines_and_reports():
    t0 = time.monotonic()
    changes = {c: float(i) for i, c in enumerate(DEVICES)}
    report, strategy, port = one_round(changes, {c: 1.0 + i for i, c in enumerate(DEVICES)})
    assert port.sent == [(1, DEVICES)]
    assert report.updates == report.tasked == 6 and report.missing == ()
    # FedAvg of the six equal-weight changes 0..5 (none clipped: each within the bound of the median norm)
    np.testing.assert_array_equal(strategy.models["global"]["w"], np.full((2, 3), 2.5, np.float32))
    rec = report.to_dict()
    assert rec["close"] == "all-answered" and rec["reported"] == 6 and rec["stragglers"] == []
    assert rec["acc_before"] == 0.25 and rec["loss"] == 0.5 and rec["model_bytes_delivered"] == 600
    assert rec["reported_s"] == {c: 1.0 + i for i, c in enumerate(DEVICES)}
    assert time.monotonic() - t0 < 1.0


def test_a_silent_device_is_missing_and_the_round_closes_at_its_deadline():
    changes = dict.fromkeys(DEVICES, 1.0)
    report, strategy, _ = one_round(changes, dict.fromkeys(DEVICES, 2.0), silent={"d5"})
    rec = report.to_dict()
    assert report.missing == ("d5",) and report.updates == 5
    assert rec["close"] == "deadline" and rec["stragglers"] == ["d5"] and rec["close_s"] == 30.0
    np.testing.assert_array_equal(strategy.models["global"]["w"], np.ones((2, 3), np.float32))


def test_nothing_arrived_leaves_the_model_and_says_so():
    report, strategy, _ = one_round(dict.fromkeys(DEVICES, 1.0), dict.fromkeys(DEVICES, 1.0), silent=set(DEVICES))
    assert report.updates == 0 and report.summary == {"updates": 0} and report.loss is None
    np.testing.assert_array_equal(strategy.models["global"]["w"], np.zeros((2, 3), np.float32))
