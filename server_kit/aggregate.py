"""Federated averaging on the server: a numpy reference and a streaming accumulator.

Updates arrive from the wire as ``{name: numpy array}`` dicts (a model's
``state_dict``) with the number of samples they were trained on. FedAvg is
their average weighted by those counts.

* :func:`fedavg` is the plain reference: it takes every update at once and
  accumulates in float64 with numpy (:mod:`server_kit.mean`, with
  :class:`~server_kit.mean.RunningMean`, the same arithmetic one update at a
  time, and the checks every update passes).
* :class:`StreamingFedAvg` adds updates one at a time, as they arrive, into
  a single weighted-sum accumulator of torch tensors (on the GPU for a
  large model when there is one; on the CPU numpy kernels update the same
  tensors in place), so the server holds one model's worth of sums however
  many clients report and a round's result is ready right after the last
  update. A malformed update (missing or unexpected tensor, wrong shape or
  dtype kind, bad sample count) is refused with a ``ValueError`` naming the
  tensor, before anything is added: the caller logs it and drops the
  update. An update with NaN or Inf is refused the same way, except on the
  GPU path (``kernels="staged"``, :mod:`server_kit.staging`), which finds
  it without waiting for the device: it adds nothing, and
  :meth:`StreamingFedAvg.settle` returns it as a :class:`Refused`.
* ``include=`` / ``exclude=`` name-prefix filters aggregate part of a model,
  for example the shared convolution base of LeNet-5 over all clients while
  the rest is averaged per cluster (:data:`server_kit.nets.BASE_LAYERS`);
  :func:`server_kit.model_parts.merge` puts the parts back together.

Integer tensors (BatchNorm's ``num_batches_tracked``) are not averaged: both
implementations keep their element-wise maximum over the updates. Floating
tensors come back in the template's dtype (float32 for models from the wire).

torch is imported only when a :class:`StreamingFedAvg` is built (or by
:func:`server_device`), so importing this module stays cheap.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from edge_sdk.validation import check_choice

from .mean import RunningMean, Weights, check_n_samples, check_update, fedavg, spec_of
from .model_parts import Prefixes, prefixes, selected
from .staging import StagedSum

if TYPE_CHECKING:
    import torch

    from edge_sdk.compress.codec import Method
    from edge_sdk.compress.frames import Frame

__all__ = [
    "GPU_MIN_BYTES",
    "KERNELS",
    "Refused",
    "RunningMean",
    "StreamingFedAvg",
    "fedavg",
    "server_device",
    "sums_on_gpu",
]


# --------------------------------------------------------------------------- helpers


def server_device() -> torch.device:
    """The device the server aggregates on: ``cuda`` when available, else ``cpu``.

    Returns
    -------
    torch.device
        ``torch.device("cuda")`` or ``torch.device("cpu")``.
    """
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------- streaming


#: Values of ``StreamingFedAvg(kernels=...)``.
KERNELS: tuple[str, ...] = ("auto", "numpy", "torch", "staged")

#: The smallest model (floating bytes aggregated) that ``kernels="auto"`` puts on a GPU when no
#: ``device`` is given; a smaller one is summed with numpy on the CPU, where it costs less than the
#: transfer's fixed costs. A starting value: the crossover is measured by benchmarks/gpu.py.
GPU_MIN_BYTES: int = 4 * 2**20


@dataclass(frozen=True)
class Refused:
    """An update found not finite by :meth:`StreamingFedAvg.settle`: nothing of it was added.

    Attributes
    ----------
    tag : object
        What ``add(..., tag=)`` was given (a client id).
    tensor : str
        The first tensor, in template order, holding a NaN or Inf.
    message : str
        ``update: tensor 'NAME' contains NaN or Inf``, what the other paths raise.
    """

    tag: object
    tensor: str
    message: str


def sums_on_gpu(template: Weights) -> bool:
    """Whether ``StreamingFedAvg(template)`` (its defaults) sums on a GPU: one is there, the model is large enough."""
    return _placement(None, "auto", _float_bytes(spec_of(template, "template")))[1] == "staged"


def _float_bytes(spec: Mapping[str, tuple[tuple[int, ...], np.dtype, str]]) -> int:
    """The bytes of a spec's floating tensors (what ``kernels="auto"`` weighs against :data:`GPU_MIN_BYTES`)."""
    return sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype, kind in spec.values() if kind == "f")


