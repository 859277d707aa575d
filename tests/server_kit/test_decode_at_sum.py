"""Updates decoded only where they are summed (server_kit.rounds.decoding): the intake's models, bit for bit.

The GPU path (the staged sums, codes decoded on the card) runs here on the
CPU: the same torch code, without pinning or streams.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from edge_sdk.compress import Compression, Method, encode_delta
from edge_sdk.compress.frames import applied, coded_change, frame_delta
from edge_sdk.compress.update_codec import decode_delta, update_codec, with_delta
from edge_sdk.protocol import ProtocolError
from edge_sdk.tasks import TrainSettings, Update
from server_kit.aggregate import StreamingFedAvg
from server_kit.rounds.decoding import DecodeAt, decode_at_sum, why_decoded_at_intake
from server_kit.strategies import make_strategy
from server_kit.strategies.base import ClientInfo

from helpers import ARCH, model_digest

torch = pytest.importorskip("torch")

SHAPES = {"a.weight": (33, 7), "b.bias": (257,), "c": (), "d": (3, 3, 5), "e": (4, 256), "z": (0,)}


def _spec(shapes=SHAPES):
    return {k: (s, "float32") for k, s in shapes.items()}


def _delta(seed, scale=0.05):
    rng = np.random.default_rng(seed)
    return {k: (rng.normal(size=s) * scale).astype(np.float32) for k, s in SHAPES.items()}


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_norm_from_the_codes_is_the_decoded_changes_norm_and_every_bad_code_is_refused_as_decode_refuses(method):
    m = Method(method)
    for seed in range(4):
        body = encode_delta(_delta(seed), Compression.parse(method))[0]
        decoded = decode_delta(body, _spec(), m)
        exact = np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in decoded.values()))
        assert coded_change(body, _spec(), m).norm == pytest.approx(exact, rel=1e-6)
    body = encode_delta(_delta(0), Compression.parse(method))[0]
    frames = {f.name: f for f in frame_delta(body, _spec(), m)}
    # int4: a byte of two nibbles 0; the odd tensor's padding nibble not 0 (its low nibble 8 is a code 0). int8: -128
    cases = {"int4": [("b.bias", 0, 0x00), ("b.bias", -1, 0x18)], "int8": [("b.bias", 3, 0x80)]}[method]
    for name, at, value in cases:
        codes = frames[name].codes.tobytes()
        bad = bytearray(body)
        bad[body.index(codes) + at % len(codes)] = value
        with pytest.raises(ProtocolError) as host:
            decode_delta(bytes(bad), _spec(), m)
        with pytest.raises(ProtocolError) as coded:
            coded_change(bytes(bad), _spec(), m)
        assert (coded.value.reason, str(coded.value)) == (host.value.reason, str(host.value))
        assert host.value.reason == "compressed-value"


@pytest.mark.parametrize("kernels", ["numpy", "staged"])
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_a_clipped_coded_update_adds_its_change_times_the_factor_with_the_hosts_bits(method, kernels):
    rng = np.random.default_rng(5)
    base = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    m = Method(method)
    coded_sum = StreamingFedAvg(base, kernels=kernels, device="cpu")
    host_sum = StreamingFedAvg(base, kernels=kernels, device="cpu")
    for seed, factor in ((1, 1.0), (2, 0.37), (3, 0.9)):
        body = encode_delta(_delta(seed), Compression.parse(method))[0]
        change = coded_change(body, _spec(), m).on(base).scaled(factor)
        coded_sum.add_coded(change.frames, m, base, 10 + seed, factor=change.factor)
        host = {f.name: applied(base[f.name], f, m, factor) for f in change.frames}
        assert model_digest(host) == model_digest(change.weights())
        if factor == 1.0:
            assert model_digest(host) == model_digest(with_delta(base, decode_delta(body, _spec(), m)))
        else:  # the change was scaled: the result moved less than the whole change
            assert np.abs(host["b.bias"] - base["b.bias"]).max() < np.abs(_delta(seed)["b.bias"]).max()
        host_sum.add(host, 10 + seed)
    assert model_digest(coded_sum.result()) == model_digest(host_sum.result())
    with pytest.raises(ValueError, match="factor must be a finite number > 0, got nan"):
        coded_sum.add_coded(change.frames, m, base, 1, factor=float("nan"))


def test_which_runs_decode_where_summed(monkeypatch):
    from server_kit.rounds import decoding

    int4 = update_codec("int4")
    fed = make_strategy("fedavg", compression="int4", seed=0)
    assert not decode_at_sum(DecodeAt.AUTO, fed, int4)  # no model yet: decided at intake
    fed.setup([ClientInfo("a", 5)], {"w": np.zeros(3, np.float32)})
    assert why_decoded_at_intake(fed, int4) is None
    assert decode_at_sum("sum", fed, int4) and not decode_at_sum("intake", fed, int4)
    assert not decode_at_sum(DecodeAt.AUTO, fed, int4)  # 12 bytes: summed on the CPU, even beside a GPU
    monkeypatch.setattr(decoding, "sums_on_gpu", lambda template: True)  # a model whose sums are on a GPU
    assert decode_at_sum(DecodeAt.AUTO, fed, int4)
    assert why_decoded_at_intake(fed, update_codec("stc:0.05")) == (
        "its updates are stc, and only int8 and int4 are decoded where summed")
    median = make_strategy("fedavg", compression="int4", seed=0, aggregator="median")
    assert why_decoded_at_intake(median, int4) == "the median of the updates reads each update's weights"
    for name in ("fedsketch", "ifca", "ladd"):
        assert why_decoded_at_intake(make_strategy(name, compression="int4", architecture=ARCH, seed=0), int4) is None
    dp = make_strategy("fedavg", compression="int4", seed=0)
    dp.dp = object()
    assert why_decoded_at_intake(dp, int4) == "central DP clips each update from its decoded weights"


def _run(clients, encoder, decode, kernels):
    from server_kit.drivers.simulate import Simulator

    s = make_strategy("fedsketch", settings=TrainSettings(epochs=1, lr=1e-2, batch_size=32), seed=0,
                      compression="int4", architecture=ARCH, min_cluster_size=3)
    res = Simulator(s, clients, architecture=ARCH, encoder=encoder, seed=0, decode_updates=decode).run(2)
    return s, res


@pytest.mark.parametrize("kernels", ["numpy", "staged"])
def test_a_run_decoding_where_summed_trains_the_models_of_decoding_at_intake(digits12, monkeypatch, caplog, kernels):
    """Ours, int4 both ways, 2 rounds, the default screening: the same models, bit for bit; with the staged sums
    (the GPU path) the codes are decoded by the sum itself."""
    from edge_sdk.encoder import OnnxEncoder
    from server_kit.robust import config as robust_config

    monkeypatch.setattr(robust_config, "StreamingFedAvg", functools.partial(StreamingFedAvg, kernels=kernels,
                                                                            device="cpu"))
    coded_adds = []
    original = StreamingFedAvg.add_coded
    monkeypatch.setattr(StreamingFedAvg, "add_coded",
                        lambda self, *a, **kw: coded_adds.append(self.kernels) or original(self, *a, **kw))
    encoder = OnnxEncoder("digits_encoder")
    s_intake, r_intake = _run(digits12, encoder, "intake", kernels)
    assert coded_adds == []
    s_sum, r_sum = _run(digits12, encoder, "sum", kernels)
    assert set(coded_adds) == {kernels} and len(coded_adds) >= 2 * 6  # every update of 2 rounds, half the fleet
    assert sorted(s_sum.models) == sorted(s_intake.models)
    for key in s_intake.models:
        assert model_digest(s_sum.models[key]) == model_digest(s_intake.models[key]), key
    assert [r.accuracy for r in r_sum.rounds] == [r.accuracy for r in r_intake.rounds]
    assert [r.report.updates for r in r_sum.rounds] == [r.report.updates for r in r_intake.rounds]


def test_an_update_kept_coded_is_screened_by_its_codes_norm_and_clipped_where_summed():
    s = make_strategy("fedavg", compression="int4", seed=0)
    base = {"w": np.zeros(600, np.float32)}
    s.setup([ClientInfo(c, 10) for c in "abcd"], base)
    m, spec = Method.INT4, {"w": ((600,), "float32")}
    rng = np.random.default_rng(0)
    updates = []
    for c in "abcd":
        change = {"w": (rng.normal(size=600) * (0.01 if c != "d" else 0.05)).astype(np.float32)}
        body = encode_delta(change, Compression.parse("int4"))[0]
        updates.append(Update(c, 1, "global", {}, 10, 0.0, coded=coded_change(body, spec, m)))
    summary = s.aggregate(1, updates).to_dict()
    assert summary["updates"] == 4 and summary["clipped"] == 1 and summary["refused_norm"] == 0  # d: 5 times
    norms = {u.cid: u.coded.norm for u in updates}
    bound = s.robust.norm_bound * float(np.median(list(norms.values())))
    assert norms["d"] > bound > max(norms[c] for c in "abc")
    want = StreamingFedAvg(base)
    for u in updates:
        want.add({"w": applied(base["w"], u.coded.frames[0], m, bound / norms[u.cid] if u.cid == "d" else 1.0)}, 10)
    assert model_digest(s.models["global"]) == model_digest(want.result())
