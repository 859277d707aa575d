"""Rounds that close on time: the report goal, spares, refusals known to the round, bounded progress claims.

The rules, on an injected clock (no broker, no sleeps): :class:`RoundWait`
and :func:`wait_round` driven by a scripted pump. Then the whole thing in a
federation of 12 devices over Mosquitto, three of them a malformed sender, an
endless "still training" and an honest device slower than the deadline.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from edge_sdk.tasks import Task, TrainSettings
from edge_sdk.transport import BrokerConfig, MqttTransport
from server_kit.broker import MosquittoBroker, find_mosquitto
from server_kit.drivers import Orchestrator, ServerConfig
from server_kit.drivers.phase import Phase, RunPhase
from server_kit.rounds.answers import GoalWait, wait_answers
from server_kit.rounds.closing import ClosePolicy, wait_round
from server_kit.rounds.goals import goal_count
from server_kit.rounds.pace import Pace
from server_kit.rounds.plan import plan_tasks, spare_count
from server_kit.rounds.round_wait import CloseReason, DeviceOutcome, RoundWait
from server_kit.stallers import STALLERS, run_and_release, start_devices
from server_kit.strategies.fedsketch import SketchClustered

from helpers import ARCH, ari_against

needs_mosquitto = pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto is not installed")


# -- the rules, on a scripted clock -------------------------------------------------------------


class Script:
    """A clock and a pump that play scripted events: ``at(t, fn)`` runs ``fn()`` when the clock reaches ``t``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events: list[tuple[float, int, object]] = []
        self.pumped: list[tuple[float, float]] = []

    def clock(self) -> float:
        return self.now

    def at(self, t: float, fn) -> None:
        self.events.append((t, len(self.events), fn))
        self.events.sort(key=lambda e: (e[0], e[1]))

    def pump(self, until, timeout: float) -> bool:
        self.pumped.append((self.now, timeout))
        end = self.now + timeout
        while True:
            if until():
                return True
            if not self.events or self.events[0][0] > end:
                self.now = max(self.now, end)
                return until()
            t, _, fn = self.events.pop(0)
            self.now = max(self.now, t)
            fn()


def tasks(groups: dict[str, list[str]], spares: dict[str, list[str]] | None = None) -> list[Task]:
    out = [Task(c, 1, {k: {}}) for k, cids in groups.items() for c in cids]
    return out + [Task(c, 1, {k: {}}, spare=True) for k, cids in (spares or {}).items() for c in cids]


POLICY = ClosePolicy(deadline_s=60.0, max_round_s=600.0, progress_grace_s=30.0, straggler_grace=0.2)


def test_the_report_goal_is_per_group_and_counts_valid_and_refused_answers():
    s = Script()
    w = RoundWait(1, tasks({"c0": ["a", "b"], "c1": ["d", "e"]}, {"c0": ["c"], "c1": ["f"]}),
                  online={"a", "b", "c", "d", "e", "f"}, report_goal=1.0, clock=s.clock)
    assert {g[0]: (grp.needed, grp.goal, len(grp.members)) for g, grp in w.groups.items()} == {
        "c0": (2, 2, 3), "c1": (2, 2, 3)}
    s.now = 1.0
    w.answer("update", "a")
    w.answer("update", "b")
    assert not w.goal_met()  # c1 has nothing yet
    s.now = 2.0
    w.answer("update", "d")
    assert w.refuse("e", "meta") and not w.refuse("zz", "meta")  # a refusal is an answer; an untasked id nothing
    assert w.goal_met() and w.goal_s == 2.0 and w.left == {"c", "e", "f"}  # e keeps its place
    s.now = 2.5
    w.answer("update", "e")  # a valid update after the refusal still counts
    assert not w.was_refused("e") and w.outcome("e", lambda c: True) is DeviceOutcome.REPORTED
    assert w.outcome("c", lambda c: True) is DeviceOutcome.STRAGGLER
    assert w.outcome("f", lambda c: False) is DeviceOutcome.OFFLINE


