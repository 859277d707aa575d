"""FedSketch strategies inside Flower: its Simulation Engine (Ray), the adapter, the device side, the records.

The federation is scikit-learn's digits in 4 rotation groups on 12 virtual
nodes (the ``digits12`` fixture); every Flower run is compared with
:class:`server_kit.drivers.Simulator` on the same partition and seeds.
Tolerance on accuracies: 0.005 (the issue's 0.5 points) per round; the runs
are in fact equal, since both drive the same strategy and worker code.
"""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")

from flwr.app import ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

from edge_sdk.flower import NodeData, client_app  # noqa: E402
from edge_sdk.flower import records as rec  # noqa: E402
from edge_sdk.protocol import ProtocolError  # noqa: E402
from edge_sdk.sketch import Sketch  # noqa: E402
from edge_sdk.tasks import Update  # noqa: E402
from server_kit.flower import FlowerRunConfig, FlowerStrategy, build_strategy, message_bytes  # noqa: E402
from server_kit.strategies import make_strategy  # noqa: E402

from helpers import ARCH  # noqa: E402

pytestmark = pytest.mark.slow
ROUNDS = 2  # round 2 starts from round 1's aggregate: enough to compare the runs round by round
TOL = 0.005


def _loader(clients):
    def load(context):
        i = int(context.node_config["partition-id"])
        c = clients[i]
        return NodeData(c.cid, c.x_train, c.y_train, c.x_test, c.y_test, index=i)

    return load


def run_flower(clients, name, *, rounds=ROUNDS, params=None, client=None, grid=lambda g: g, min_nodes=None):
    """Run strategy ``name`` on ``clients`` in Flower's simulation; the adapter (after its run)."""
    from flwr.simulation import run_simulation

    out = {}

    app = ServerApp()

    @app.main()
    def main(g, context):
        cfg = FlowerRunConfig.from_run_config({"architecture": ARCH, "strategy": name, "num-server-rounds": rounds,
                                               "min-nodes": min_nodes or len(clients),
                                               **{f"set.{k}": v for k, v in (params or {}).items()}})
        out["adapter"] = build_strategy(cfg, {c.cid: c.group for c in clients})
        out["adapter"].start(grid(g), num_rounds=rounds, timeout=300)

    with pytest.warns(Warning):  # run_simulation is Flower's deprecated-but-supported Python entry
        run_simulation(app, client or client_app(_loader(clients)), num_supernodes=len(clients),
                       backend_config={"client_resources": {"num_cpus": 1}, "init_args": {"num_cpus": 2}})
    assert "adapter" in out, "the ServerApp did not run"
    return out["adapter"]


def run_ours(clients, name, *, rounds=ROUNDS, params=None):
    """The same strategy, built from the same run config, in :class:`server_kit.drivers.Simulator`."""
    from edge_sdk.encoder import OnnxEncoder
    from server_kit.drivers import Simulator

    s = build_strategy(FlowerRunConfig.from_run_config({"architecture": ARCH, "strategy": name,
                                                        **{f"set.{k}": v for k, v in (params or {}).items()}})).strategy
    return Simulator(s, clients, architecture=ARCH, encoder=OnnxEncoder("digits_encoder"), flip_prob=0.1,
                     seed=0).run(rounds)


@pytest.mark.parametrize("name,params", [("fedsketch", {}), ("fedavg", {}), ("ifca", {"k": 4})])
def test_flower_run_agrees_with_the_simulator(digits12, name, params):
    adapter = run_flower(digits12, name, params=params)
    ours = run_ours(digits12, name, params=params)
    report = adapter.report()
    flower_acc = [r["accuracy"] for r in report["rounds"]]
    assert len(flower_acc) == ROUNDS
    assert np.allclose(flower_acc, ours.accuracies, atol=TOL), (flower_acc, ours.accuracies)
    assert report["assignment"] == dict(sorted(ours.assignment.items()))
    assert report["ari"] == pytest.approx(ours.ari)
    if name == "fedsketch":
        assert report["ari"] == 1.0 and len(set(report["assignment"].values())) == 4
        # 12 sketches of 10 classes x 20 bits came up before training (25 bytes of bits each)
        assert report["bytes"]["up"]["SKETCH"]["messages"] == 12
    assert report["bytes"]["up"]["UPDATE"]["messages"] == 12 * ROUNDS
    assert report["bytes"]["down"]["TRAIN"]["messages"] == 12 * ROUNDS
    assert report["rejected"] == {}
    # a train message carries the node's model; IFCA's carries its K models, each distinct one once
    # (Flower moves an object once per message: IFCA's K models start alike, so round 1's move one model and
    # the later rounds' K = 4: at least (1 + 4 (ROUNDS - 1)) / ROUNDS models a message on average)
    per_train = report["bytes"]["down"]["TRAIN"]["bytes"] / (12 * ROUNDS)
    model = sum(v.nbytes for v in next(iter(adapter.strategy.models.values())).values())
    low, high = ((1 + 4 * (ROUNDS - 1)) / ROUNDS, 4) if name == "ifca" else (1, 1)
    assert low * model < per_train < high * model * 1.1


