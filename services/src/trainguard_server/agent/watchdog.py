"""The agent's no-progress watchdog: pure logic, no I/O, no clock of its own (times are passed in).

Contract of :class:`ProgressWatch`:

* **Progress** is what the agent can see of a job moving: a step that advanced in the SDK's events that the
  relay passed on, or a new line of the job's own output (stdout/stderr/log files). A heartbeat that does
  not advance the step is liveness, not progress: the SDK keeps heartbeating from its own thread while
  the training thread is stuck in a collective (that is why it has one).
* **Threshold** ``clamp(factor x interval, floor_s, ceiling_s)`` (:class:`HangPolicy`, defaults in
  :data:`DEFAULT_POLICY`, overridable by flags / ``TRAINGUARD_AGENT_HANG_*``), where ``interval`` scales
  with the job: the SDK's step time when it reports steps, else the 90th percentile of the gaps between the
  job's last :data:`GAPS_KEPT` progress signals (lines come in bursts; the slow end of the cadence is what a
  healthy job can go quiet for; the wait from the start to the first signal is not counted). Before two
  gaps there is no interval and the threshold is ``ceiling_s``.
* :meth:`ProgressWatch.check` answers, at time ``now``, a :class:`Hang` once per episode when the job has
  been without progress for longer than the threshold; the episode ends (and the watch re-arms) at the next
  progress, which :meth:`progress` reports by returning the ended episode's Hang.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, Optional

from trainguard_engine.catalogue import DetectionSettings

_SERVER = DetectionSettings()
"""The pipeline's defaults: the agent's floor and ceiling are its stall_min_s and stall_max_s."""
GAPS_KEPT = 64
MIN_GAP_S = 0.001


@dataclass(frozen=True)
class HangPolicy:
    """``threshold = clamp(factor x interval, floor_s, ceiling_s)`` (see the module doc)."""

    factor: float = 10.0
    floor_s: float = _SERVER.stall_min_s
    ceiling_s: float = _SERVER.stall_max_s

    def threshold_s(self, interval_s: float) -> float:
        if interval_s <= 0:
            return self.ceiling_s
        return min(self.ceiling_s, max(self.floor_s, self.factor * interval_s))

    def describe(self, interval_s: float) -> str:
        if interval_s <= 0:
            return f"ceiling {self.ceiling_s:g} s (no interval measured yet)"
        return (f"clamp({self.factor:g} x interval {interval_s:.3g} s, {self.floor_s:g} s, "
                f"{self.ceiling_s:g} s)")


DEFAULT_POLICY = HangPolicy()
"""factor 10: a job quiet for ten of its slowest usual gaps is not just slow; floor 2 min: checkpoint
saves, evaluation passes and first-step compilation are quiet for that long in healthy jobs (the server's
``stall_min_s``); ceiling 10 min: the DESIGN's rule of thumb (the server's ``stall_max_s``), so a job that
never prints is still called hung."""


@dataclass(frozen=True)
class Hang:
    """An episode without progress: since ``since_ns`` (the last progress), decided at ``decided_ns``."""

    since_ns: int
    decided_ns: int
    threshold_s: float
    interval_s: float
    how: str
    last_step: int

    @property
    def quiet_s(self) -> float:
        return (self.decided_ns - self.since_ns) / 1e9


class ProgressWatch:
    def __init__(self, policy: HangPolicy = DEFAULT_POLICY, *, start_ns: int = 0) -> None:
        self.policy = policy
        self.last_progress_ns = start_ns
        self.last_step = -1
        self.sdk_step_time_s = 0.0
        self._last_step_ns = 0
        self._gaps: Deque[float] = deque(maxlen=GAPS_KEPT)
        self.hang: Optional[Hang] = None
        self._after_start = False

    # ------------------------------------------------------------------------------------ signals
    def started(self, time_ns: int) -> None:
        """The job started at ``time_ns``: the clock runs from here, but the wait for its first output
        (imports, data loading, compilation) is not one of its usual gaps."""
        self.last_progress_ns = max(self.last_progress_ns, time_ns)
        self._after_start = True

    def line(self, time_ns: int) -> Optional[Hang]:
        """The job printed a line at ``time_ns``."""
        return self._progress(time_ns)

    def step(self, step: int, time_ns: int) -> Optional[Hang]:
        """The SDK reported ``step`` at ``time_ns``: progress when it advanced."""
        if step <= self.last_step:
            return None
        if self.last_step >= 0 and self._last_step_ns and time_ns > self._last_step_ns:
            per_step = (time_ns - self._last_step_ns) / 1e9 / (step - self.last_step)
            self.sdk_step_time_s = per_step if not self.sdk_step_time_s else \
                0.8 * self.sdk_step_time_s + 0.2 * per_step
        self.last_step, self._last_step_ns = step, time_ns
        return self._progress(time_ns)

    def sdk_step_time(self, seconds: float) -> None:
        """The SDK's own step-time average (heartbeats): preferred over the agent's estimate."""
        if seconds > 0:
            self.sdk_step_time_s = seconds

    def _progress(self, time_ns: int) -> Optional[Hang]:
        if self._after_start:
            self._after_start = False
        elif self.last_progress_ns and time_ns > self.last_progress_ns:
            gap = (time_ns - self.last_progress_ns) / 1e9
            if gap >= MIN_GAP_S:
                self._gaps.append(gap)
        self.last_progress_ns = max(self.last_progress_ns, time_ns)
        ended, self.hang = self.hang, None
        return ended

    # ------------------------------------------------------------------------------------ decision
    def interval_s(self) -> float:
        """How long the job usually goes between progress signals (0: not known yet)."""
        if self.sdk_step_time_s > 0:
            return self.sdk_step_time_s
        if len(self._gaps) < 2:
            return 0.0
        ordered = sorted(self._gaps)
        return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]

    def threshold_s(self) -> float:
        return self.policy.threshold_s(self.interval_s())

    def deadline_ns(self) -> int:
        """When the job becomes hung without further progress (0: already in an episode or not started)."""
        if self.hang is not None or not self.last_progress_ns:
            return 0
        return self.last_progress_ns + int(self.threshold_s() * 1e9)

    def check(self, now_ns: int) -> Optional[Hang]:
        """A new Hang when the deadline passed (once per episode), else None."""
        deadline = self.deadline_ns()
        if not deadline or now_ns < deadline:
            return None
        interval = self.interval_s()
        self.hang = Hang(self.last_progress_ns, now_ns, self.policy.threshold_s(interval), interval,
                         self.policy.describe(interval), self.last_step)
        return self.hang