def test_a_refused_device_holds_no_round_past_its_goal():
    s = Script()
    w = RoundWait(1, tasks({"g": ["a", "b", "c"]}), online={"a", "b", "c"}, report_goal=1.0, clock=s.clock)
    s.at(0.5, lambda: w.refuse("c", "non-finite"))  # the broken device answers at once, with garbage
    s.at(4.0, lambda: w.answer("update", "a"))
    s.at(5.0, lambda: w.answer("update", "b"))
    close = wait_round(s.pump, w, POLICY, Pace(), claims=dict, clock=s.clock)
    # goal (3 answers) at 5 s; grace max(0.2 x 5, 0.2) = 1 s for c's place; closed at 6 s, not at the 60 s deadline
    assert close.reason is CloseReason.GOAL and close.goal_s == 5.0 and close.close_s == pytest.approx(6.0)
    rec = w.record(close, lambda c: True)
    assert rec.refused == {"c": "non-finite"} and rec.reported == 2 and rec.stragglers == ()


def test_spares_let_the_round_close_at_its_goal_and_drop_the_stragglers():
    s = Script()
    w = RoundWait(1, tasks({"g": ["a", "b"]}, {"g": ["c"]}), online={"a", "b", "c"}, report_goal=1.0,
                  clock=s.clock)
    s.at(3.0, lambda: w.answer("update", "a"))
    s.at(4.0, lambda: w.answer("update", "c"))  # the spare counts like any device
    s.at(100.0, lambda: w.answer("update", "b"))  # a stalled SD card
    close = wait_round(s.pump, w, POLICY, Pace(), claims=dict, clock=s.clock)
    assert close.reason is CloseReason.GOAL and close.close_s == pytest.approx(4.8)  # 4 s + 20 %
    assert w.record(close, lambda c: True).stragglers == ("b",)


def test_everybody_answering_closes_at_once_as_before():
    s = Script()
    w = RoundWait(1, tasks({"g": ["a", "b"]}), online={"a", "b"}, clock=s.clock)
    s.at(3.0, lambda: w.answer("update", "a"))
    s.at(7.0, lambda: w.answer("update", "b"))
    close = wait_round(s.pump, w, POLICY, Pace(), claims=dict, clock=s.clock)
    assert close.reason is CloseReason.ALL_ANSWERED and close.close_s == 7.0


def test_progress_claims_extend_a_round_only_as_long_as_the_devices_past_rounds_make_plausible():
    pace = Pace()
    claims: dict[str, tuple[int, float]] = {}
    # round 1: a takes 10 s, b claims forever and never sends anything
    s = Script()
    w = RoundWait(1, tasks({"g": ["a", "b"]}), online={"a", "b"}, report_goal=1.0, clock=s.clock)
    s.at(10.0, lambda: (w.answer("update", "a"), pace.note_update(w, "a")))
    for t in range(0, 600, 5):  # "training round 1" every 5 s
        s.at(float(t), lambda t=t: claims.__setitem__("b", (1, float(t))))
    close = wait_round(s.pump, w, POLICY, pace, claims=lambda: claims, clock=s.clock)
    # past the 60 s deadline b's claims are bounded by its group's measured time: 2 x 10 s < 60 s: no extension
    assert close.reason is CloseReason.DEADLINE and close.close_s == 60.0 and close.extended_by == frozenset()
    assert pace.plausible_s("b", ("g",)) == 20.0 and pace.device_s == {"a": 10.0}

    # round 2: b is slow but plausible (its group took 40 s): extends, then sends; c claims and never sends
    pace.group_s[("g",)] = 40.0
    s = Script()
    claims.clear()
    w = RoundWait(2, [Task(c, 2, {"g": {}}) for c in ("b", "c")], online={"b", "c"}, clock=s.clock)
    for t in range(0, 600, 5):
        s.at(float(t), lambda t=t: claims.update({"b": (2, float(t)), "c": (2, float(t))}))
    s.at(70.0, lambda: w.answer("update", "b"))
    deadline = ClosePolicy(deadline_s=30.0, max_round_s=600.0, progress_grace_s=30.0, straggler_grace=0.2)
    close = wait_round(s.pump, w, deadline, pace, claims=lambda: claims, clock=s.clock)
    # b's update at 70 s ends the goal? no: c is still awaited; c's claim stays plausible until 2 x 40 = 80 s
    assert close.reason is CloseReason.DEADLINE and close.close_s == pytest.approx(80.01, abs=0.02)
    assert close.extended_by == frozenset({"b", "c"})
    pace.after_round(w, close.extended_by, online=lambda c: True)
    assert pace.no_extension == {"c": 2}  # its claims ended in no update: no more extensions this run
    assert not pace.may_extend("c", ("g",), 1.0) and pace.may_extend("b", ("g",), 1.0)