def _placement(device: Any, kernels: str, float_bytes: int) -> tuple[torch.device, str]:
    """The device and kernels that ``StreamingFedAvg(device=, kernels=)`` resolve to."""
    import torch

    check_choice(kernels, "kernels", KERNELS)
    if device is None and kernels == "auto":
        big = torch.cuda.is_available() and float_bytes >= GPU_MIN_BYTES
        return torch.device("cuda" if big else "cpu"), "staged" if big else "numpy"
    if device is None:
        device = "cpu" if kernels == "numpy" else server_device()
    device = torch.device(device)
    if kernels == "auto":
        kernels = {"cpu": "numpy", "cuda": "staged"}.get(device.type, "torch")
    if kernels == "numpy" and device.type != "cpu":
        raise ValueError(f"kernels='numpy' needs device 'cpu', got {device}")
    return device, kernels


class StreamingFedAvg:
    """FedAvg that adds updates one at a time into one accumulator.

    Three paths do the arithmetic (``kernels``):

    * ``"numpy"`` (the CPU): numpy operations on views of the accumulator
      tensors, in place. Torch's intra-op threads do not speed up this
      memory-bound work, and their many short parallel regions (three per
      tensor per update) stall whenever the cores are shared: on 2 busy
      cores, one ResNet-18 update took 0.3 to 0.6 s with torch kernels and
      about 15 ms with numpy.
    * ``"staged"`` (the GPU, :class:`~server_kit.staging.StagedSum`): the
      floating tensors are views into one flat accumulator; an update is
      copied into a pinned host slot, sent in one transfer on a copy
      stream, tested for NaN and Inf and added on the device, with no host
      synchronisation. A non-finite update adds zeros and :meth:`settle`
      (which ``count``, ``total_samples`` and :meth:`result` call) reports
      it. Also runs on the CPU, the same code without pinning or streams.
    * ``"torch"``: the former GPU path, kept for comparison: per-tensor
      copies and sums, one host synchronisation per update.

    ``"auto"`` (default): without ``device``, ``"staged"`` on CUDA for a
    model of :data:`GPU_MIN_BYTES` floating bytes or more when a GPU is
    there, else ``"numpy"`` on the CPU; with ``device``, ``"numpy"`` on the
    CPU, ``"staged"`` on CUDA, ``"torch"`` elsewhere.

    On a GPU the sums are float32: N updates summed in float32 stay within
    ``(N + 2) * 2**-24 * sum(n_i * |w_i|) / sum(n_i)`` of :func:`fedavg`'s
    float64 result, element-wise (N roundings of the sum and the products,
    the division and the cast; tests/server_kit/test_staging.py tests it).

    Parameters
    ----------
    template : mapping of str to numpy.ndarray
        The model being aggregated (its names, shapes and dtypes; the values
        are not kept).
    include, exclude : sequence of str, optional
        Name-prefix filters: aggregate only the tensors whose names start
        with one of ``include`` (default all), minus those starting with one
        of ``exclude``. Updates may still carry the filtered-out tensors of
        the template; they are ignored.
    device : str or torch.device, optional
        Where the sums live; default: as ``"auto"`` decides, the CPU for
        ``"numpy"``, :func:`server_device` for ``"torch"`` and ``"staged"``.
    dtype : torch.dtype, optional
        Accumulator dtype; default float64 on the CPU and float32 elsewhere.
    kernels : {"auto", "numpy", "torch", "staged"}
        The path, as above.

    Attributes
    ----------
    count : int
        Updates accepted since construction or :meth:`reset`.
    total_samples : int
        Sum of their sample counts.
    names : tuple of str
        The aggregated tensor names.
    kernels : str
        ``"numpy"``, ``"torch"`` or ``"staged"``, as resolved.
    """

    def __init__(self, template: Weights, *, include: Prefixes = None, exclude: Prefixes = None,
                 device: Any = None, dtype: Any = None, kernels: str = "auto") -> None:
        import torch

        inc, exc = prefixes(include, "include"), prefixes(exclude, "exclude")
        full = spec_of(template, "template")
        self._spec = {k: v for k, v in full.items() if selected(k, inc, exc)}
        if not self._spec:
            raise ValueError(
                f"no tensor of the template matches include={include!r}, exclude={exclude!r}"
            )
        self._ignored = frozenset(full) - frozenset(self._spec)
        self.include, self.exclude = inc, exc
        floats = {k: shape for k, (shape, _, kind) in self._spec.items() if kind == "f"}
        self.device, self.kernels = _placement(device, kernels, _float_bytes(self._spec))
        if dtype is None:
            dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch dtype, got {dtype!r}")
        self.dtype = dtype
        self._staged = StagedSum(floats, self.device, dtype) if self.kernels == "staged" else None
        if self._staged is not None:
            self._sums = self._staged.views()
        else:
            self._sums = {k: torch.zeros(s, dtype=dtype, device=self.device)
                          for k, s in floats.items()}
            # Updates in another float dtype are cast (and scaled) into this buffer, the size of
            # the largest tensor, before the add: a mixed-dtype add_ is several times slower.
            largest = max((t.numel() for t in self._sums.values()), default=0)
            self._scratch = torch.empty(largest, dtype=dtype, device=self.device)
        if self.kernels == "numpy":
            try:
                self._views = {k: t.numpy() for k, t in self._sums.items()}
                self._scratch_np = self._scratch.numpy()
            except TypeError as e:  # bfloat16 has no numpy twin
                raise ValueError(f"kernels='numpy' cannot hold dtype {dtype}: {e}") from None
        self._maxima: dict[str, Any] = {}
        # staged: (tag, n, integer tensors) of the updates whose verdicts are not read yet
        self._pending: list[tuple[object, int, dict[str, np.ndarray]]] = []
        self._refused: list[Refused] = []
        self._count = self._total = 0
        #: The model the last compressed update started from, and its flat copy on the device (staged path).
        self._base: tuple[Weights, Any] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The aggregated tensor names, in template order."""
        return tuple(self._spec)

    @property
    def count(self) -> int:
        """Updates accepted since construction or :meth:`reset` (settles the staged path first)."""
        self._settle_pending()
        return self._count

    @property
    def total_samples(self) -> int:
        """Sum of the accepted updates' sample counts (settles the staged path first)."""
        self._settle_pending()
        return self._total

    def add(self, weights: Weights, n_samples: int, *, tag: object = None) -> None:
        """Check one update against the template and add ``n_samples * weights`` to the sums.

        Parameters
        ----------
        weights : mapping of str to numpy.ndarray
            The update; it must hold every aggregated tensor (extra tensors
            of the template filtered out by ``include``/``exclude`` are
            ignored).
        n_samples : int
            Its sample count (non-negative).
        tag : object, optional
            What :meth:`settle` names the update by if it is refused (a client id).

        Raises
        ------
        ValueError
            Naming the tensor, on a missing or unexpected tensor, a wrong
            shape or dtype kind, or NaN or Inf (except on the staged path:
            see :meth:`settle`); or on a bad ``n_samples``. Nothing is
            added then.
        """
        n = check_n_samples(n_samples, "update")
        arrays = check_update(weights, self._spec, "update", self._ignored)
        if self._staged is not None:
            self._staged.push(arrays, n)
            ints = {k: np.array(a, copy=True) for k, a in arrays.items() if k not in self._sums}
            self._pending.append((tag, n, ints))
            return
        if self.kernels == "numpy":
            self._add_numpy(arrays, n)
        else:
            self._add_torch(arrays, n)
        self._count += 1
        self._total += n

    def add_coded(self, frames: Sequence[Frame], method: Method | str, base: Weights, n_samples: int, *,
                  tag: object = None, factor: float = 1.0) -> None:
        """Add a compressed update, ``base`` plus its decoded change, decoding it where the sums live.

        ``frames`` are :func:`edge_sdk.compress.frames.frame_delta`'s of the
        body (``int8`` or ``int4``, read against this model's spec), ``base``
        the model the update started from. On the staged path the codes
        cross to the device and are decoded there
        (:mod:`server_kit.coded_sum`: the host path's bits); a code out of
        range is refused like a NaN, by :meth:`settle`. Otherwise, and for
        integer counters, they are decoded on the host
        (:func:`~edge_sdk.compress.frames.frame_values` and
        :func:`~edge_sdk.compress.add_change`, where a bad code raises
        ``ProtocolError``) and added as :meth:`add` adds. ``base`` is copied to
        the device once per base object: it must not change in place while
        updates from it are being added. ``factor`` (a clipped update) scales
        the floating tensors' decoded change before it is added:
        ``base + float32(change * float32(factor))`` on either side.
        """
        from edge_sdk.compress.codec import Method
        from edge_sdk.compress.frames import applied

        method = Method(method)
        by = {f.name: f for f in frames}
        for name, (shape, _, _) in self._spec.items():
            if name not in by or by[name].shape != shape:
                got = "missing" if name not in by else f"of shape {by[name].shape}, expected {shape}"
                raise ValueError(f"update: tensor {name!r} is {got}")
        on_host = [k for k in self._spec if self._staged is None or k not in self._sums]
        if not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        decoded = {k: applied(base[k], by[k], method, factor) for k in on_host}
        if self._staged is None:
            self.add(decoded, n_samples, tag=tag)
            return
        n = check_n_samples(n_samples, "update")
        if self._base is None or self._base[0] is not base:
            self._base = (base, self._staged.flat(base))
        self._staged.push_coded(self._staged.coded_layout(method), by, self._base[1], n, factor)
        self._pending.append((tag, n, decoded))

    def settle(self) -> list[Refused]:
        """The updates found not finite since the last call: nothing of them was added.

        Staged path: waits once for the device, then applies the integer
        maxima of the finite updates; a refused update counts in neither
        ``count`` nor ``total_samples``. The other paths: ``[]`` (their
        ``add`` raises instead).
        """
        self._settle_pending()
        out, self._refused = self._refused, []
        return out

    def _settle_pending(self) -> None:
        if self._staged is None or not self._pending:
            return
        for (tag, n, ints), bad in zip(self._pending, self._staged.settle()):
            if bad is not None:
                why = "holds a code out of range (compressed-value)" if bad.code else "contains NaN or Inf"
                self._refused.append(Refused(tag, bad.tensor, f"update: tensor {bad.tensor!r} {why}"))
                continue
            for name, a in ints.items():
                self._keep_max(name, a)
            self._count += 1
            self._total += n
        self._pending = []

    def _keep_max(self, name: str, a: np.ndarray) -> None:
        if name in self._maxima:
            np.maximum(self._maxima[name], a, out=self._maxima[name])
        else:
            self._maxima[name] = np.array(a, copy=True)

    def _add_numpy(self, arrays: Mapping[str, np.ndarray], n: int) -> None:
        for name, a in arrays.items():
            if name in self._views and not np.isfinite(a).all():
                raise ValueError(f"update: tensor {name!r} contains NaN or Inf")
        for name, a in arrays.items():
            if name in self._views:
                acc = self._views[name]
                scaled = self._scratch_np[: a.size].reshape(a.shape)
                # dtype= makes the product itself run in the accumulator's precision
                np.multiply(a, float(n), out=scaled, dtype=acc.dtype)
                np.add(acc, scaled, out=acc)
            else:
                self._keep_max(name, a)

    def _to_device(self, a: np.ndarray) -> torch.Tensor:
        import torch

        a = np.asarray(a, order="C")  # not ascontiguousarray: it makes 0-d arrays 1-d
        if not a.flags.writeable:  # read-only buffers (safetensors, frombuffer) are only read here
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                t = torch.from_numpy(a)
        else:
            t = torch.from_numpy(a)
        return t.to(self.device, non_blocking=False)

    def _add_torch(self, arrays: Mapping[str, np.ndarray], n: int) -> None:
        import torch

        staged = {name: self._to_device(a) for name, a in arrays.items()}
        floats = [name for name in staged if name in self._sums]
        if floats:
            # A NaN or Inf anywhere makes a tensor's sum non-finite: one cheap sum per tensor
            # and one device sync. A non-finite sum can also be an overflow of finite values,
            # so the exact element-wise test decides before a tensor is blamed.
            sums = torch.stack([staged[k].sum() for k in floats])
            if not bool(torch.isfinite(sums).all()):
                for k in floats:
                    if not bool(torch.isfinite(staged[k]).all()):
                        raise ValueError(f"update: tensor {k!r} contains NaN or Inf")
        for name, t in staged.items():
            if name in self._sums:
                acc = self._sums[name]
                if t.dtype != acc.dtype:
                    t = self._scratch[: t.numel()].view(t.shape).copy_(t)
                acc.add_(t, alpha=n)
            elif name in self._maxima:
                torch.maximum(self._maxima[name], t, out=self._maxima[name])
            else:
                self._maxima[name] = t.clone()

    def result(self) -> dict[str, np.ndarray]:
        """The weighted average of the updates added so far (settles the staged path first).

        Returns
        -------
        dict of str to numpy.ndarray
            Aggregated tensors (see ``names``) on the CPU: floating ones in
            the template's dtype, integer ones the element-wise maximum.

        Raises
        ------
        ValueError
            If no update was accepted or their total weight is zero.
        """
        if self.count == 0:
            raise ValueError("no update was added; nothing to average")
        if self._total == 0:
            raise ValueError("total weight is zero: every update has n_samples == 0")
        means = self._staged.mean(self._total) if self._staged is not None else {}
        out = {}
        for name, (_, dtype, kind) in self._spec.items():
            if kind == "f" and self.kernels == "numpy":
                out[name] = (self._views[name] / self._total).astype(dtype, copy=False)
            elif kind == "f" and name in means:
                out[name] = means[name].astype(dtype, copy=False)
            elif kind == "f":
                avg = self._sums[name] / self._total
                out[name] = avg.cpu().numpy().astype(dtype, copy=False)
            else:
                m = self._maxima[name]
                m = m if isinstance(m, np.ndarray) else m.cpu().numpy()
                out[name] = np.array(m, dtype=dtype, copy=True)
        return out

    def reset(self) -> None:
        """Forget every update, pending verdict and refusal (the accumulator is kept and zeroed)."""
        if self._staged is not None:
            self._staged.zero()  # and its pending verdicts
        else:
            for t in self._sums.values():
                t.zero_()
        self._maxima.clear()
        self._pending, self._refused = [], []
        self._count = self._total = 0

    def __repr__(self) -> str:
        pending = f", pending={len(self._pending)}" if self._staged is not None else ""
        return (f"StreamingFedAvg({len(self._spec)} tensors, device={self.device}, dtype={self.dtype}, "
                f"kernels={self.kernels!r}, count={self._count}, total_samples={self._total}{pending})")
