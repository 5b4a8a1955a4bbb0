"""Engine time: the host's clock, or the target GPU's (DESIGN.md section 3a).

Correctness is real and time is the target's. The engine computes every token with the real
model on the CPU, then holds the result until the target GPU would have finished: a forward pass
(or a decode step) that the cost model says takes `e` seconds on the target lasts `e * k`
seconds here, where k is the run's dilation (emulators/gpu/cost.py derives it so that a request's
KV-load time and its compute time keep the target cluster's ratio). The CPU work must fit inside
that window; what does not is recorded as lateness and makes the run UNFAITHFUL.

With `dilation=None` ("compute: cpu" in a topology) nothing is held: passes last what the CPU
takes, as the testbed did before it had an emulated clock.

`now` and `sleep` are injectable so that tests drive a virtual clock and assert the pacing
arithmetic exactly, without timing anything.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

# A pass overruns when it ends later than its emulated schedule by more than this share of its
# window (or by more than LATE_FLOOR_S, whichever is larger). Two cores shared by four "GPUs",
# the NICs' emulation and the control plane make a few ms of scheduling jitter unavoidable; a
# pass that slips 10 % of its window moves a request's JCT by far less than a percent, and every
# slip is still recorded (summary.json: fidelity.late_testbed_s).
LATE_SHARE = 0.10
LATE_FLOOR_S = 0.002


@dataclass
class PassTiming:
    """One forward pass or decode step, in testbed seconds unless named emulated."""

    emulated_s: float = 0.0  # the target's duration of the compute (cost model)
    held_s: float = 0.0  # what the engine held it for here: emulated_s * dilation (0 on cpu)
    compute_wall_s: float = 0.0  # real compute, wall time
    compute_cpu_s: float = 0.0  # real compute, CPU time of the computing thread
    io_wait_s: float = 0.0  # waiting for KV to land (real I/O, not compute)
    late_s: float = 0.0  # how far the real compute ran past the held window, summed
    # model-class collectives the pass waited for (dualpath/engines/collective.py): real network
    # time on the emulated links, so already in the target's time times the dilation, like a KV
    # load; it extends the schedule and is never lateness (only compute can be late)
    collective_s: float = 0.0
    collectives: int = 0

    def add(self, other: "PassTiming") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)

    @property
    def overran(self) -> bool:
        return self.late_s > max(LATE_FLOOR_S, LATE_SHARE * self.held_s) if self.held_s else False

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}


class DeviceClock:
    """The clock an engine computes against."""

    def __init__(self, dilation: float | None = None, now: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if dilation is not None and not dilation > 0:
            raise ValueError(f"dilation must be > 0, got {dilation!r}")
        self.dilation = dilation
        self.now, self._sleep = now, sleep

    @property
    def emulated(self) -> bool:
        return self.dilation is not None

    def deadline(self, start: float, emulated_s: float, timing: PassTiming) -> float:
        """The compute that began at `start` has just finished: when would the target have
        finished it (start + emulated_s * dilation, or now if that has passed)? Records the
        window and any lateness in `timing`. On the host's clock: now."""
        now = self.now()
        if not self.emulated:
            return now
        end = self.window(start, emulated_s, timing)
        if now > end:
            timing.late_s += now - end
            return now
        return end

    def window(self, start: float, emulated_s: float, timing: PassTiming) -> float:
        """Schedule a window of emulated_s target seconds from `start`; returns its end."""
        held = emulated_s * self.dilation
        timing.emulated_s += emulated_s
        timing.held_s += held
        return start + held

    def hold(self, start: float, emulated_s: float, timing: PassTiming) -> float:
        """Schedule a window (see `window`) and wait until it ends; returns its scheduled end,
        even when the compute ran past it, so that a later window can catch the time up. The
        caller judges lateness where it matters (`finish`)."""
        if not self.emulated:
            return self.now()
        end = self.window(start, emulated_s, timing)
        self.sleep_until(end)
        return end

    def sleep_until(self, t: float) -> None:
        """Wait until the clock reads `t` (at once if it already has)."""
        while (left := t - self.now()) > 0:
            self._sleep(left)

    def finish(self, end: float, timing: PassTiming) -> None:
        """The work whose schedule ended at `end` is done now: record how late it is."""
        if self.emulated:
            timing.late_s += max(0.0, self.now() - end)