def test_the_cap_ends_a_round_whatever_is_claimed():
    s = Script()
    claims = {}
    w = RoundWait(1, tasks({"g": ["a"]}), online={"a"}, clock=s.clock)
    for t in range(0, 1000, 5):
        s.at(float(t), lambda t=t: claims.__setitem__("a", (1, float(t))))
    policy = ClosePolicy(deadline_s=10.0, max_round_s=100.0, progress_grace_s=30.0, straggler_grace=0.2)
    close = wait_round(s.pump, w, policy, Pace(), claims=lambda: claims, clock=s.clock)
    assert close.reason is CloseReason.CAP and close.close_s == 100.0  # nothing measured: the cap alone bounds it


def test_a_device_refused_in_rounds_in_a_row_is_benched():
    pace = Pace(bench_after=2)
    for rnd, refused in ((1, True), (2, False), (3, True), (4, True)):
        w = RoundWait(rnd, [Task("x", rnd, {"g": {}})], online={"x"})
        if refused:
            w.refuse("x", "meta")
        else:
            w.answer("update", "x")
        benched = pace.after_round(w, (), online=lambda c: True)
        assert benched == (["x"] if rnd == 4 else [])
    assert pace.benched == {"x": "update refused in 2 rounds in a row (last, round 4: meta)"}
    restored = Pace()
    restored.load_state(pace.state())
    assert restored.benched == pace.benched and restored.unusable_streak == {"x": 2}
    old = {k: v for k, v in pace.state().items() if k not in ("unusable_streak", "silent_streak")}
    restored.load_state({**old, "refused_streak": {"x": 1}})  # a checkpoint written before silence counted
    assert restored.unusable_streak == {"x": 1} and restored.silent_streak == {}
    with pytest.raises(ValueError, match="bench_after must be >= 0, got -1"):
        Pace(bench_after=-1)


def after_rounds(pace: Pace, script: list[str], cid: str = "x") -> list[list[str]]:
    """Rounds 1, 2, ... of ``cid`` alone: "valid", "refused", "silent" (online, no update) or "offline"."""
    out = []
    for rnd, what in enumerate(script, 1):
        w = RoundWait(rnd, [Task(cid, rnd, {"g": {}})], online={cid})
        if what == "valid":
            w.answer("update", cid)
        elif what == "refused":
            w.refuse(cid, "meta")
        out.append(pace.after_round(w, (), online=lambda c, what=what: what != "offline"))
    return out


def test_a_silent_device_is_benched_and_an_offline_one_is_not():
    pace = Pace(bench_after=3)
    assert after_rounds(pace, ["silent"] * 3) == [[], [], ["x"]]
    assert pace.benched == {"x": "no answer in 3 rounds in a row (last, round 3: silent)"}
    assert after_rounds(pace, ["silent"]) == [[]]  # benched once, logged once
    away = Pace(bench_after=3)
    assert after_rounds(away, ["offline"] * 5) == [[]] * 5 and away.benched == {} and away.unusable_streak == {}
    mixed = Pace(bench_after=3)  # refusals and silence make one streak; an offline round neither ends nor adds
    assert after_rounds(mixed, ["refused", "offline", "silent", "refused"])[-1] == ["x"]
    assert mixed.benched == {"x": "no usable answer in 3 rounds in a row (1 silent, 2 refused; last, round 4: meta)"}
    restored = Pace()
    restored.load_state(mixed.state())
    assert (restored.unusable_streak, restored.silent_streak) == ({"x": 3}, {"x": 1})


def test_a_valid_update_ends_the_streak_of_silence():
    pace = Pace(bench_after=3)
    assert after_rounds(pace, ["silent", "silent", "valid", "silent", "silent"]) == [[]] * 5
    assert pace.benched == {} and pace.unusable_streak == {"x": 2} and pace.silent_streak == {"x": 2}


