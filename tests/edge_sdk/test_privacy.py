"""The sketch's local differential privacy: the stated epsilons, the bound they rest on, the owner's budget."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_sdk import bits as _bits
from edge_sdk.privacy import SketchBudget, SketchOverBudget, sketch_epsilon


def test_epsilons_of_the_papers_sketch():
    eps = sketch_epsilon(0.1, 10, 20)
    assert eps.per_bit == pytest.approx(math.log(9.0), rel=1e-12)
    assert eps.per_image == pytest.approx(20 * math.log(9.0), rel=1e-12)
    assert eps.per_device == pytest.approx(200 * math.log(9.0), rel=1e-12)
    assert eps.describe() == ("sketch epsilon 439.4 per device (user level), 43.9 per image, 2.20 per bit "
                              "(P = 0.1, 10 x 20 bits)")
    d = eps.to_dict()
    assert d["bits"] == 200 and d["epsilon_per_image"] == pytest.approx(43.944492, abs=1e-6)


def test_no_flips_is_no_privacy_and_coins_are_perfect():
    assert sketch_epsilon(0.0, 10, 20).per_device == math.inf
    assert sketch_epsilon(0.0, 10, 20).to_dict()["epsilon_per_device"] is None
    assert sketch_epsilon(0.5, 10, 20).per_device == 0.0
    with pytest.raises(ValueError, match=r"flip_prob must be in \[0, 0.5\], got 0.6"):
        sketch_epsilon(0.6, 10, 20)


@pytest.mark.parametrize("p", [0.05, 0.1, 0.25])
def test_one_bits_likelihood_ratio_is_the_stated_epsilon(p):
    """The mechanism the epsilon speaks of, measured: a bit that rounds to 1 comes out 1 with probability 1 - P,
    one that rounds to 0 with P; their ratio is exp(epsilon_bit)."""
    n = 200_000
    ones = np.tile(np.array([[0.0, 1.0]]), (n, 1, 1)).astype(np.float32)  # bit 0 rounds to 0, bit 1 to 1
    packed = _bits.quantize_pack(ones, p, seed=7)
    got = np.unpackbits(packed, axis=1)[:, :2].mean(axis=0)
    sd = math.sqrt(p * (1 - p) / n)
    assert abs(got[0] - p) < 5 * sd and abs(got[1] - (1 - p)) < 5 * sd
    assert math.log(got[1] / got[0]) == pytest.approx(sketch_epsilon(p, 1, 1).per_bit, abs=0.03)


def test_budget_spends_until_the_next_sketch_would_pass_it():
    eps = sketch_epsilon(0.1, 10, 20)
    budget = SketchBudget(900.0)
    budget.spend(eps)
    budget.spend(eps)
    with pytest.raises(SketchOverBudget) as e:
        budget.spend(eps)
    assert str(e.value) == ("sketch refused: its epsilon 439.4 per device (P = 0.1, 200 bits) would bring this "
                            "device's total to 1318.3, above its budget --max-sketch-epsilon 900 (spent so far "
                            "878.9)")
    assert budget.sketches == 2 and budget.spent == pytest.approx(2 * eps.per_device)
    with pytest.raises(ValueError, match="--max-sketch-epsilon must be >= 0, got -1"):
        SketchBudget(-1.0)
    with pytest.raises(SketchOverBudget):
        SketchBudget(1e9).spend(sketch_epsilon(0.0, 1, 1))  # no flips: infinite, never within a budget


def test_a_device_without_torch_keeps_its_budget_and_masks_its_update():
    """The device's privacy steps run on numpy, ONNX Runtime and cryptography alone (a Raspberry Pi without torch):
    the sketch budget, and a whole secure round of three devices whose unmasked sum is the plain one."""
    import subprocess
    import sys
    from pathlib import Path

    code = """
import sys
sys.modules["torch"] = None  # any import of torch fails
import numpy as np
from edge_sdk.client.secure import flat_change
from edge_sdk.privacy import SketchBudget, sketch_epsilon
from edge_sdk.secure import DeviceKeys, DeviceSecureRound, SecureQuantizer, ServerSecureRound
from edge_sdk.secure.params import params_from_command
budget = SketchBudget(500.0)
budget.spend(sketch_epsilon(0.1, 10, 20))
keys = {c: DeviceKeys.generate() for c in ("a", "b", "c")}
fields = {"peers": {c: k.public_bytes.hex() for c, k in keys.items()}, "threshold": 2, "bits": 6, "clip": 5.0,
          "run": "r1"}
params = params_from_command(fields, 3, "c0", 1000)
rng = np.random.default_rng(0)
server, qs, parts = ServerSecureRound(params), {}, {}
for c, k in keys.items():
    x = flat_change({"w": rng.normal(size=1000).astype(np.float32)}, {"w": np.zeros(1000, np.float32)})
    qs[c], _ = SecureQuantizer(5.0, 6, params.ctx).encode(x, rng)
    parts[c] = DeviceSecureRound(k, c, params)
    server.add_masked(parts[c].mask(qs[c]).to_bytes())
for c, req in server.close().items():
    server.add_reveal(parts[c].reveal(req).to_bytes())
print(bool(np.array_equal(server.unmask(), qs["a"] + qs["b"] + qs["c"])), round(budget.spent, 1),
      "torch" in sys.modules and sys.modules["torch"] is not None)
"""
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert out.stdout.split() == ["True", "439.4", "False"], out.stdout + out.stderr
