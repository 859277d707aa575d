"""Compressed rounds in process: the one aggregation entry point, the models' versions, the simulator's bytes."""

from __future__ import annotations

import numpy as np
import pytest

from edge_sdk.compress import Compression, Method, apply_steps, parse_chain
from edge_sdk.protocol import tensors_body
from edge_sdk.tasks import TrainSettings, Update
from server_kit.data.partition import load_digits_images, rotation_partition
from server_kit.downstream import ModelVersions
from server_kit.drivers.simulate import Simulator
from server_kit.strategies import make_strategy
from server_kit.strategies.fedavg import FedAvg

from helpers import ARCH, model_digest

SETTINGS = TrainSettings(epochs=3, lr=1e-2, batch_size=16)


# -- one entry point ------------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["aggregate", "aggregate_round"])
def test_a_strategy_cannot_define_its_own_aggregate(hook):
    with pytest.raises(TypeError, match=f"Mine defines {hook}: a strategy implements the private hook _combine"):
        type("Mine", (FedAvg,), {hook: lambda self, rnd, updates: {}})


def test_aggregate_screens_what_the_hook_would_take_unscreened():
    """The public entry point refuses a non-finite update that the private hook alone would average in."""
    s = FedAvg(seed=0)
    from server_kit.strategies.base import ClientInfo

    s.setup([ClientInfo("a", 5), ClientInfo("b", 5)], {"w": np.zeros(3, np.float32)})
    bad = {"w": np.array([np.nan, 0, 0], np.float32)}
    summary = s.aggregate(1, [Update("a", 1, "global", bad, 5, 0.0),
                              Update("b", 1, "global", {"w": np.ones(3, np.float32)}, 5, 0.0)]).to_dict()
    assert summary["updates"] == 1 and summary["refused_norm"] == 1
    np.testing.assert_array_equal(s.models["global"]["w"], np.ones(3, np.float32))


def test_methods_that_cluster_from_whole_updates_refuse_compression():
    with pytest.raises(ValueError, match=r"strategy 'cfl' cannot use --compress topk:0.01: it splits clusters by "
                                         r"the cosine similarities"):
        make_strategy("cfl", compression="topk:0.01")
    for name in ("ocfl", "briggs", "kmeans-weights", "flis-hc"):
        with pytest.raises(ValueError, match=f"strategy '{name}' cannot use --compress int8: it clusters the "
                                             "devices by their whole model updates"):
            make_strategy(name, compression="int8", architecture=ARCH)
    with pytest.raises(ValueError, match="strategy 'flis-dc' cannot use --compress stc:0.01: it clusters the "
                                         "devices every round by running their whole trained models"):
        make_strategy("flis-dc", compression="stc", architecture=ARCH)
    assert make_strategy("cfl").versions.compression.method is Method.NONE


# -- versions and what a device is sent ------------------------------------------------------


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.normal(size=(40, 30)).astype(np.float32), "b": rng.normal(size=30).astype(np.float32)}


def _trained(models, rng, scale=0.1):
    return {n: w + rng.normal(scale=scale, size=w.shape).astype(np.float32) for n, w in models["c0"].items()}


def test_devices_that_skip_rounds_get_the_smallest_catch_up_and_hold_the_servers_bits():
    from edge_sdk.compress import apply_catchup, catchup_body, chain_body

    v = ModelVersions(Compression.parse("topk:0.05"))
    models = {"c0": weights(0)}
    v.sync(models)
    assert v.version == {"c0": 0}
    first = dict(models["c0"])  # the whole first version, as a device got it
    rng = np.random.default_rng(1)
    for rnd in range(1, 4):
        models["c0"] = _trained(models, rng)
        assert v.commit(models) == {"c0": rnd}
    meta, body = v.payload("c0", 0, models["c0"])
    steps = v._history["c0"].steps
    chain, merged = chain_body(list(steps)), catchup_body(first, models["c0"])
    assert len(body) == min(len(chain), len(merged)) < len(tensors_body(models["c0"]))
    if meta["codec"] == "topk":
        _, held = apply_steps(0, first, parse_chain(body, Method.TOPK), Method.TOPK)
    else:
        held = apply_catchup(first, body, {n: (a.shape, "float32") for n, a in first.items()})
    assert meta == {"key": "c0", "version": 3, "base": 0, "codec": meta["codec"]}
    assert model_digest(held) == model_digest(models["c0"])
    # one round behind: only the last change; the same bytes (the same object) for everyone at that version
    one = v.payload("c0", 2, models["c0"])
    assert one is v.payload("c0", 2, models["c0"]) and len(parse_chain(one[1], Method.TOPK)) == 1
    # current: nothing but the envelope's meta; late (None): the whole model
    assert v.payload("c0", 3, models["c0"]) == ({"key": "c0", "version": 3, "current": True}, b"")
    assert v.payload("c0", None, models["c0"]) == ({"key": "c0", "version": 3}, tensors_body(models["c0"]))


