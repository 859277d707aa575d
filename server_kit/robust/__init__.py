"""Robust aggregation: norm bounding of updates and coordinate-wise rules.

One admitted device can wreck its cluster's model under plain FedAvg: an
update scaled x1000, every weight set to 1e30, or random weights claiming a
huge sample count each took the victims' accuracy from 0.81 to 0.11-0.17 on
digits. Two defences, chosen per run (:class:`RobustConfig`):

* **norm bounding** (on by default): each update's *delta*, its weights
  minus the model it started from, is measured (:func:`delta_norm`, float
  tensors only, float64; NaN or Inf gives ``inf``). The round's reference is
  the median of ALL its finite update norms, every cluster together, so a
  cluster of two where one is hostile still has an honest reference. An
  update whose norm is not finite, or above ``refuse_above`` times the
  reference (:data:`DEFAULT_REFUSE_ABOVE`, 20: not a training step), is
  refused; one above ``norm_bound`` times the reference is scaled back onto
  that bound (:func:`clip_update`, ``w' = ref + delta * min(1, bound /
  ||delta||)``). The default multiple (:data:`DEFAULT_NORM_BOUND`) was chosen
  from clean runs so that none of their updates is clipped (see its
  comment). A clipped update still moves its cluster by up to ``norm_bound``
  typical steps each round; refusing the absurd ones keeps the crude attacks
  (random weights, x1000, 1e30: about 50, 1,000 and over 10**30 times the median
  on digits) from adding even that.
* **coordinate-wise rules** (Yin et al., 2018, "Byzantine-robust distributed
  learning"), unweighted, so a claimed sample count does not matter:
  :func:`coordinate_median` and :func:`trimmed_mean` (``ceil(beta * n)``
  values cut at each end of every coordinate, at least one when ``n >= 3``).

Claimed sample counts are capped at the count the device registered
(:func:`cap_samples`), as the orchestrator does on receipt, so the
in-process simulator weighs updates alike.

Integer tensors (BatchNorm's ``num_batches_tracked``) are neither clipped nor
averaged: every rule keeps their element-wise maximum, as
:mod:`server_kit.aggregate` does.

Memory: streaming FedAvg (:class:`server_kit.aggregate.StreamingFedAvg`)
holds one model's worth of sums per cluster. The coordinate-wise rules need
every update of the cluster at once: :class:`CoordinateAggregator` keeps a
reference to each (the drivers hold the round's updates until it closes
anyway) and stacks one tensor at a time in float64 for the median or the
sort, so its extra memory is ``O(n x largest tensor)`` on top of the
``O(n x model)`` of the buffered updates. Clipping makes a float copy of a
clipped update only.

The code is in three modules, one job each: :mod:`~server_kit.robust.config`
(:class:`RobustConfig`, the defaults and :func:`make_aggregator`),
:mod:`~server_kit.robust.screening` (norms, clipping, refusing, capping) and
:mod:`~server_kit.robust.coordinate` (the coordinate-wise rules).
"""

from .config import (
    AGGREGATORS,
    DEFAULT_NORM_BOUND,
    DEFAULT_REFUSE_ABOVE,
    DEFAULT_TRIM_FRACTION,
    RobustConfig,
    make_aggregator,
)
from .coordinate import CoordinateAggregator, coordinate_median, trim_count, trimmed_mean
from .screening import (
    ScreenReport,
    Verdict,
    apply_verdicts,
    cap_samples,
    clip_update,
    delta_norm,
    judge_norms,
    screen_updates,
    update_norms,
)

__all__ = [
    "AGGREGATORS",
    "CoordinateAggregator",
    "DEFAULT_NORM_BOUND",
    "DEFAULT_REFUSE_ABOVE",
    "DEFAULT_TRIM_FRACTION",
    "RobustConfig",
    "ScreenReport",
    "Verdict",
    "apply_verdicts",
    "cap_samples",
    "clip_update",
    "coordinate_median",
    "delta_norm",
    "judge_norms",
    "make_aggregator",
    "screen_updates",
    "trim_count",
    "trimmed_mean",
    "update_norms",
]
