"""What a run remembers of its devices' pace across rounds: training times, broken promises, rounds without answer.

:class:`Pace` keeps, for the whole run:

- **training times**: the seconds each device took from the round's start to
  its valid update, and the slowest of each group of devices. A device's
  "still training" claim keeps a round open past its deadline only while the
  round is younger than ``plausible_factor`` times what it took before (its
  own time, else its group's); a device never measured in a group never
  measured is bounded by the round's cap alone;
- **broken promises**: a device that kept a round open past its deadline by
  its claims and then sent no valid update for that round loses the right to
  extend any later round of the run (logged once);
- **rounds in a row without a usable answer**: a device tasked in a round
  whose update was refused, or that stayed silent (online at the close, no
  update and no refusal: :attr:`~.round_wait.DeviceOutcome.STRAGGLER`, an
  endless "still training" included), in ``bench_after`` rounds in a row is
  benched: not tasked again in this run, logged once, listed in
  ``results.json`` with the reason (``update refused in 3 rounds in a row
  ...``, ``no answer in 3 rounds in a row ...``, or ``no usable answer ...``
  when both). A valid update ends the streak; a round the device spent
  offline neither ends nor lengthens it. 0 turns benching off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping

from .round_wait import DeviceOutcome, RoundWait

__all__ = ["DEFAULT_BENCH_AFTER", "PLAUSIBLE_FACTOR", "Pace"]

log = logging.getLogger(__name__)

#: Rounds in a row with a refused update or none after which a device is benched for the run.
DEFAULT_BENCH_AFTER = 3
#: A progress claim is plausible while the round is younger than this multiple of the device's past time.
PLAUSIBLE_FACTOR = 2.0


class Pace:
    """A run's memory of its devices' pace (see the module docstring).

    Parameters
    ----------
    bench_after : int
        Rounds in a row without a usable answer (refused, or silent) that bench a device (0: never).
    plausible_factor : float
        How much longer than its past time a device's claim may keep a round open.
    """

    def __init__(self, bench_after: int = DEFAULT_BENCH_AFTER, plausible_factor: float = PLAUSIBLE_FACTOR) -> None:
        if bench_after < 0:
            raise ValueError(f"bench_after must be >= 0, got {bench_after}")
        if not plausible_factor >= 1.0:
            raise ValueError(f"plausible_factor must be >= 1, got {plausible_factor}")
        self.bench_after = int(bench_after)
        self.plausible_factor = float(plausible_factor)
        #: The slowest valid update of each device (seconds from its round's start).
        self.device_s: dict[str, float] = {}
        #: The slowest valid update in each group of devices (by the models they train).
        self.group_s: dict[tuple[str, ...], float] = {}
        #: Devices whose claims kept a round open and ended in no update: they extend no round again.
        self.no_extension: dict[str, int] = {}
        #: Rounds in a row each device sent no usable answer (its update refused, or none while online).
        self.unusable_streak: dict[str, int] = {}
        #: How many of those rounds each device was silent (the others: refused).
        self.silent_streak: dict[str, int] = {}
        #: Benched devices, with the reason.
        self.benched: dict[str, str] = {}

    @property
    def slowest_s(self) -> float:
        """The slowest valid update of the run so far (seconds from its round's start; 0 before any)."""
        return max(self.device_s.values(), default=0.0)

    def plausible_s(self, cid: str, group: tuple[str, ...]) -> float | None:
        """How long a round may be while ``cid``'s claims keep it open (None: nothing measured yet)."""
        past = self.device_s.get(cid, self.group_s.get(group))
        return None if past is None else self.plausible_factor * past

    def may_extend(self, cid: str, group: tuple[str, ...], elapsed: float) -> bool:
        """Whether ``cid``'s progress claim may keep a round ``elapsed`` seconds old open."""
        if cid in self.no_extension:
            return False
        limit = self.plausible_s(cid, group)
        return limit is None or elapsed <= limit

    def note_update(self, wait: RoundWait, cid: str) -> None:
        """A valid update of ``cid`` in ``wait``'s round: its time, and its group's, measured (O(1))."""
        s = wait.reported_at.get(cid)
        if s is None:
            return
        g = wait.group_of[cid]
        self.device_s[cid] = max(self.device_s.get(cid, 0.0), s)
        self.group_s[g] = max(self.group_s.get(g, 0.0), s)

    def after_round(self, wait: RoundWait, extended_by: Iterable[str], *,
                    online: Callable[[str], bool]) -> list[str]:
        """The round closed: promises kept or broken, streaks of rounds without a usable answer.

        ``online`` says whether a device was online at the close (a silent
        device is online; one that went offline is not silent). Returns the
        devices benched now.
        """
        for cid in sorted(set(extended_by) - wait.answered):
            if cid not in self.no_extension:
                self.no_extension[cid] = wait.round
                log.warning("round %d: %s kept the round open past its deadline saying it was training, and sent "
                            "no update: its progress reports extend no later round", wait.round, cid)
        benched = []
        for cid in sorted(wait.expected):
            outcome = wait.outcome(cid, online)
            if outcome is DeviceOutcome.REPORTED:
                self.unusable_streak.pop(cid, None)
                self.silent_streak.pop(cid, None)
                continue
            if outcome is DeviceOutcome.OFFLINE:
                continue
            n = self.unusable_streak[cid] = self.unusable_streak.get(cid, 0) + 1
            if outcome is DeviceOutcome.STRAGGLER:
                self.silent_streak[cid] = self.silent_streak.get(cid, 0) + 1
            if self.bench_after and n >= self.bench_after and cid not in self.benched:
                self.benched[cid] = self._reason(cid, wait)
                benched.append(cid)
                log.warning("benched %s for the rest of the run: %s", cid, self.benched[cid])
        return benched

    def _reason(self, cid: str, wait: RoundWait) -> str:
        """Why ``cid`` is benched after ``wait``'s round: its streak, and what became of it in that round."""
        n, silent = self.unusable_streak[cid], self.silent_streak.get(cid, 0)
        last = "silent" if not wait.was_refused(cid) else wait.refusals[cid]
        if silent == 0:
            return f"update refused in {n} rounds in a row (last, round {wait.round}: {last})"
        if silent == n:
            return f"no answer in {n} rounds in a row (last, round {wait.round}: {last})"
        return (f"no usable answer in {n} rounds in a row ({silent} silent, {n - silent} refused; last, "
                f"round {wait.round}: {last})")

    def state(self) -> dict[str, object]:
        """For a checkpoint (JSON-able)."""
        return {"device_s": dict(self.device_s), "group_s": {"+".join(g): s for g, s in self.group_s.items()},
                "no_extension": dict(self.no_extension), "unusable_streak": dict(self.unusable_streak),
                "silent_streak": dict(self.silent_streak), "benched": dict(self.benched)}

    def load_state(self, st: Mapping[str, object]) -> None:
        """What :meth:`state` wrote (or an older checkpoint's ``refused_streak``)."""
        def table(key: str) -> dict:
            v = st.get(key) or {}
            return dict(v) if isinstance(v, Mapping) else {}

        self.device_s = {str(c): float(s) for c, s in table("device_s").items()}
        self.group_s = {tuple(str(g).split("+")): float(s) for g, s in table("group_s").items()}
        self.no_extension = {str(c): int(r) for c, r in table("no_extension").items()}
        # a checkpoint written before silence counted has its refusals alone, as "refused_streak"
        streak = table("unusable_streak") if "unusable_streak" in st else table("refused_streak")
        self.unusable_streak = {str(c): int(n) for c, n in streak.items()}
        self.silent_streak = {str(c): int(n) for c, n in table("silent_streak").items()}
        self.benched = {str(c): str(r) for c, r in table("benched").items()}