def test_a_merged_catch_up_replaces_a_chain_of_dense_steps_bit_for_bit():
    from edge_sdk.compress import apply_catchup

    v = ModelVersions(Compression.parse("int8"))
    models = {"c0": weights(0)}
    v.sync(models)
    first = dict(models["c0"])
    rng = np.random.default_rng(2)
    for _ in range(6):
        models["c0"] = _trained(models, rng, scale=1e-3)
        v.commit(models)
    meta, body = v.payload("c0", 0, models["c0"])
    assert meta == {"key": "c0", "version": 6, "base": 0, "codec": "exact"}
    assert len(body) < sum(len(s.body) for s in v._history["c0"].steps)  # fewer bytes than the 6 int8 steps
    held = apply_catchup(first, body, {n: (a.shape, "float32") for n, a in first.items()})
    assert model_digest(held) == model_digest(models["c0"])
    # a cluster topic whose devices hold several versions: no merged body; six int8 steps outweigh the model
    assert v.payload("c0", 0, models["c0"], merge=False)[0] == {"key": "c0", "version": 6}


def test_the_cache_folds_its_oldest_steps_past_its_bytes_and_rebuilds_old_versions_exactly():
    v = ModelVersions(Compression.parse("int8"), cache_bytes=2500)  # about two int8 steps of 1,230 entries
    models = {"c0": weights(0)}
    v.sync(models)
    kept = {0: dict(models["c0"])}
    rng = np.random.default_rng(3)
    for rnd in range(1, 6):
        models["c0"] = _trained(models, rng)
        v.commit(models)
        kept[rnd] = dict(models["c0"])
    hist = v._history["c0"]
    assert hist.base_version == 3 and [s.version for s in hist.steps] == [4, 5]
    assert model_digest(v.weights_at("c0", 4)) == model_digest(kept[4])
    assert v.payload("c0", 2, models["c0"])[0] == {"key": "c0", "version": 5}  # behind the oldest kept: whole
    with pytest.raises(ValueError, match="version 2 of model 'c0' is not kept"):
        v.weights_at("c0", 2)


def test_a_portable_initial_model_goes_free_with_its_hash():
    from edge_sdk.models.portable_init import tensors_sha256
    from edge_sdk.training.trainer import initial_weights

    pytest.importorskip("torch")
    v = ModelVersions(Compression.parse("sign"))
    w0 = initial_weights(ARCH, 7)
    v.note_initial(ARCH, 7, w0)
    models = {"c0": dict(w0), "c1": weights(1)}
    v.sync(models)
    assert v.payload("c0", None, models["c0"]) == (
        {"key": "c0", "version": 0, "init": 7, "architecture": ARCH, "sha256": tensors_sha256(w0)}, b"")
    assert v.payload("c1", None, models["c1"])[0] == {"key": "c1", "version": 0}  # not an initial model: whole
    assert v.payload("c0", None, models["c0"], whole=True)[0] == {"key": "c0", "version": 0}  # asked whole
    # trained since: a device that holds nothing builds version 0 and applies the change in the same message
    models["c0"] = {n: a + np.float32(0.01) for n, a in w0.items()}
    v.commit(models)
    meta, body = v.payload("c0", None, models["c0"])
    assert meta == {"key": "c0", "version": 1, "base": 0, "codec": "sign", "init": 7, "architecture": ARCH,
                    "sha256": tensors_sha256(w0)} and 0 < len(body) < len(tensors_body(w0)) / 25
    from edge_sdk.models.held_models import ModelStore
    from edge_sdk.protocol import SERVER_ID, Kind, Message

    store = ModelStore()
    held = store.receive("c0", Message(Kind.MODEL, "f", SERVER_ID, 2, meta, body), meta)
    assert held.version == 1 and model_digest(held.weights) == model_digest(models["c0"])


def test_a_model_replaced_outside_aggregation_goes_whole():
    v = ModelVersions(Compression.parse("stc:0.1"))
    models = {"c0": weights(0)}
    v.sync(models)
    models["c1"] = weights(1)  # a new cluster
    models["c0"] = weights(2)  # a pooled model, replaced
    v.sync(models)
    assert v.version == {"c0": 1, "c1": 0}
    assert v.payload("c0", 0, models["c0"])[0] == {"key": "c0", "version": 1}


