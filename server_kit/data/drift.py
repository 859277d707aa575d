"""Drifting partitions: at a given round, chosen devices switch their data to another transform.

A fleet does not stand still: a camera is moved, a user's handwriting changes
device. A :class:`DriftEvent` says that, before round ``round`` trains, the
devices ``clients`` rotate their images (train and test alike) by
``rotate_by`` degrees more, or relabel them by ``relabel`` (a permutation of
the classes), and belong from then on to the true group ``group``: another
group's transform (they should migrate) or a transform nobody had (a new
group: they should form a new cluster). A :class:`DriftSchedule` holds the
events of a run, applies them to the clients' data and says the truth of
every round.

Rotations by multiples of 90 degrees are exact (``numpy.rot90``); others are
interpolated (``scipy.ndimage.rotate``, bilinear, same size, zero fill) and
clipped to [0, 1].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from edge_sdk.validation import check_int

from .clients import ClientData

__all__ = ["DriftEvent", "DriftSchedule", "rotate_images", "rotation_drift"]


def rotate_images(x: np.ndarray, degrees: float) -> np.ndarray:
    """Images ``(n, h, w)`` or ``(n, c, h, w)`` rotated counter-clockwise by ``degrees`` (float32, in [0, 1])."""
    x = np.asarray(x, dtype=np.float32)
    if x.ndim not in (3, 4):
        raise ValueError(f"images must be (n, h, w) or (n, c, h, w), got shape {x.shape}")
    axes = (x.ndim - 2, x.ndim - 1)
    if float(degrees) % 90 == 0:
        return np.rot90(x, k=int(degrees // 90) % 4, axes=axes).copy()
    from scipy.ndimage import rotate

    out = rotate(x, float(degrees), axes=axes, reshape=False, order=1, mode="constant", cval=0.0)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


@dataclass(frozen=True)
class DriftEvent:
    """Before round ``round`` trains, ``clients`` switch their data to another transform.

    Attributes
    ----------
    round : int
        The first round the devices train on their new data (>= 1).
    clients : tuple of str
        The devices that drift.
    group : int
        Their true group from ``round`` on.
    rotate_by : float
        Degrees (counter-clockwise) added to their images' rotation; 0 keeps it.
    relabel : tuple of int, optional
        A permutation of the classes: label ``c`` becomes ``relabel[c]``.
    """

    round: int
    clients: tuple[str, ...]
    group: int
    rotate_by: float = 0.0
    relabel: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        check_int(self.round, "round", 1)
        check_int(self.group, "group", 0)
        if not self.clients or len(set(self.clients)) != len(self.clients):
            raise ValueError(f"clients must be distinct device ids, at least one, got {list(self.clients)}")
        if not np.isfinite(float(self.rotate_by)):
            raise ValueError(f"rotate_by must be a finite number of degrees, got {self.rotate_by!r}")
        if self.relabel is not None and sorted(self.relabel) != list(range(len(self.relabel))):
            raise ValueError(f"relabel must be a permutation of 0..C-1, got {list(self.relabel)}")
        if float(self.rotate_by) % 360 == 0 and self.relabel is None:
            raise ValueError("a drift event must change something: give rotate_by (not a multiple of 360) "
                             "or relabel")

    def transform(self, c: ClientData) -> ClientData:
        """Client ``c``'s data after this event (a new :class:`ClientData`; ``c`` is not changed)."""
        xt, xs, yt, ys = c.x_train, c.x_test, c.y_train, c.y_test
        if float(self.rotate_by) % 360 != 0:
            xt, xs = rotate_images(xt, self.rotate_by), rotate_images(xs, self.rotate_by)
        if self.relabel is not None:
            perm = np.asarray(self.relabel, dtype=np.int64)
            if max(int(yt.max(initial=0)), int(ys.max(initial=0))) >= len(perm):
                raise ValueError(f"relabel has {len(perm)} classes; client {c.cid} has label "
                                 f"{max(int(yt.max(initial=0)), int(ys.max(initial=0)))}")
            yt, ys = perm[yt], perm[ys]
        return replace(c, x_train=xt, x_test=xs, y_train=yt, y_test=ys, group=int(self.group))


