"""FedAvg: the numpy reference, the streaming accumulator, prefix subsets, rejections."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from server_kit.aggregate import StreamingFedAvg, fedavg, server_device  # noqa: E402
from server_kit.model_parts import merge, select  # noqa: E402

KERNELS = ["numpy", "torch"]  # both paths run on the CPU here; "torch" is the GPU path


def _streamed(template, updates, **kw):
    agg = StreamingFedAvg(template, device="cpu", **kw)
    for w, n in updates:
        agg.add(w, n)
    return agg


def _random_updates(rng, template, k):
    out = []
    for _ in range(k):
        w = {}
        for name, v in template.items():
            if np.issubdtype(v.dtype, np.floating):
                w[name] = (v + rng.normal(0, 1, v.shape)).astype(v.dtype)
            else:
                w[name] = rng.integers(0, 50, v.shape).astype(v.dtype)
        out.append((w, int(rng.integers(1, 5000))))
    return out


TEMPLATE = {
    "conv1.weight": np.zeros((4, 1, 3, 3), np.float32),
    "conv1.bias": np.zeros(4, np.float32),
    "conv10.weight": np.zeros((2, 2), np.float32),  # "conv1." must not select it
    "fc.weight": np.zeros((3, 5), np.float32),
    "bn.num_batches_tracked": np.array(0, dtype=np.int64),
}


# ----------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize("kernels", KERNELS)
def test_hand_computed_weighted_average(kernels):
    a = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([0.0], np.float32), "n": np.array(5)}
    b = {"w": np.array([3.0, 6.0], np.float32), "b": np.array([4.0], np.float32), "n": np.array(2)}
    updates = [(a, 1), (b, 3)]
    # (1*1 + 3*3)/4 = 2.5, (1*2 + 3*6)/4 = 5, (0 + 3*4)/4 = 3; integers: the maximum
    want = {"w": [2.5, 5.0], "b": [3.0], "n": 5}
    for got in (fedavg(updates), _streamed(a, updates, kernels=kernels).result()):
        np.testing.assert_array_equal(got["w"], want["w"])
        np.testing.assert_array_equal(got["b"], want["b"])
        assert got["n"] == want["n"] and got["n"].dtype == np.int64
        assert got["w"].dtype == np.float32


def test_an_update_with_zero_samples_does_not_move_the_average():
    a = {"w": np.array([1.0], np.float32)}
    b = {"w": np.array([100.0], np.float32)}
    assert fedavg([(a, 2), (b, 0)])["w"][0] == 1.0
    assert _streamed(a, [(a, 2), (b, 0)]).result()["w"][0] == 1.0


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_streaming_equals_reference_on_random_updates(dtype, kernels):
    rng = np.random.default_rng(0)
    updates = _random_updates(rng, TEMPLATE, 25)
    ref = fedavg(updates)
    agg = StreamingFedAvg(TEMPLATE, device="cpu", dtype=dtype, kernels=kernels)
    assert agg.kernels == kernels
    for w, n in updates:
        agg.add(w, n)
    got = agg.result()
    assert agg.count == 25 and agg.total_samples == sum(n for _, n in updates)
    assert list(got) == list(TEMPLATE)
    for k in TEMPLATE:
        assert got[k].dtype == TEMPLATE[k].dtype and got[k].shape == TEMPLATE[k].shape
        np.testing.assert_allclose(got[k], ref[k], rtol=0, atol=1e-6, err_msg=k)


def test_float64_models_stay_float64():
    rng = np.random.default_rng(1)
    tpl = {"w": np.zeros(6, np.float64)}
    updates = _random_updates(rng, tpl, 4)
    got = _streamed(tpl, updates).result()
    assert got["w"].dtype == np.float64
    np.testing.assert_allclose(got["w"], fedavg(updates)["w"], rtol=1e-12)


@pytest.mark.parametrize("kernels", KERNELS)
def test_reset_and_reuse(kernels):
    rng = np.random.default_rng(2)
    updates = _random_updates(rng, TEMPLATE, 6)
    agg = _streamed(TEMPLATE, updates[:3], kernels=kernels)
    agg.reset()
    assert agg.count == 0 and agg.total_samples == 0
    for w, n in updates[3:]:
        agg.add(w, n)
    ref = fedavg(updates[3:])
    for k, v in agg.result().items():
        np.testing.assert_allclose(v, ref[k], atol=1e-6)


@pytest.mark.parametrize("kernels", KERNELS)
def test_read_only_arrays_are_accepted_without_warnings(kernels):
    buf = np.arange(4, dtype=np.float32).tobytes()
    w = {"w": np.frombuffer(buf, dtype=np.float32)}  # read-only, as decoded from a payload
    assert not w["w"].flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _streamed(w, [(w, 3)], kernels=kernels).result()
    np.testing.assert_array_equal(got["w"], [0, 1, 2, 3])


def test_server_device_is_cuda_only_when_available():
    assert server_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    agg = StreamingFedAvg({"w": np.zeros(1, np.float32)})  # too small for a GPU: numpy on the CPU
    assert agg.device.type == "cpu" and agg.dtype == torch.float64 and agg.kernels == "numpy"


# ----------------------------------------------------------------------------- subsets


def test_prefix_subset_averages_only_the_shared_base():
    rng = np.random.default_rng(3)
    updates = _random_updates(rng, TEMPLATE, 5)
    agg = _streamed(TEMPLATE, updates, include=("conv1.",))
    assert agg.names == ("conv1.weight", "conv1.bias")  # not conv10.weight
    ref = fedavg([(select(w, include=["conv1."]), n) for w, n in updates])
    got = agg.result()
    assert set(got) == {"conv1.weight", "conv1.bias"}
    for k in got:
        np.testing.assert_allclose(got[k], ref[k], atol=1e-6)

    rest = _streamed(TEMPLATE, updates, exclude=("conv1.", "bn."))
    assert rest.names == ("conv10.weight", "fc.weight")
    # the strategy sends only the shared tensors; the subset accumulator takes them
    only = StreamingFedAvg(select(TEMPLATE, include=["conv1."]), device="cpu")
    only.add(select(updates[0][0], include=["conv1."]), 7)
    np.testing.assert_array_equal(only.result()["conv1.bias"], updates[0][0]["conv1.bias"])


def test_merge_puts_shared_and_cluster_parts_together():
    base = {"a": np.zeros(2), "b": np.ones(3)}
    merged = merge(base, {"a": np.full(2, 7.0)})
    assert list(merged) == ["a", "b"]
    np.testing.assert_array_equal(merged["a"], [7.0, 7.0])
    assert merged["b"] is base["b"] and base["a"][0] == 0.0  # base untouched
    with pytest.raises(ValueError, match="override tensor 'c' is not in the base model"):
        merge(base, {"c": np.zeros(1)})
    with pytest.raises(
        ValueError, match=r"override tensor 'b' has shape \(2,\), the base model \(3,\)"
    ):
        merge(base, {"b": np.zeros(2)})


@pytest.mark.parametrize("kernels", KERNELS)
def test_resnet18_state_dict_with_integer_buffers(kernels):
    from server_kit.nets import ResNet18, count_params

    net = ResNet18()
    assert count_params(net) == 11_173_962
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    ints = [k for k, v in state.items() if v.dtype == np.int64]
    assert ints and all(k.endswith("num_batches_tracked") for k in ints)
    a = {k: v + (3 if v.dtype == np.int64 else 0.5) for k, v in state.items()}
    b = {k: v + (1 if v.dtype == np.int64 else -0.5) for k, v in state.items()}
    got = _streamed(state, [(a, 1), (b, 1)], kernels=kernels).result()
    np.testing.assert_allclose(got["fc.weight"], state["fc.weight"], atol=1e-6)
    assert got[ints[0]] == 3 and got[ints[0]].dtype == np.int64


# ----------------------------------------------------------------------------- rejections


def _ok():
    return {k: v.copy() for k, v in TEMPLATE.items()}


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w.pop("fc.weight"), r"tensor 'fc.weight' is missing"),
        (lambda w: w.update(extra=np.zeros(1, np.float32)), r"unexpected tensor 'extra'"),
        (
            lambda w: w.update({"fc.weight": np.zeros((5, 3), np.float32)}),
            r"tensor 'fc.weight' has shape \(5, 3\), expected \(3, 5\)",
        ),
        (
            lambda w: w["conv1.bias"].__setitem__(2, np.nan),
            r"tensor 'conv1.bias' contains NaN or Inf",
        ),
        (
            lambda w: w["fc.weight"].__setitem__((0, 0), -np.inf),
            r"tensor 'fc.weight' contains NaN or Inf",
        ),
        (
            lambda w: w.update({"fc.weight": np.zeros((3, 5), np.int32)}),
            r"tensor 'fc.weight' has dtype int32, expected floating",
        ),
        (
            lambda w: w.update({"bn.num_batches_tracked": np.array(1.5)}),
            r"has dtype float64, expected integer",
        ),
        (
            lambda w: w.update({"fc.weight": np.zeros((3, 5), bool)}),
            r"has dtype bool; expected floating or integer",
        ),
    ],
)
@pytest.mark.parametrize("kernels", KERNELS)
def test_bad_updates_are_refused_and_change_nothing(mutate, message, kernels):
    good = _ok()
    good["fc.weight"][:] = 1.0
    agg = _streamed(TEMPLATE, [(good, 10)], kernels=kernels)
    bad = _ok()
    mutate(bad)
    with pytest.raises(ValueError, match=message):
        agg.add(bad, 5)
    assert agg.count == 1 and agg.total_samples == 10
    np.testing.assert_array_equal(agg.result()["fc.weight"], np.ones((3, 5), np.float32))
    with pytest.raises(ValueError, match=message):
        fedavg([(good, 10), (bad, 5)])


@pytest.mark.parametrize("kernels", KERNELS)
def test_huge_finite_values_are_not_mistaken_for_inf(kernels):
    w = {"w": np.full(8, 3e38, np.float32)}  # the float32 sum overflows, the values do not
    got = _streamed(w, [(w, 1), (w, 1)], kernels=kernels).result()
    np.testing.assert_array_equal(got["w"], w["w"])


def test_bad_counts_and_empty_rounds_are_refused():
    w = _ok()
    agg = StreamingFedAvg(TEMPLATE, device="cpu")
    for n in (-1, 2.0, True, None):
        with pytest.raises(ValueError, match="n_samples must be a non-negative integer"):
            agg.add(w, n)
    with pytest.raises(ValueError, match="no update was added"):
        agg.result()
    agg.add(w, 0)
    with pytest.raises(ValueError, match="total weight is zero"):
        agg.result()
    with pytest.raises(ValueError, match="fedavg needs at least one update"):
        fedavg([])
    with pytest.raises(ValueError, match="total weight is zero"):
        fedavg([(w, 0), (w, 0)])
    with pytest.raises(
        ValueError, match=r"update 1: n_samples must be a non-negative integer, got -3"
    ):
        fedavg([(w, 1), (w, -3)])
    with pytest.raises(ValueError, match="must be a .weights, n_samples. pair"):
        fedavg([w])


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"no tensor of the template matches include=\['nope.'\]"):
        StreamingFedAvg(TEMPLATE, include=["nope."], device="cpu")
    with pytest.raises(
        ValueError, match="include must be a sequence of name prefixes, not the string"
    ):
        StreamingFedAvg(TEMPLATE, include="conv1.", device="cpu")
    with pytest.raises(ValueError, match="dtype must be a floating torch dtype"):
        StreamingFedAvg(TEMPLATE, dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="template must be a mapping"):
        StreamingFedAvg([np.zeros(1)], device="cpu")
    with pytest.raises(ValueError, match=r"kernels must be one of \['auto', 'numpy', 'torch', 'staged'\]"):
        StreamingFedAvg(TEMPLATE, kernels="cuda", device="cpu")
    with pytest.raises(ValueError, match="kernels='numpy' needs device 'cpu'"):
        StreamingFedAvg(TEMPLATE, kernels="numpy", device="meta")