class _LateGrid:
    """Flower's grid, with its last node not yet connected for the first ``hidden_calls`` looks at all the nodes."""

    def __init__(self, grid, n: int, hidden_calls: int) -> None:
        self.grid, self.n, self.calls, self.hidden_calls = grid, n, 0, hidden_calls

    def get_node_ids(self):
        ids = sorted(self.grid.get_node_ids())
        if len(ids) < self.n:
            # the simulation is still registering its nodes: none yet, so that the strategy polls again and
            # the hidden calls count from the first look at all of them (on a loaded machine the greeting
            # went ahead with 11 of 12 registered, and round 2 was the second counted look)
            return []
        self.calls += 1
        return ids[:-1] if self.calls <= self.hidden_calls else ids

    def __getattr__(self, name):
        return getattr(self.grid, name)


def test_a_late_node_joins_the_nearest_cluster(digits12):
    # hidden at the greeting and in round 1; connected by round 2
    adapter = run_flower(digits12, "fedsketch", rounds=2, grid=lambda g: _LateGrid(g, 12, hidden_calls=2),
                         min_nodes=11)
    report = adapter.report()
    assert [r["sampled"] for r in report["rounds"]] == [11, 12]
    assert len(report["assignment"]) == 12 and report["ari"] == 1.0
    assert report["bytes"]["up"]["SKETCH"]["messages"] == 12


def test_hostile_nodes_are_refused_and_the_run_goes_on(digits12):
    good = client_app(_loader(digits12))
    app = ClientApp()

    def pid(context):
        return int(context.node_config["partition-id"])

    @app.query("fedsketch_hello")
    def hello(msg, context):
        return good(msg, context)

    @app.query("fedsketch_sketch")
    def sketch(msg, context):
        reply = good(msg, context)
        if pid(context) == 0:  # a sketch one byte short
            reply.content["sketch"] = ConfigRecord({"body": reply.content["sketch"]["body"][:-1]})
        return reply

    @app.train("fedsketch")
    def train(msg, context):
        reply = good(msg, context)
        if pid(context) == 1:  # NaN in its update
            w = {k: v.numpy() for k, v in reply.content["update"].items()}
            w[next(iter(w))] = np.full_like(w[next(iter(w))], np.nan)
            reply.content["update"] = rec.weights_record(w)
        return reply

    @app.evaluate("fedsketch")
    def evaluate(msg, context):
        return good(msg, context)

    adapter = run_flower(digits12, "fedsketch", rounds=2, client=app)
    report = adapter.report()
    # node 0 is asked again each round and refused each time; node 1's two updates are refused
    assert report["rejected"] == {"sketch-length": 3, "non-finite": 2}
    assert "c00" not in report["assignment"] and len(report["assignment"]) == 11
    assert report["ari"] == 1.0
    assert [r["summary"]["updates"] for r in report["rounds"]] == [10, 10]
    # evaluated, not a learning bound: 0.073 and 0.085 here after 1 epoch a round (chance is 0.1); 0 would mean
    # no evaluation counted
    assert all(r["accuracy"] > 0 for r in report["rounds"])


# -- what the adapter refuses (no Flower run) ----------------------------------


def test_the_adapter_refuses_what_it_cannot_carry():
    with pytest.raises(ValueError, match=r"^strategy 'fedsketch-fedae' pre-trains its autoencoder with the devices "):
        FlowerStrategy(make_strategy("fedsketch-fedae", seed=0), architecture=ARCH)
    with pytest.raises(ValueError, match=r"^follow_drift needs devices that send a sketch unasked"):
        FlowerStrategy(make_strategy("fedsketch", follow_drift=True), architecture=ARCH)
    with pytest.raises(TypeError, match=r"^FlowerStrategy wraps a FedSketch Strategy .*got str"):
        FlowerStrategy("fedavg", architecture=ARCH)
    with pytest.raises(ValueError, match=r"^flip_prob must be in \[0, 0.5\), got 0.7$"):
        FlowerStrategy(make_strategy("fedavg"), architecture=ARCH, flip_prob=0.7)