def test_the_final_evaluation_closes_at_its_goals_without_the_silent_device():
    s = Script()
    big = [f"a{i}" for i in range(11)]  # a10 offline: not waited for; 9 of the 10 online meet the goal
    small = ["b0", "b1", "b2"]  # fewer than 10: all three
    awaited = GoalWait("metrics", dict.fromkeys(big, "k0") | dict.fromkeys(small, "k1"),
                       online=set(big + small) - {"a10"}, report_goal=ServerConfig().report_goal)
    assert awaited.goals == {"k0": 9, "k1": 3}
    for i, c in enumerate(big[:9] + small):  # a9 stays silent
        s.at(1.0 + i, lambda c=c: awaited.answer("metrics", c))
    close = wait_answers(s.pump, awaited, timeout_s=60.0, straggler_grace=0.2, clock=s.clock)
    # every goal at 12 s, then a grace of 0.2 x 12 s: closed at 14.4 s, not at the 60 s timeout
    assert close.reason is CloseReason.GOAL and close.goal_s == 12.0 and close.close_s == pytest.approx(14.4)
    assert awaited.left == {"a9"}


def test_a_small_final_evaluation_waits_for_every_device_as_before():
    s = Script()
    awaited = GoalWait("metrics", {"a": "k0", "b": "k0", "c": "k0"}, online={"a", "b", "c"}, report_goal=0.9)
    s.at(1.0, lambda: awaited.answer("metrics", "a"))
    s.at(2.0, lambda: awaited.answer("metrics", "b"))
    close = wait_answers(s.pump, awaited, timeout_s=60.0, straggler_grace=0.2, clock=s.clock)
    assert close.reason is CloseReason.DEADLINE and close.close_s == 60.0  # c is waited for until the timeout
    s = Script()
    awaited = GoalWait("metrics", {"a": "k0", "b": "k0"}, online={"a", "b"}, report_goal=0.9)
    s.at(1.0, lambda: awaited.answer("metrics", "a"))
    s.at(2.0, lambda: awaited.answer("metrics", "b"))
    close = wait_answers(s.pump, awaited, timeout_s=60.0, straggler_grace=0.2, clock=s.clock)
    assert close.reason is CloseReason.ALL_ANSWERED and close.close_s == 2.0  # at once: nobody left


def test_the_default_rule_leaves_small_groups_as_they_were():
    from server_kit.strategies.base import ClientInfo

    config = ServerConfig()
    assert (config.report_goal, config.over_select) == (0.9, None)
    # every update below 10 needed, 90 % (rounded up) from 10 on
    assert [goal_count(config.report_goal, n) for n in (1, 5, 9, 10, 20, 70)] == [1, 5, 9, 9, 18, 63]
    w = RoundWait(1, tasks({"g": [f"a{i}" for i in range(9)], "h": [f"b{i}" for i in range(20)]}), online=(),
                  report_goal=config.report_goal)
    assert {g[0]: grp.goal for g, grp in w.groups.items()} == {"g": 9, "h": 18}
    # spares only from groups that need 10 devices; a value given applies to every group, as before
    assert [spare_count(n, None) for n in (1, 9, 10, 19, 20)] == [0, 0, 1, 2, 2]
    assert spare_count(2, 0.3) == 1 and spare_count(20, 0.0) == 0
    s = SketchClustered(fraction=0.5, seed=3)
    cids = [f"c{i:02d}" for i in range(38)]
    s.setup([ClientInfo(c, 10) for c in cids], {"w": np.zeros(2, np.float32)})
    s.set_assignment({c: int(i >= 18) for i, c in enumerate(cids)})  # 18 and 20 devices: 9 and 10 needed
    base = s.configure_round(2, cids)
    planned = plan_tasks(s, 2, cids, over_select=config.over_select)
    assert planned[:len(base)] == base
    assert sorted(s.assignment[t.cid] for t in planned[len(base):]) == [1]  # one spare, in the cluster of 10


