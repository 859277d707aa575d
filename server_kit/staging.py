"""Moving updates into one flat device buffer: a ring of pinned host slots and deferred finiteness verdicts.

:class:`StagedSum` is the machinery of ``StreamingFedAvg(kernels="staged")``
(:mod:`server_kit.aggregate`). The floating tensors of a model are laid out
end to end, in template order, in one flat accumulator on the device. An
update is added in four steps, none of which waits for the device:

1. its tensors are copied (and cast to the accumulator's dtype) into the
   next of :data:`RING` host slots, each the flat size, with ``np.copyto``;
   an update of :data:`PARALLEL_MIN_BYTES` or more is copied by a few
   threads (numpy releases the GIL on large copies);
2. on CUDA the slot is pinned and goes to the matching device slot in one
   ``non_blocking`` copy on a dedicated copy stream; on the CPU the device
   slot *is* the host slot and nothing moves;
3. the compute stream waits for that copy, then tests the whole slot
   (``isfinite``), keeps the verdict on the device (-1: finite; else the
   flat index of the first NaN or Inf), zeroes the slot if it is not finite
   and adds ``n * slot`` to the accumulator: a refused update adds zeros;
4. :meth:`StagedSum.settle` synchronises once and reads every pending verdict.

The host waits only when it is about to refill a slot whose previous copy
has not finished, that is when the device is :data:`RING` updates behind.

torch is imported only when a :class:`StagedSum` is built.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

if TYPE_CHECKING:
    import torch

    from edge_sdk.compress.frames import Frame

    from .coded_sum import CodedLayout

__all__ = ["PARALLEL_MIN_BYTES", "RING", "BadEntry", "StagedSum", "pinned_transfer_seconds"]

#: Host (and device) staging slots: the device may be this many updates behind before ``add`` waits.
RING: int = 3

#: An update whose staging slot is this large or larger is copied into it by several threads.
PARALLEL_MIN_BYTES: int = 8 * 2**20

_POOL: Optional[ThreadPoolExecutor] = None
_POOL_PID = 0  # a forked child starts its own pool: the parent's threads are not in it
_POOL_LOCK = threading.Lock()


def _copy_threads() -> int:
    return min(8, os.cpu_count() or 1)


def _pool() -> ThreadPoolExecutor:
    """The process's copy threads, shared by every :class:`StagedSum` (started on first use)."""
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL, _POOL_PID = ThreadPoolExecutor(_copy_threads(), thread_name_prefix="fedavg-stage"), os.getpid()
        return _POOL


@dataclass(frozen=True)
class BadEntry:
    """Why :meth:`StagedSum.settle` found an update refused: the first bad tensor, and whether a code was the cause
    (a compressed update's code out of range) rather than a NaN or Inf."""

    tensor: str
    code: bool = False


# (name, first element in the tensor, end in the tensor, first element in the slot)
_Piece = tuple[str, int, int, int]


