"""DP-FedAvg per cluster: the accountant, the clip and the noise, the budget that stops a cluster, the options."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk.tasks import TrainSettings, Update
from server_kit.cli import main
from server_kit.privacy.accountant import epsilon_after, noise_for_budget
from server_kit.privacy.dp import DPFedAvg, DPSettings
from server_kit.strategies import make_strategy
from server_kit.strategies.base import ClientInfo

from helpers import ARCH

SETTINGS = TrainSettings(epochs=3, lr=1e-2, batch_size=16)


@pytest.mark.parametrize("eps", [1.0, 8.0])
@pytest.mark.parametrize("q", [0.48, 1.0])
def test_the_noise_fitted_to_a_budget_is_the_smallest_that_keeps_it(eps, q):
    z = noise_for_budget(eps, 1e-5, 10, q)
    assert epsilon_after(10, q, z, 1e-5) <= eps < epsilon_after(10, q, 0.99 * z, 1e-5)


def test_accountant_composes_rounds_and_amplifies_by_sampling():
    assert epsilon_after(0, 0.5, 1.0, 1e-5) == 0.0
    assert epsilon_after(3, 0.5, 0.0, 1e-5) == math.inf
    one, ten = epsilon_after(1, 1.0, 2.0, 1e-5), epsilon_after(10, 1.0, 2.0, 1e-5)
    assert one < ten < 10 * one  # composition in RDP: less than adding the epsilons
    assert epsilon_after(10, 0.1, 2.0, 1e-5) < 0.5 * ten  # a tenth of the devices asked: far less spent
    with pytest.raises(ValueError, match="no noise multiplier up to 1000 keeps 10 rounds"):
        noise_for_budget(1e-9, 1e-5, 10, 1.0)


def _strategy(n_clients=6, fraction=1.0):
    s = make_strategy("fedavg", settings=SETTINGS, seed=0, architecture=ARCH, fraction=fraction)
    template = {"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}
    s.setup([ClientInfo(f"c{i}", 10) for i in range(n_clients)], template)
    return s


def _update(cid, w, b, n=10):
    return Update(cid, 1, "global", {"w": np.asarray(w, np.float32), "b": np.asarray(b, np.float32)}, n, 0.0)


def test_updates_are_clipped_weighed_alike_and_divided_by_the_planned_count():
    s = _strategy(4)
    s.dp = DPFedAvg(DPSettings(epsilon=1e9, clip=1.0, noise_multiplier=1e-3, rounds=10, noise_seed=0))
    ups = [_update("c0", [3, 4, 0, 0], [0, 0], n=1000),  # norm 5: clipped to 1 -> (0.6, 0.8)
           _update("c1", [0, 0, 0.5, 0], [0, 0], n=1),
           _update("c2", [np.nan, 0, 0, 0], [0, 0])]  # not finite: left out
    s.aggregate(1, ups)
    # sum of the clipped changes over the 4 planned devices (2 reported, equal weights)
    np.testing.assert_allclose(s.models["global"]["w"], [0.15, 0.2, 0.125, 0.0], atol=2e-3)  # noise sd 2.5e-4
    acct = s.dp.accounts["global"]
    assert (acct.rounds, acct.clipped, acct.members, acct.expected) == (1, 1, 4, 4)
    assert acct.epsilon == pytest.approx(epsilon_after(1, 1.0, 1e-3, 1e-5))


def test_noise_has_the_stated_spread():
    s = _strategy(4)
    s.dp = DPFedAvg(DPSettings(epsilon=1e6, clip=2.0, noise_multiplier=0.5, rounds=10, noise_seed=1))
    s.models["global"] = {"w": np.zeros(100_000, np.float32), "b": np.zeros(2, np.float32)}
    s.aggregate(1, [Update("c0", 1, "global", {"w": np.zeros(100_000, np.float32), "b": np.zeros(2, np.float32)},
                           5, 0.0)])
    sd = float(np.std(s.models["global"]["w"]))
    assert sd == pytest.approx(0.5 * 2.0 / 4, rel=0.02)  # z * clip / planned devices


def test_a_cluster_stops_at_its_budget_and_its_devices_are_not_asked():
    s = _strategy(4)
    s.dp = DPFedAvg(DPSettings(epsilon=3.0, clip=1.0, noise_multiplier=2.0, rounds=10, noise_seed=0))
    fits = max(r for r in range(1, 50) if epsilon_after(r, 1.0, 2.0, 1e-5) <= 3.0)
    for rnd in range(1, fits + 3):
        s.aggregate(rnd, [_update("c0", [0.1, 0, 0, 0], [0, 0])])
    acct = s.dp.accounts["global"]
    assert acct.rounds == fits and acct.epsilon <= 3.0
    assert acct.stopped.startswith(f"round {fits + 1}: one more round would bring epsilon to ")
    assert s.dp.stopped == {"global"}
    frozen = s.models["global"]["w"].copy()
    s.aggregate(fits + 5, [_update("c1", [1, 1, 1, 1], [0, 0])])
    np.testing.assert_array_equal(s.models["global"]["w"], frozen)
    # a checkpoint carries the accountant: a resumed run does not start a fresh budget
    meta, tensors = s.state()
    t = _strategy(4)
    t.dp = DPFedAvg(DPSettings(epsilon=3.0, clip=1.0, noise_multiplier=2.0, rounds=10))
    t.load_state(meta, tensors)
    assert t.dp.accounts["global"].rounds == fits and t.dp.stopped == {"global"}


@pytest.mark.parametrize("argv, message", [
    (["--dp-noise", "1.0"], "--dp-noise goes with --dp-epsilon (the budget its rounds are accounted against)"),
    (["--dp-epsilon", "0"], "--dp-epsilon must be a finite number > 0, got 0.0"),
    (["--dp-epsilon", "8", "--dp-delta", "1"], "--dp-delta must be in (0, 1), got 1.0"),
    (["--dp-epsilon", "8", "--dp-clip", "-1"], "--dp-clip must be a finite number > 0, got -1.0"),
    (["--dp-epsilon", "8", "--shared-base", "--architecture", "lenet5_1x28x28_10"],
     "--dp-epsilon accounts each cluster on its own; --shared-base averages layers over every cluster, which that "
     "accounting does not cover: leave --shared-base out"),
    (["--dp-epsilon", "8", "--aggregator", "median"],
     "--dp-epsilon clips and averages every update (DP-FedAvg); --aggregator median has another sensitivity: "
     "use fedavg"),
])
def test_options_that_do_not_fit_are_refused(argv, message, capsys):
    assert main(["--broker", "mqtt://127.0.0.1:1", *argv]) == 2
    assert capsys.readouterr().err.strip() == f"fedsketch-server: error: {message}"


def test_dp_in_the_simulator_reports_each_clusters_accountant(digits12):
    from edge_sdk.encoder import OnnxEncoder
    from server_kit.drivers.simulate import Simulator

    s = make_strategy("fedsketch", settings=SETTINGS, seed=0, architecture=ARCH, min_cluster_size=3)
    s.dp = DPFedAvg(DPSettings(epsilon=8.0, clip=5.0, rounds=3, noise_seed=0))
    res = Simulator(s, digits12, architecture=ARCH, encoder=OnnxEncoder("digits_encoder"), seed=0).run(3)
    dp = res.privacy["dp"]
    assert len(dp["clusters"]) == 4 and all(c["rounds"] == 3 for c in dp["clusters"].values())
    assert all(c["epsilon"] <= 8.0 and c["epsilon"] > 7.0 for c in dp["clusters"].values())
    assert res.privacy["sketch"]["epsilon_per_image"] == pytest.approx(20 * math.log(9.0), rel=1e-6)


def test_secure_sums_stop_at_the_budget_too():
    """A secure round hands the strategy one partial sum per cluster and no update: the budget still stops it."""
    from server_kit.rounds.arrivals import PartialSum

    s = _strategy(4)
    s.dp = DPFedAvg(DPSettings(epsilon=3.0, clip=1.0, noise_multiplier=2.0, rounds=10, noise_seed=0))
    fits = max(r for r in range(1, 50) if epsilon_after(r, 1.0, 2.0, 1e-5) <= 3.0)
    for rnd in range(1, fits + 3):
        w = {"w": np.full(4, 0.1, np.float32), "b": np.zeros(2, np.float32)}
        s.aggregate(rnd, [], partials=[PartialSum("secure", rnd, "global", w, 4, ("c0", "c1", "c2", "c3"))])
    acct = s.dp.accounts["global"]
    assert acct.rounds == fits and acct.epsilon <= 3.0 and s.dp.stopped == {"global"}