def test_screening_refusals_count_as_refused():
    w = RoundWait(1, [Task("x", 1, {"g": {}}), Task("y", 1, {"g": {}})], online={"x", "y"})
    w.answer("update", "x")
    w.answer("update", "y")
    w.screen({"x": "screening: its delta norm is not finite", "zz": "never tasked"})
    assert w.was_refused("x") and not w.was_refused("y") and w.refusals == {
        "x": "screening: its delta norm is not finite"}


def test_the_run_moves_through_its_phases_in_one_order():
    run = RunPhase()
    assert run.phase is Phase.REGISTER and run.round == 0 and run.phase.registering
    run.enter(Phase.CLUSTER, rnd=0)
    with pytest.raises(RuntimeError, match="^a run cannot go from cluster to pretrain$"):
        run.enter(Phase.PRETRAIN)
    with pytest.raises(RuntimeError, match="^no round begins in the cluster phase$"):
        run.begin_round(1)
    run.enter(Phase.TRAIN, rnd=0)
    run.begin_round(3)
    assert run.round == 3 and run.phase.trains
    run.enter(Phase.EVALUATE, rnd=4)
    assert run.phase.trains and run.round == 4
    run.enter(Phase.DONE)
    with pytest.raises(RuntimeError, match="^a run cannot go from done to train$"):
        run.enter(Phase.TRAIN)


def test_spares_are_drawn_from_the_same_cluster_on_top_of_the_strategys_own_sample():
    from server_kit.strategies.base import ClientInfo

    s = SketchClustered(fraction=0.5, seed=3)
    cids = [f"c{i:02d}" for i in range(12)]
    s.setup([ClientInfo(c, 10) for c in cids], {"w": np.zeros(2, np.float32)})
    s.set_assignment({c: i % 3 for i, c in enumerate(cids)})
    base = s.configure_round(2, cids)
    assert plan_tasks(s, 2, cids) == base  # no spares: exactly today's tasks
    planned = plan_tasks(s, 2, cids, over_select=0.5)
    assert planned[:len(base)] == base
    spares = planned[len(base):]
    assert all(t.spare for t in spares) and not any(t.spare for t in base)
    per = {k: [t for t in planned if list(t.models) == [s.key(k)]] for k in range(3)}
    # 4 per cluster, 2 needed, 1 spare each (ceil(2 x 1.5) - 2), from the same cluster
    assert {k: (sum(not t.spare for t in ts), sum(t.spare for t in ts)) for k, ts in per.items()} == {
        0: (2, 1), 1: (2, 1), 2: (2, 1)}
    assert all(s.assignment[t.cid] == k for k, ts in per.items() for t in ts)
    assert len({t.cid for t in planned}) == len(planned)
    assert plan_tasks(s, 2, cids, over_select=0.5) == planned  # seeded
    assert [t.cid for t in plan_tasks(s, 3, cids, over_select=0.5)] != [t.cid for t in planned]


def test_server_config_refuses_bad_closing_settings():
    with pytest.raises(ValueError, match=r"^over_select must be in \[0, 10\], got -0.1$"):
        ServerConfig(over_select=-0.1)
    with pytest.raises(ValueError, match=r"^bench_after must be an integer >= 0, got 1.5$"):
        ServerConfig(bench_after=1.5)
    with pytest.raises(ValueError, match=r"^straggler_grace must be in \[0, 10\], got 11$"):
        ServerConfig(straggler_grace=11)


# -- a federation over Mosquitto with three devices that would hold its rounds open ------------------


ROUNDS, DEADLINE = 3, 25.0


def federation(clients, acl, *, stallers: bool):
    """12 devices over Mosquitto with the shipped ACL; with ``stallers``, c00, c01 and c02 of server_kit.stallers."""
    fed = "pace"
    release = threading.Event()
    passwords = {c.cid: f"pw-{c.cid}" for c in clients} | {"server": "pw-server"}
    with MosquittoBroker(acl=acl(fed), passwords=passwords) as broker:
        def make(cid):
            cfg = BrokerConfig.from_url(broker.url, username=cid, password=passwords[cid], reconnect_min_s=0.1)
            return MqttTransport(cfg, cid, federation=fed)

        threads = start_devices(clients, make, architecture=ARCH, release=release, stallers=stallers,
                                max_idle_s=120)
        server = make("server")
        server.connect(timeout=10)

        def on_round(rec):
            if rec["round"] == ROUNDS:
                release.set()  # the stallers let go, so that the final evaluation hears everybody

        strategy = SketchClustered(settings=TrainSettings(epochs=3, lr=1e-2, batch_size=16), fraction=0.5,
                                   min_cluster_size=2, seed=0)
        config = ServerConfig(federation=fed, rounds=ROUNDS, min_clients=12, register_timeout_s=30,
                              sketch_timeout_s=30, round_timeout_s=DEADLINE, first_round_timeout_s=DEADLINE,
                              eval_timeout_s=60, encoder="digits_encoder", architecture=ARCH, seed=0,
                              over_select=0.5, report_goal=1.0, bench_after=2)
        return run_and_release(Orchestrator(strategy, server, config, on_round=on_round), release, threads)