def test_the_run_config_is_checked(tmp_path):
    with pytest.raises(ValueError, match=r"^run config lacks 'architecture'"):
        FlowerRunConfig.from_run_config({})
    with pytest.raises(ValueError, match=r"^run config 'num-server-rounds' must be a int, got '3'$"):
        FlowerRunConfig.from_run_config({"architecture": ARCH, "num-server-rounds": "3"})
    with pytest.raises(ValueError, match=r"^unknown strategy 'kmeans'; choose one of "):
        build_strategy(FlowerRunConfig.from_run_config({"architecture": ARCH, "strategy": "kmeans"}))
    cfg = FlowerRunConfig.from_run_config({"architecture": ARCH, "strategy": "ifca", "set.k": 3, "lr": 1,
                                           "data": "/elsewhere"})
    assert cfg.params == {"k": 3} and cfg.lr == 1.0
    assert build_strategy(cfg).strategy.k == 3
    # every method of the registry but the one that pre-trains is carried (FLIS with its auxiliary set)
    aux = tmp_path / "aux.npz"
    np.savez(aux, x=np.zeros((4, 1, 8, 8), np.float32), y=np.arange(4))
    for name in ("fedavg", "fedsketch", "ifca", "ladd", "ocfl", "cfl", "briggs", "kmeans-weights", "flis-hc",
                 "flis-dc"):
        extra = {"set.aux_path": str(aux)} if name.startswith("flis") else {}
        adapter = build_strategy(FlowerRunConfig.from_run_config({"architecture": ARCH, "strategy": name, **extra}))
        assert adapter.strategy.name == name


# -- the records both sides share ------------------------------------------------


def test_records_round_trip_and_refuse_malformed_content():
    w = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(2, np.float32)}
    spec = {k: (v.shape, str(v.dtype)) for k, v in w.items()}
    u = rec.read_update("c1", rec.write_update(Update("c1", 2, "c0", w, 40, 0.5, {"acc_before": 0.3})), spec)
    assert (u.round, u.model_key, u.n_samples, u.loss, dict(u.metrics)) == (2, "c0", 40, 0.5, {"acc_before": 0.3})
    assert all(np.array_equal(u.weights[k], w[k]) for k in w)
    bad = rec.write_update(Update("c1", 2, "c0", {**w, "a": w["a"] * np.nan}, 40, 0.5))
    with pytest.raises(ProtocolError, match=r"^tensor 'a' contains NaN or Inf$"):
        rec.read_update("c1", bad, spec)
    with pytest.raises(ProtocolError, match=r"^tensor 'b' has shape \(2,\), expected \(3,\)$"):
        rec.read_update("c1", rec.write_update(Update("c1", 2, "c0", w, 40, 0.5)), {**spec, "b": ((3,), "float32")})
    zero = rec.write_update(Update("c1", 2, "c0", w, 40, 0.5))
    zero["metrics"] = MetricRecord({"num-examples": 0})
    with pytest.raises(ProtocolError, match=r"^meta field 'n_samples' must be an integer in \[1, 2.14748e\+09\], got 0$"):
        rec.read_update("c1", zero, spec)
    with pytest.raises(ProtocolError, match=r"^update lacks its ArrayRecord 'update'$"):
        rec.read_update("c1", RecordDict({"result": ConfigRecord({"round": 1, "model_key": "c0"}),
                                          "metrics": MetricRecord({"num-examples": 3})}), spec)
    sk = Sketch(bytes(25), 10, 20)
    assert rec.read_sketch(rec.write_sketch(sk), num_classes=10, latent_dim=20) == sk
    with pytest.raises(ProtocolError, match=r"^sketch shape \(10 classes, 20 bits\) differs"):
        rec.read_sketch(rec.write_sketch(sk), num_classes=10, latent_dim=16)
    # the bounds of the MQTT schema hold here too (edge_sdk.schema.check_fields)
    many = rec.write_update(Update("c1", 2, "c0", w, 40, 0.5, {f"m{i}": 1.0 for i in range(40)}))
    with pytest.raises(ProtocolError, match=r"^meta field 'metrics' must be an object of at most 32 numbers"):
        rec.read_update("c1", many, spec)
    with pytest.raises(ProtocolError, match=r"^hello cid 'a/b' contains forbidden characters \['/'\]"):
        rec.read_hello(RecordDict({"hello": ConfigRecord({"cid": "a/b", "n_samples": 1})}))
    with pytest.raises(ProtocolError, match=r"^hello cid is empty$"):
        rec.read_hello(RecordDict({"hello": ConfigRecord({"cid": "", "n_samples": 1, "n_test": 0,
                                                          "classes_present": 1})}))
    with pytest.raises(ProtocolError, match=r"^meta field 'accuracy' must be a finite number in \[0, 1\], got 1.5$"):
        rec.read_evaluation(rec.write_evaluation(1, "c0", {"accuracy": 1.5, "loss": 0.1, "n_test": 3}))


def test_message_bytes_count_every_object_the_message_carries():
    w = {"a": np.zeros((100, 100), np.float32)}
    one = message_bytes(RecordDict({"model.global": rec.weights_record(w)}))
    assert 40_000 < one < 40_000 + 1_000  # the tensor's 40,000 bytes and a few hundred of headers
    two = RecordDict({"model.c0": rec.weights_record(w), "model.c1": rec.weights_record({"a": 2 + w["a"]})})
    assert 80_000 < message_bytes(two) < 80_000 + 2_000
    # the same model offered twice is one object: counted once, as Flower moves it once
    same = RecordDict({"model.c0": rec.weights_record(w), "model.c1": rec.weights_record(w)})
    assert message_bytes(same) < one + 1_000