def _plan(names: tuple[str, ...], offsets: np.ndarray, jobs: int) -> list[list[_Piece]]:
    """The flat range cut into ``jobs`` equal parts, each a list of tensor pieces (tensors may be split)."""
    total = int(offsets[-1])
    bounds = [j * total // jobs for j in range(jobs + 1)]
    plan: list[list[_Piece]] = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pieces = []
        for i, name in enumerate(names):
            start, end = max(lo, int(offsets[i])), min(hi, int(offsets[i + 1]))
            if start < end:
                pieces.append((name, start - int(offsets[i]), end - int(offsets[i]), start))
        if pieces:
            plan.append(pieces)
    return plan


def _copy(slot: np.ndarray, flats: Mapping[str, np.ndarray], pieces: list[_Piece]) -> None:
    for name, lo, hi, at in pieces:
        np.copyto(slot[at:at + hi - lo], flats[name][lo:hi])


class StagedSum:
    """``sum(n_i * w_i)`` of the floating tensors of a model in one flat accumulator, fed through staging slots.

    Parameters
    ----------
    shapes : mapping of str to tuple of int
        The floating tensors, in the order of the flat layout.
    device : torch.device
        ``cpu`` or ``cuda``: where the accumulator lives.
    dtype : torch.dtype
        The accumulator's (and the slots') floating dtype; it needs a numpy twin.

    Attributes
    ----------
    acc : torch.Tensor
        The flat sums (1-d, on ``device``).
    offsets : numpy.ndarray
        Where each tensor starts in ``acc``, and its total size at the end.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], device: torch.device, dtype: torch.dtype) -> None:
        import torch

        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"kernels='staged' needs device 'cpu' or 'cuda', got {device}")
        self.names = tuple(shapes)
        self.shapes = dict(shapes)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes.values()]
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        size = int(self.offsets[-1])
        self.cuda = device.type == "cuda"
        if self.cuda and device.index is None:  # the streams and events belong to one device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.dtype = device, dtype
        self.acc = torch.zeros(size, dtype=dtype, device=device)
        self._host = [torch.empty(size, dtype=dtype, pin_memory=self.cuda) for _ in range(RING)]
        try:
            self._host_np = [t.numpy() for t in self._host]
        except TypeError as e:  # bfloat16 has no numpy twin
            raise ValueError(f"kernels='staged' cannot hold dtype {dtype}: {e}") from None
        self._dev = [torch.empty(size, dtype=dtype, device=device) for _ in range(RING)] if self.cuda \
            else self._host
        if self.cuda:
            self._copy_stream = torch.cuda.Stream(device=device)
            for t in self._dev:  # written on the copy stream, read and freed on the compute stream
                t.record_stream(self._copy_stream)
            self._copied = [torch.cuda.Event() for _ in range(RING)]
            self._freed = [torch.cuda.Event() for _ in range(RING)]
        itemsize = self._host_np[0].itemsize
        jobs = _copy_threads() if size * itemsize >= PARALLEL_MIN_BYTES else 1
        self._plan = _plan(self.names, self.offsets, jobs)
        self._next = 0
        self._verdicts: list[torch.Tensor] = []
        self._layouts: dict[Any, CodedLayout] = {}
        self._coded: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    @property
    def pending(self) -> int:
        """Updates added since the last :meth:`settle`."""
        return len(self._verdicts)

    def views(self) -> dict[str, torch.Tensor]:
        """Each tensor's view into :attr:`acc`, shaped."""
        return {name: self.acc[int(self.offsets[i]):int(self.offsets[i + 1])].view(self.shapes[name])
                for i, name in enumerate(self.names)}

    def _stage(self, i: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Copy the update into host slot ``i`` (after its previous transfer has finished)."""
        if self.cuda:
            self._copied[i].synchronize()  # returns at once unless the device is RING updates behind
        flats = {name: np.asarray(arrays[name]).reshape(-1) for name in self.names}
        slot = self._host_np[i]
        if len(self._plan) == 1:
            _copy(slot, flats, self._plan[0])
        else:
            for done in [_pool().submit(_copy, slot, flats, pieces) for pieces in self._plan]:
                done.result()

    def push(self, arrays: Mapping[str, np.ndarray], n: int) -> None:
        """Add ``n * arrays`` (every name of the layout, shapes already checked) unless it is not finite.

        Nothing waits for the device; the verdict is read by :meth:`settle`.
        """
        i = self._take()
        self._stage(i, arrays)
        self._send(i, self._host[i], self._dev[i])
        self._finish(i, n)

    def push_coded(self, layout: CodedLayout, frames: Mapping[str, Frame], base: torch.Tensor, n: int,
                   factor: float = 1.0) -> None:
        """Add ``n * (base + decoded frames)``: the compressed update's codes cross the bus, the device decodes them.

        ``layout`` is :meth:`coded_layout`'s for the body's method; ``base``
        the flat float32 weights the update started from, on the device
        (:meth:`flat`); ``factor`` scales the decoded change first (a clipped
        update). A code out of range or a weight not finite refuses the
        update (zeros are added); :meth:`settle` says which.
        """
        i = self._take()
        host, dev = self._coded_slots(layout)
        if self.cuda:
            self._copied[i].synchronize()  # the copy stream is in order: slot i's last copy, coded or not, is done
        layout.fill(host[i].numpy(), frames)
        self._send(i, host[i], dev[i])
        first_bad_code = layout.decode(dev[i], base, self._dev[i], factor)
        self._finish(i, n, first_bad_code)

    def coded_layout(self, method: Any) -> CodedLayout:
        """The layout of this accumulator's tensors for compressed bodies of ``method`` (built once)."""
        from .coded_sum import CodedLayout

        got = self._layouts.get(method)
        if got is None:
            sizes = np.diff(self.offsets)
            got = self._layouts[method] = CodedLayout(self.names, sizes, method, self.device)
        return got

    def flat(self, arrays: Mapping[str, np.ndarray]) -> torch.Tensor:
        """A model's floating tensors as one flat float32 tensor on the device, in this layout's order."""
        import torch

        out = torch.empty(int(self.offsets[-1]), dtype=torch.float32, pin_memory=self.cuda)
        view = out.numpy()
        for k, name in enumerate(self.names):
            np.copyto(view[int(self.offsets[k]):int(self.offsets[k + 1])], np.asarray(arrays[name]).reshape(-1),
                      casting="same_kind")
        return out.to(self.device, non_blocking=False) if self.cuda else out

    def _take(self) -> int:
        i = self._next
        self._next = (i + 1) % RING
        return i

    def _coded_slots(self, layout: CodedLayout) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        import torch

        got = self._coded.get(layout.nbytes)
        if got is None:
            host = [torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(RING)]
            dev = [torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device) for _ in range(RING)] \
                if self.cuda else host
            if self.cuda:
                for t in dev:
                    t.record_stream(self._copy_stream)
            got = self._coded[layout.nbytes] = (host, dev)
        return got

    def _send(self, i: int, host: torch.Tensor, dev: torch.Tensor) -> None:
        """On CUDA: ``host`` to ``dev`` on the copy stream once slot ``i``'s last add is done; the compute stream waits."""
        import torch

        if self.cuda:
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(self._freed[i])  # the device slot's previous add is done
                dev.copy_(host, non_blocking=True)
                self._copied[i].record(self._copy_stream)
            torch.cuda.current_stream(self.device).wait_event(self._copied[i])

    def _finish(self, i: int, n: int, first_bad_code: torch.Tensor | None = None) -> None:
        """Device slot ``i``'s verdict kept, the slot added ``n`` times (zeros if refused)."""
        import torch

        slot = self._dev[i]
        if slot.numel() == 0:
            self._verdicts.append(torch.full((), -1, dtype=torch.int64, device=self.device))
            return
        finite = torch.isfinite(slot)
        ok = finite.all()
        first_bad = finite.view(torch.uint8).argmin()  # the first False: the first NaN or Inf
        verdict = torch.where(ok, -1, first_bad)
        if first_bad_code is not None:  # a bad code comes first; it is told apart by adding the size
            verdict = torch.where(first_bad_code >= 0, first_bad_code + slot.numel(), verdict)
            ok = ok & (first_bad_code < 0)
        self._verdicts.append(verdict)
        slot.masked_fill_(~ok, 0)  # a refused update adds zeros
        self.acc.add_(slot, alpha=n)
        if self.cuda:
            self._freed[i].record(torch.cuda.current_stream(self.device))

    def settle(self) -> list[Optional[BadEntry]]:
        """One synchronisation: per update pushed since the last settle, None if it was added, else what refused it."""
        import torch

        if not self._verdicts:
            return []
        flat = torch.stack(self._verdicts).cpu().numpy()  # waits for the compute stream
        self._verdicts = []
        size = int(self.offsets[-1])
        code = flat >= size
        at = np.where(code, flat - size, flat)
        where = np.searchsorted(self.offsets, at, side="right") - 1
        return [None if v < 0 else BadEntry(self.names[int(k)], bool(c)) for v, k, c in zip(flat, where, code)]

    def mean(self, total: int) -> dict[str, np.ndarray]:
        """``acc / total`` on the host in one copy, in the accumulator's dtype: each tensor a shaped view of it."""
        flat = (self.acc / total).cpu().numpy()
        return {name: flat[int(self.offsets[i]):int(self.offsets[i + 1])].reshape(self.shapes[name])
                for i, name in enumerate(self.names)}

    def zero(self) -> None:
        """Forget every sum and pending verdict."""
        self.acc.zero_()
        self._verdicts = []


def pinned_transfer_seconds(n_bytes: int, device: Any = "cuda", repeats: int = 20) -> float:
    """Mean time of one host-to-device copy of ``n_bytes`` from a pinned buffer: the floor of a staged update.

    Timed with CUDA events on a fresh stream after one warm-up copy.

    Raises
    ------
    ValueError
        If ``device`` is not a CUDA device.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"pinned_transfer_seconds needs a CUDA device, got {device}")
    host = torch.empty(int(n_bytes), dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(int(n_bytes), dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        dev.copy_(host, non_blocking=True)
        start.record(stream)
        for _ in range(int(repeats)):
            dev.copy_(host, non_blocking=True)
        end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / int(repeats)