@needs_mosquitto
def test_one_slow_lying_or_broken_device_holds_no_round_open(digits12, shipped_acl):
    # c00 (rotation 0) sends malformed updates, c01 (90) claims progress forever, c02 (180) is slow and honest
    assert set(STALLERS) == {"c00", "c01", "c02"}
    clean = federation(digits12, shipped_acl, stallers=False)
    result = federation(digits12, shipped_acl, stallers=True)
    deadline = DEADLINE
    assert all(h["close"] in ("all-answered", "goal") for h in clean.history)
    print(f"final accuracy: clean {clean.final['accuracy']:.3f}, with the stallers {result.final['accuracy']:.3f}; "
          f"rounds {[h['close_s'] for h in clean.history]} s and {[h['close_s'] for h in result.history]} s")
    truth = {c.cid: c.group for c in digits12}
    assert ari_against(truth, result.assignment) == 1.0
    honest = {c.cid for c in digits12} - {"c00", "c01", "c02"}
    for rec in result.history:
        # per cluster: 3 devices, 2 needed (fraction 0.5), 1 spare, goal 2
        goals = rec["goals"]
        assert all(g["needed"] in (1, 2) and g["goal"] == g["needed"] for g in goals.values()), goals
        # the goal is reached by the honest devices' updates (and the broken one's refusal, an answer too);
        # the round closes within the grace of the honest update that completed the last goal
        honest_s = sorted(s for c, s in rec["reported_s"].items() if c in honest)
        assert rec["close"] in ("goal", "all-answered"), rec["close"]
        assert rec["goal_s"] is not None and rec["goal_s"] <= honest_s[-1]
        assert rec["close_s"] <= rec["goal_s"] + max(0.2 * rec["goal_s"], 0.2) + 1.0, rec
        assert rec["close_s"] < deadline  # nobody waited for the deadline
        assert rec["extended_by"] == []  # past the goal, no claim extends a round
        assert set(rec["reported_s"]) <= honest and rec["updates"] == rec["reported"] == len(rec["reported_s"])
        assert "c01" not in rec["reported_s"] and "c02" not in rec["reported_s"]
    r1, r2, r3 = result.history
    assert set(r1["refused"]) == {"c00"} and r1["refused"]["c00"] == "meta"
    assert set(r2["refused"]) == {"c00"}, r2["refused"]
    # benched after 2 rounds in a row: c00 refused, c01 and c02 without an update by the close
    assert {"c01", "c02"} <= set(r1["stragglers"]) and {"c01", "c02"} <= set(r2["stragglers"])
    assert "c00" not in r3["refused"] and r3["selected"] == 9
    assert result.benched == {"c00": result.benched["c00"],
                              "c01": "no answer in 2 rounds in a row (last, round 2: silent)",
                              "c02": "no answer in 2 rounds in a row (last, round 2: silent)"}
    assert result.benched["c00"].startswith("update refused in 2 rounds in a row")
    # accuracy and clusters as without them (whose clusters train on 2 devices instead of 3). Measured: clean
    # 0.842-0.856, with the stallers 0.825-0.855, stallers minus clean -0.031 to +0.013, over three runs, default
    # and alt FP path; bounds -0.05 and 0.75
    assert ari_against(truth, clean.assignment) == 1.0
    assert result.final["accuracy"] >= clean.final["accuracy"] - 0.05 and result.final["accuracy"] > 0.75
