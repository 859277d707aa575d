"""StreamingFedAvg(kernels="staged"): one flat accumulator fed through staging slots, NaN found at settle."""

from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edge_sdk.tasks import Update  # noqa: E402
from server_kit import staging  # noqa: E402
from server_kit.aggregate import GPU_MIN_BYTES, Refused, StreamingFedAvg, fedavg  # noqa: E402
from server_kit.model_parts import select  # noqa: E402
from server_kit.robust.coordinate import CoordinateAggregator  # noqa: E402
from server_kit.strategies.base import add_updates  # noqa: E402

TEMPLATE = {
    "conv1.weight": np.zeros((4, 1, 3, 3), np.float32),
    "conv1.bias": np.zeros(4, np.float32),
    "bn.num_batches_tracked": np.array(0, dtype=np.int64),
    "conv10.weight": np.zeros((2, 2), np.float32),
    "scale": np.array(1.0, np.float32),  # 0-d
    "fc.weight": np.zeros((3, 5), np.float32),
}

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _updates(seed, k, template=TEMPLATE):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(k):
        w = {name: (rng.integers(0, 50, v.shape) if v.dtype.kind == "i" else v + rng.normal(0, 1, v.shape))
             .astype(v.dtype) for name, v in template.items()}
        out.append((w, int(rng.integers(1, 5000))))
    return out


def _float32_bound(updates, name):
    """(N + 2) * 2**-24 * sum(n_i |w_i|) / sum(n_i): the float32 accumulator's bound (StreamingFedAvg's docstring)."""
    total = sum(n for _, n in updates)
    weighted = sum(n * np.abs(w[name].astype(np.float64)) for w, n in updates) / total
    return (len(updates) + 2) * 2.0**-24 * weighted


def _check(got, updates, dtype):
    ref = fedavg(updates)
    assert list(got) == list(ref)
    for k, v in got.items():
        assert v.dtype == ref[k].dtype and v.shape == ref[k].shape, k
        if v.dtype.kind == "i" or dtype == torch.float64:
            np.testing.assert_allclose(v, ref[k], rtol=1e-12, atol=1e-12, err_msg=k)
        else:
            err = np.abs(v.astype(np.float64) - ref[k].astype(np.float64))
            assert np.all(err <= _float32_bound(updates, k)), k


def _staged(template=TEMPLATE, device="cpu", **kw):
    return StreamingFedAvg(template, device=device, kernels="staged", **kw)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_staged_equals_the_reference_within_the_stated_bound(dtype):
    updates = _updates(0, 25)
    agg = _staged(dtype=dtype)
    assert agg.kernels == "staged" and agg.dtype == dtype
    for i, (w, n) in enumerate(updates):
        agg.add(w, n, tag=i)
    assert agg.settle() == []
    assert agg.count == 25 and agg.total_samples == sum(n for _, n in updates)
    _check(agg.result(), updates, dtype)


def test_filters_and_threaded_copies_split_inside_tensors(monkeypatch):
    monkeypatch.setattr(staging, "PARALLEL_MIN_BYTES", 0)  # every update copied by several threads
    updates = _updates(1, 6)
    agg = _staged(include=("conv1.", "fc."), exclude=("conv1.bias",))
    assert agg.names == ("conv1.weight", "fc.weight")
    for w, n in updates:
        agg.add(w, n)  # the filtered-out tensors are ignored
    _check(agg.result(), [(select(w, include=["conv1.w", "fc."]), n) for w, n in updates], torch.float64)
    # the plan covers the flat range once, whatever the cut
    offsets = np.array([0, 36, 40, 41, 56])
    for jobs in (1, 2, 3, 7, 100):
        plan = staging._plan(("a", "b", "c", "d"), offsets, jobs)
        cover = sorted((at, at + hi - lo) for pieces in plan for _, lo, hi, at in pieces)
        assert cover[0][0] == 0 and cover[-1][1] == 56
        assert all(a[1] == b[0] for a, b in zip(cover, cover[1:]))


def _poisoned():
    updates = _updates(2, 7)
    nan, inf = dict(updates[2][0]), dict(updates[5][0])
    nan["fc.weight"] = nan["fc.weight"].copy()
    nan["fc.weight"][1, 2] = np.nan
    nan["conv1.bias"] = nan["conv1.bias"].copy()
    nan["bn.num_batches_tracked"] = np.array(10**6)  # must not reach the maximum
    nan["conv1.bias"][0] = 1e30  # finite: the first *non-finite* tensor is named
    inf["scale"] = np.array(-np.inf, np.float32)
    updates[2], updates[5] = (nan, updates[2][1]), (inf, updates[5][1])
    return updates


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_non_finite_updates_are_refused_at_settle_and_add_nothing(device):
    updates = _poisoned()
    agg = _staged(device=device)
    for i, (w, n) in enumerate(updates):
        agg.add(w, n, tag=f"c{i}")
    assert agg.count == 5  # the property settles, and keeps the refusals for settle()
    good = [u for i, u in enumerate(updates) if i not in (2, 5)]
    assert agg.total_samples == sum(n for _, n in good)
    assert agg.settle() == [
        Refused("c2", "fc.weight", "update: tensor 'fc.weight' contains NaN or Inf"),
        Refused("c5", "scale", "update: tensor 'scale' contains NaN or Inf"),
    ]
    assert agg.settle() == []
    got = agg.result()
    _check(got, good, agg.dtype)
    assert got["bn.num_batches_tracked"] == max(int(w["bn.num_batches_tracked"]) for w, _ in good)
    for i, name in ((2, "fc.weight"), (5, "scale")):  # the messages the numpy path raises
        with pytest.raises(ValueError, match=rf"^update: tensor '{name}' contains NaN or Inf$"):
            StreamingFedAvg(TEMPLATE, device="cpu", kernels="numpy").add(updates[i][0], 1)