class DriftSchedule:
    """The drift events of a run: which devices change, when, and the true groups of every round.

    Parameters
    ----------
    events : sequence of DriftEvent
        No device may drift twice in one round.
    """

    def __init__(self, events: Sequence[DriftEvent]) -> None:
        self.events = sorted(events, key=lambda e: e.round)
        seen: set[tuple[int, str]] = set()
        for e in self.events:
            for cid in e.clients:
                if (e.round, cid) in seen:
                    raise ValueError(f"device {cid} drifts twice in round {e.round}")
                seen.add((e.round, cid))

    @property
    def rounds(self) -> list[int]:
        """The rounds where something drifts."""
        return sorted({e.round for e in self.events})

    def drifted(self, upto: int | None = None) -> list[str]:
        """Every device that drifted in a round <= ``upto`` (all rounds: None), sorted."""
        return sorted({c for e in self.events if upto is None or e.round <= upto for c in e.clients})

    def apply(self, clients: Mapping[str, ClientData], rnd: int) -> dict[str, ClientData]:
        """The clients whose data changes before round ``rnd`` trains, with their new data."""
        changed: dict[str, ClientData] = {}
        for e in self.events:
            if e.round != rnd:
                continue
            for cid in e.clients:
                if cid not in clients:
                    raise ValueError(f"drift event of round {rnd} names unknown device {cid!r}")
                changed[cid] = e.transform(changed.get(cid, clients[cid]))
        return changed

    def truth(self, clients: Sequence[ClientData], rnd: int) -> dict[str, int]:
        """Every device's true group during round ``rnd`` (after the drifts of rounds <= ``rnd``)."""
        groups = {c.cid: int(c.group) for c in clients}
        for e in self.events:
            if e.round <= rnd:
                groups.update({cid: int(e.group) for cid in e.clients if cid in groups})
        return groups


def rotation_drift(clients: Sequence[ClientData], *, round: int, moves: Sequence[tuple[int, int, int]] = (),
                   new: Sequence[tuple[int, int, float, int]] = (), degrees_per_group: float = 90.0,
                   seed: int = 0) -> DriftSchedule:
    """A schedule for a rotation partition: some devices take another group's rotation, some a new one.

    Parameters
    ----------
    clients : sequence of ClientData
        A partition where group ``g`` is rotated by ``g * degrees_per_group`` degrees
        (:func:`~server_kit.data.partition.rotation_partition`).
    round : int
        When the devices drift.
    moves : sequence of (from_group, to_group, count)
        ``count`` devices of ``from_group``, drawn with ``seed``, take ``to_group``'s rotation.
    new : sequence of (from_group, new_group, degrees, count)
        ``count`` devices of ``from_group`` take an absolute rotation of ``degrees`` that no
        group had, as true group ``new_group``.
    """
    rng = np.random.default_rng(seed)
    by_group: dict[int, list[str]] = {}
    for c in clients:
        by_group.setdefault(int(c.group), []).append(c.cid)
    taken: set[str] = set()

    def draw(group: int, count: int) -> tuple[str, ...]:
        check_int(count, "count", 1)
        pool = sorted(c for c in by_group.get(group, []) if c not in taken)
        if count > len(pool):
            raise ValueError(f"group {group} has {len(pool)} devices left to drift, asked for {count}")
        chosen = tuple(sorted(rng.choice(pool, size=count, replace=False).tolist()))
        taken.update(chosen)
        return chosen

    events = [DriftEvent(round, draw(g, n), to, rotate_by=(to - g) * degrees_per_group) for g, to, n in moves]
    events += [DriftEvent(round, draw(g, n), ng, rotate_by=float(deg) - g * degrees_per_group)
               for g, ng, deg, n in new]
    return DriftSchedule(events)