def test_compression_off_sends_todays_whole_models():
    v = ModelVersions(Compression())
    models = {"global": weights(0)}
    v.sync(models)
    assert v.commit(models) == {} and v.version == {}
    from edge_sdk.protocol import tensors_body

    assert v.payload("global", None, models["global"]) == ({"key": "global"}, tensors_body(models["global"]))


# -- the simulator ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_images()
    return rotation_partition(images, labels, 12, groups=4, seed=0)


@pytest.fixture(scope="module")
def encoder():
    from edge_sdk.encoder import OnnxEncoder

    return OnnxEncoder("digits_encoder")


def simulate(name, clients, encoder, compression, rounds=4, **kw):
    pytest.importorskip("torch")
    s = make_strategy(name, settings=SETTINGS, seed=0, compression=compression, architecture=ARCH, **kw)
    return s, Simulator(s, clients, architecture=ARCH, encoder=encoder, seed=0).run(rounds)


@pytest.fixture(scope="module")
def whole(digits, encoder):
    """Ours with whole float32 models both ways: what every pair is compared with."""
    return simulate("fedsketch", digits, encoder, "none", min_cluster_size=3)[1]


@pytest.mark.parametrize("up, down", [("int8", "int8"), ("int4", "int4"), ("sign", "sign"), ("rsign", "rtern"),
                                      ("topk:0.05", "int4")])
def test_ours_compressed_in_the_simulator_clusters_alike_and_moves_fewer_bytes(digits, encoder, whole, up, down):
    s, comp = simulate("fedsketch", digits, encoder, None, min_cluster_size=3, compress_up=up, compress_down=down)
    assert comp.ari == whole.ari == 1.0
    ratio_up = comp.ledger.total("up", ["UPDATE"]) / whole.ledger.total("up", ["UPDATE"])
    ratio_down = comp.ledger.total("down", ["MODEL"]) / whole.ledger.total("down", ["MODEL"])
    # a body's share of the float32 model: int8 1/4, sign 1/32 + a scale per 256, top-k/STC at 5 % less
    assert ratio_up < {"int8": 0.26, "int4": 0.14, "sign": 0.04, "rsign": 0.04}.get(up, 0.1), ratio_up
    # the first model free (the portable initial weights), then one change per round a device missed
    assert ratio_down < {"int8": 0.26, "sign": 0.06, "rtern": 0.08, "int4": 0.14}[down], ratio_down
    print(f"{up}/{down}: up {ratio_up:.4f}, down {ratio_down:.4f}, accuracy {comp.accuracies} against "
          f"{whole.accuracies}")
    # measured after 4 rounds, partition/model seeds 0-2 (default FP path) and 0, 3 (alt FP path): int8 and int4
    # within -0.008..0.008 of whole models; 1 bit up or 5 % of the changes lag (sign/sign 0.075-0.228, topk/int4
    # 0.108-0.169 behind 0.886-0.914): they need more rounds (benchmarks/compression.py); rotated 1 bit up with
    # rtern down 0.078 behind at seed 0 (three devices per cluster here: too few for its errors to average away)
    lag = {"int8": 0.03, "int4": 0.03, "sign": 0.3, "rsign": 0.2, "topk:0.05": 0.25}[up]
    assert comp.accuracies[-1] > whole.accuracies[-1] - lag
    assert set(s.versions.version) == set(s.models)


def test_ifca_compressed_sends_its_k_models_as_changes(digits, encoder):
    _, whole = simulate("ifca", digits, encoder, "none", rounds=3, k=2)
    _, comp = simulate("ifca", digits, encoder, "topk:0.05", rounds=3, k=2)
    assert comp.ledger.total("down", ["MODEL"]) < 0.5 * whole.ledger.total("down", ["MODEL"])
    assert comp.ledger.total("up", ["UPDATE"]) < 0.1 * whole.ledger.total("up", ["UPDATE"])


def test_the_server_options_set_each_direction_and_refuse_what_a_method_cannot_take():
    from server_kit.cli import _apply_compression, build_parser

    def settled(name, *argv, table=None):
        args = build_parser().parse_args(["--strategy", name, *argv])
        strat = dict(table or {})
        _apply_compression(args, name, strat)
        return {k: str(v) for k, v in strat.items()}

    assert settled("fedsketch", "--compress", "int4", "--compress-down", "sign") == {
        "compress_up": "int4", "compress_down": "sign"}
    assert settled("ifca", table={"compress_up": "stc:0.01"}) == {"compress_up": "stc:0.01", "compress_down": "int4"}
    assert settled("cfl") == {"compress_up": "none", "compress_down": "none"}  # the defaults give way, said in the log
    with pytest.raises(ValueError, match=r"^strategy 'cfl' cannot use --compress sign: it splits clusters"):
        settled("cfl", "--compress-down", "sign")
    with pytest.raises(ValueError, match="apply to the model-averaging strategies, not fedcref"):
        settled("fedcref", "--compress-up", "sign")
    with pytest.raises(ValueError, match=r"^compression must be 'none', 'int8', 'int4', 'sign'"):
        settled("fedsketch", "--compress-up", "gzip")


