"""The privacy accountant of a cluster's DP-FedAvg rounds, and the noise that fits a budget.

Each round of a cluster is a Gaussian mechanism (noise multiplier ``z``:
standard deviation ``z * clip`` on the sum of clipped updates) applied to a
sample of the cluster's devices; the sample is modelled as Poisson sampling
with rate ``q = devices asked / devices in the cluster`` (our rounds draw a
fixed number without replacement; the Poisson model is the usual
approximation of DP-FedAvg, McMahan et al. 2018). The rounds compose in
Rényi DP (``dp_accounting``'s RDP accountant, Mironov 2017), converted to
(epsilon, delta) at the end.
"""

from __future__ import annotations

import math

__all__ = ["epsilon_after", "noise_for_budget"]

#: The largest noise multiplier :func:`noise_for_budget` looks at.
MAX_NOISE = 1000.0
#: The Rényi orders the accountant tries: whole ones only (their sampled-Gaussian bound has a closed form; the
#: fractional ones need a series that is slow and at times does not converge).
ORDERS = (*range(2, 65), 80, 96, 128, 192, 256, 512)


def epsilon_after(rounds: int, q: float, noise_multiplier: float, delta: float) -> float:
    """The (epsilon at ``delta``) of ``rounds`` sampled Gaussian rounds; 0 for none, infinity without noise."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from dp_accounting import dp_event, rdp

    acc = rdp.RdpAccountant(list(ORDERS))
    event = dp_event.GaussianDpEvent(noise_multiplier)
    if q < 1.0:
        event = dp_event.PoissonSampledDpEvent(q, event)
    acc.compose(event, int(rounds))
    return float(acc.get_epsilon(delta))


def noise_for_budget(epsilon: float, delta: float, rounds: int, q: float) -> float:
    """The smallest noise multiplier (to 0.1 %) whose ``rounds`` rounds stay within ``epsilon`` at ``delta``.

    Raises ``ValueError`` when even :data:`MAX_NOISE` does not fit.
    """
    hi = 1.0
    while epsilon_after(rounds, q, hi, delta) > epsilon:
        hi *= 2.0
        if hi > MAX_NOISE:
            raise ValueError(f"no noise multiplier up to {MAX_NOISE:g} keeps {rounds} rounds at sampling rate "
                             f"{q:.3g} within epsilon {epsilon:g} at delta {delta:g}")
    lo = 0.0
    while hi - lo > 1e-3 * hi:
        mid = (lo + hi) / 2.0
        if mid > 0 and epsilon_after(rounds, q, mid, delta) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi
