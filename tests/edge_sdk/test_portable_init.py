"""Portable seeded initial weights: pinned known answers, the laws of torch's initialisation, refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from edge_sdk.models.portable_init import initial_tensors, portable_uniform, tensors_sha256
from edge_sdk.training.torch_support import torch_available

FIXTURE = Path(__file__).resolve().parents[1] / "pi" / "portable_init.json"
LENET_0 = "b9200f64d3159d2db07f20b5b173cb38b7bf1430a6d3950ab73c1907c946d56c"
DIGITS_3 = "e2145eb10cd6fad404e95538b13ca489aee256876af3846d1070b5e552fb8d4b"
needs_torch = pytest.mark.skipif(not torch_available(), reason="torch is not installed")


def _splitmix64(state: int, n: int) -> list[int]:
    mask = (1 << 64) - 1
    out = []
    for _ in range(n):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append(z ^ (z >> 31))
    return out


@needs_torch
def test_initial_weights_are_pinned_bit_for_bit():
    from edge_sdk.models.model_checks import state_spec
    from edge_sdk.training.torch_support import initial_weights

    lenet = initial_weights("lenet5_1x28x28_10", 0)
    assert tensors_sha256(lenet) == LENET_0
    assert tensors_sha256(initial_weights("digits_cnn_1x8x8_10", 3)) == DIGITS_3
    bits = lenet["features.0.weight"].reshape(-1)[:4].view(np.uint32).tolist()
    assert bits == [0x3E1D010D, 0xBCE05E80, 0xBE41F905, 0x3E40DF8D]
    # the Pi step's fixture holds the same specs and hashes
    cases = json.loads(FIXTURE.read_text())["cases"]
    assert [c["sha256"] for c in cases] == [LENET_0, DIGITS_3]
    assert [[n, list(s), d] for n, (s, d) in state_spec(lenet).items()] == cases[0]["spec"]


def test_portable_uniform_is_splitmix64_in_0_1():
    u = portable_uniform(5, 2, 100_000)
    assert u.dtype == np.float32 and 0.0 <= u.min() and u.max() < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    seed_mix = _splitmix64((5 - 1) * 0x9E3779B97F4A7C15 % 2**64, 1)[0]
    ref = [(z >> 40) * 2.0**-24 for z in _splitmix64((seed_mix + (2 << 32)) * 0x9E3779B97F4A7C15 % 2**64, 4)]
    assert u[:4].tolist() == ref
    assert np.array_equal(portable_uniform(5, 2, 10), u[:10])  # a prefix, whatever n
    assert not np.array_equal(portable_uniform(5, 3, 10), u[:10])
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 2\*\*64\), got -1$"):
        portable_uniform(-1, 0, 3)


def test_bounds_follow_the_fan_in_and_streams_do_not_depend_on_other_sizes():
    spec = {"fc.weight": ((300, 400), "float32"), "fc.bias": ((300,), "float32"), "out.weight": ((3, 2), "float64")}
    w = initial_tensors(spec, 9)
    b = np.float32(1 / math.sqrt(400))
    assert b * 0.9 < np.abs(w["fc.weight"]).max() <= b and np.abs(w["fc.bias"]).max() <= b
    assert w["out.weight"].dtype == np.float64 and np.abs(w["out.weight"]).max() <= 1 / math.sqrt(2)
    other = initial_tensors({"fc.weight": ((7, 400), "float32"), "fc.bias": ((300,), "float32")}, 9)
    np.testing.assert_array_equal(other["fc.bias"], w["fc.bias"])


@needs_torch
def test_batch_norm_tensors_of_resnet18():
    from edge_sdk.training.torch_support import initial_weights

    w = initial_weights("resnet18_3x32x32_10", 0)
    assert (w["bn1.weight"] == 1).all() and (w["bn1.bias"] == 0).all()
    assert (w["bn1.running_mean"] == 0).all() and (w["bn1.running_var"] == 1).all()
    assert w["bn1.num_batches_tracked"].dtype == np.int64 and w["bn1.num_batches_tracked"] == 0
    assert 0 < np.abs(w["conv1.weight"]).max() <= np.float32(1 / math.sqrt(27))


def test_a_tensor_without_a_rule_is_refused():
    with pytest.raises(ValueError, match=r"^no portable initialisation rule for tensor 'emb\.table' "
                                         r"of shape \(4, 2\)$"):
        initial_tensors({"emb.table": ((4, 2), "float32")}, 0)
    with pytest.raises(ValueError, match=r"^no portable initialisation rule for tensor 'lone\.bias': "
                                         r"no float sibling 'lone\.weight' in the spec$"):
        initial_tensors({"lone.bias": ((4,), "float32")}, 0)