def test_compressed_updates_with_whole_models_down_are_refused_at_the_start():
    """A compressed update is a change from a version the server keeps; with whole models down none is kept."""
    for up in ("int4", "sign", "topk:0.05"):
        with pytest.raises(ValueError, match=rf"strategy 'fedsketch' cannot send updates as {up} while models go "
                                             r"down whole \(none\): .*set --compress-down too"):
            make_strategy("fedsketch", compress_up=up, compress_down="none", architecture=ARCH)
    # whole updates with compressed models, and compression both ways, stay allowed
    assert make_strategy("fedsketch", compress_up="none", compress_down="int4", architecture=ARCH).versions.enabled
    assert make_strategy("ifca", compress_up="int4", compress_down="sign", architecture=ARCH).compress_up.enabled


@pytest.mark.parametrize("text", ["int8", "int4", "sign", "rsign", "rtern", "topk:0.05"])
def test_integer_counters_stay_integer_through_updates_and_chains_and_match_the_servers_bits(text):
    """BatchNorm's ``num_batches_tracked`` (int64) goes up and down with the floats: rounded, kept integer."""
    from edge_sdk.compress.update_codec import InMemoryFeedback, device_feedback, update_codec

    v = ModelVersions(Compression.parse(text))
    models = {"c0": {**weights(0), "bn.num_batches_tracked": np.array(0, dtype=np.int64)}}
    v.sync(models)
    device = dict(models["c0"])  # the first version, as a device holds it
    codec = update_codec(text)
    fb = InMemoryFeedback(device_feedback(codec.compression))
    rng = np.random.default_rng(2)
    spec = {n: (np.shape(a), "float32") for n, a in models["c0"].items()}
    for rnd in range(1, 4):
        trained = {n: (a + rng.normal(scale=0.1, size=a.shape).astype(np.float32)) if a.dtype == np.float32
                   else a + 8 for n, a in models["c0"].items()}  # one epoch of 8 batches on the counter
        body, meta, _ = codec.encode("c0", trained, models["c0"], v.version["c0"], fb)
        back = codec.weights(codec.decode(body, spec, meta["version"]), models["c0"])
        assert back["bn.num_batches_tracked"].dtype == np.int64 and back["a"].dtype == np.float32
        assert abs(int(back["bn.num_batches_tracked"]) - int(trained["bn.num_batches_tracked"])) <= 2
        models["c0"] = back
        assert v.commit(models) == {"c0": rnd}
    meta, body = v.payload("c0", 0, models["c0"])
    assert meta["codec"] == Compression.parse(text).method.value  # a chain: no merged catch-up of integers
    held_v, held = apply_steps(0, device, parse_chain(body, Compression.parse(text).method),
                               Compression.parse(text).method)
    assert held_v == 3 and held["bn.num_batches_tracked"].dtype == np.int64
    assert model_digest(held) == model_digest(models["c0"])


def test_resnet18_with_batchnorm_counters_trains_compressed_in_the_simulator():
    """The ResNet-18 path with the default pair: every update summed, the devices' copies the server's bits."""
    pytest.importorskip("torch")
    from server_kit.data.clients import ClientData

    rng = np.random.default_rng(0)
    clients = [ClientData(f"c{i}", rng.random((16, 3, 32, 32), dtype=np.float32), rng.integers(0, 10, 16),
                          rng.random((8, 3, 32, 32), dtype=np.float32), rng.integers(0, 10, 8), 0) for i in range(2)]
    s = FedAvg(settings=TrainSettings(epochs=1, lr=1e-3, batch_size=16), seed=0, compress_up="int4",
               compress_down="int4")
    res = Simulator(s, clients, architecture="resnet18_3x32x32_10", seed=0).run(2)
    assert [(r.report.tasked, r.report.updates) for r in res.rounds] == [(2, 2), (2, 2)]
    model = s.models["global"]
    assert model["bn1.num_batches_tracked"].dtype == np.int64
    assert int(model["bn1.num_batches_tracked"]) == 2  # one batch a round, two rounds
    assert res.ledger.total("up", ["UPDATE"]) < 0.14 * 2 * 2 * 4 * 11_173_962