def test_reset_forgets_pending_refusals_and_sums():
    updates = _poisoned()
    agg = _staged()
    for w, n in updates[:4]:
        agg.add(w, n, tag="x")
    agg.reset()
    assert agg.count == 0 and agg.total_samples == 0 and agg.settle() == []
    with pytest.raises(ValueError, match="no update was added"):
        agg.result()
    for w, n in updates[3:5]:
        agg.add(w, n)
    _check(agg.result(), updates[3:5], torch.float64)
    agg.add(updates[5][0], 9, tag="bad")  # only a refused update: nothing to average
    assert agg.settle()[0].tag == "bad" and agg.count == 2


def test_structural_errors_still_raise_in_add_and_stage_nothing():
    agg = _staged()
    w = {k: v.copy() for k, v in TEMPLATE.items()}
    with pytest.raises(ValueError, match=r"^update: tensor 'fc.weight' has shape \(5, 3\), expected \(3, 5\)$"):
        agg.add({**w, "fc.weight": np.zeros((5, 3), np.float32)}, 1)
    with pytest.raises(ValueError, match=r"^update: tensor 'conv1.bias' is missing$"):
        agg.add({k: v for k, v in w.items() if k != "conv1.bias"}, 1)
    with pytest.raises(ValueError, match="has dtype int32, expected floating"):
        agg.add({**w, "fc.weight": np.zeros((3, 5), np.int32)}, 1)
    with pytest.raises(ValueError, match="n_samples must be a non-negative integer, got -1"):
        agg.add(w, -1)
    assert agg.count == 0 and agg.settle() == [] and agg._staged.pending == 0
    with pytest.raises(ValueError, match=r"^kernels='staged' needs device 'cpu' or 'cuda', got meta$"):
        StreamingFedAvg(TEMPLATE, device="meta", kernels="staged")
    with pytest.raises(ValueError, match="kernels='staged' cannot hold dtype torch.bfloat16"):
        _staged(dtype=torch.bfloat16)


def test_auto_and_the_other_paths():
    assert GPU_MIN_BYTES == 4 * 2**20
    small = StreamingFedAvg(TEMPLATE)
    assert (small.device.type, small.kernels) == ("cpu", "numpy")
    big = {"w": np.zeros(GPU_MIN_BYTES // 4, np.float32)}
    on_gpu = torch.cuda.is_available()
    agg = StreamingFedAvg(big)
    assert (agg.device.type, agg.kernels) == (("cuda", "staged") if on_gpu else ("cpu", "numpy"))
    assert StreamingFedAvg(TEMPLATE, device="cpu").kernels == "numpy"
    assert StreamingFedAvg(TEMPLATE, kernels="numpy").device.type == "cpu"
    for kernels in ("numpy", "torch"):  # their add raises at once; settle has nothing to say
        other = StreamingFedAvg(TEMPLATE, device="cpu", kernels=kernels)
        other.add(_updates(3, 1)[0][0], 2, tag="a")
        assert other.settle() == [] and other.count == 1
    coord = CoordinateAggregator(TEMPLATE, "median")
    coord.add(_updates(3, 1)[0][0], 2, tag="a")
    assert coord.settle() == [] and coord.count == 1


@pytest.mark.parametrize("kernels", ["staged", "numpy"])
def test_add_updates_logs_and_does_not_count_a_refusal(kernels, caplog):
    updates = _poisoned()
    ups = [Update(f"c{i}", 3, "global", w, n, 0.0) for i, (w, n) in enumerate(updates)]
    ups.append(Update("other", 3, "cluster-1", updates[0][0], 5, 0.0))  # another model: skipped
    agg = StreamingFedAvg(TEMPLATE, device="cpu", kernels=kernels)
    with caplog.at_level(logging.WARNING, logger="server_kit.strategies.base"):
        assert add_updates(agg, ups, "global") == 5
    assert [r.getMessage() for r in caplog.records] == [
        "round 3: update of c2 for global rejected: update: tensor 'fc.weight' contains NaN or Inf",
        "round 3: update of c5 for global rejected: update: tensor 'scale' contains NaN or Inf",
    ]
    assert agg.count == 5


@CUDA
def test_cuda_staged_equals_the_reference_and_the_pinned_transfer_is_timed():
    updates = _updates(4, 25)
    agg = _staged(device="cuda")
    assert agg.dtype == torch.float32 and agg._staged.acc.device.type == "cuda"
    assert all(t.is_pinned() for t in agg._staged._host)
    torch.cuda.set_sync_debug_mode("error")  # no add waits on a copy or a stream (event waits are not flagged)
    try:
        for w, n in updates:
            agg.add(w, n)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert agg.settle() == []
    _check(agg.result(), updates, torch.float32)
    assert 0 < staging.pinned_transfer_seconds(1 << 20) < 1
