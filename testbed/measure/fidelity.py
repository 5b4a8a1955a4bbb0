"""Is a run a result? The fidelity verdict of one mode (DESIGN.md section 3a, Mininet-HiFi's rule).

A mode is FAITHFUL only when all of these held over its run:
- the prefill passes and the decode steps kept their emulated time: the CPU finished each one's
  real compute inside the window the target GPU would have taken (dualpath/engines/clock.py
  states the margin: 10 % of the window, at least 2 ms), all but at most OVERRUN_SHARE of each
  kind (rounded down: a run of fewer than 100 passes may have none), and the lateness of those
  that overran came to at most LATENESS_MAX of the run's JCT (lateness within the margin is
  jitter, ~5 ms a pass, and is not summed: on two PEs it adds up to ~1 % of a JCT by itself,
  without slowing the schedule, which the next window catches up). The allowance is for the lone
  host hiccup: runs on a quiet machine at 30-45 % CPU still had one pass in ~200 slip 15-25 ms
  (a 0.05 % JCT error); a CPU that cannot keep up overruns many (fig13's cold burst at x0.002:
  3-4 of ~223, up to 260 ms late) and is still UNFAITHFUL. Every overrun is reported either way;
- the machine's CPU was below saturation: busy share of all cores <= CPU_BUSY_MAX over the run;
- every link that should have been saturated reached its rate: a storage NIC that was busy
  reading for at least SATURATED_SHARE of the run (its node's read queue was never empty then,
  so it was the bottleneck) carried at least SATURATION_MIN of its payload rate while busy.
Otherwise it is UNFAITHFUL and the reasons say which rule broke, with the numbers. Nothing here
measures; it judges what the run recorded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from testbed.measure.metrics import busy_time

CPU_BUSY_MAX = 0.85
OVERRUN_SHARE = 0.01  # of a mode's passes (and, separately, of its steps) that may overrun
LATENESS_MAX = 0.01  # the overrunning passes' and steps' lateness together, over the run's JCT
SATURATED_SHARE = 0.5  # busy at least this share of the run: the link was a bottleneck
SATURATION_MIN = 0.9  # a bottleneck link must carry at least this share of its payload rate


def payload_share(mtu: int) -> float:
    """TCP payload per wire byte at this MTU, as HTB counts the wire (IP packet + Ethernet header):
    (MTU - 20 IP - 20 TCP - 12 timestamp option) / (MTU + 14)."""
    return (mtu - 52) / (mtu + 14)


@dataclass(frozen=True)
class LinkUse:
    """What one storage NIC did over a mode's run."""

    nic: str
    rate_bps: float  # configured (wire) rate
    run_s: float  # the mode's run time
    busy_s: float  # time with a load being read
    bytes: int  # payload read
    payload_share: float

    @property
    def busy_share(self) -> float:
        return self.busy_s / self.run_s if self.run_s > 0 else 0.0

    @property
    def rate_share(self) -> float:
        """Payload carried while busy, over what the link can carry."""
        cap = self.rate_bps / 8 * self.payload_share
        return self.bytes / self.busy_s / cap if self.busy_s > 0 and cap > 0 else 0.0

    @property
    def should_saturate(self) -> bool:
        return self.busy_share >= SATURATED_SHARE

    def to_dict(self) -> dict:
        return {"nic": self.nic, "rate_bps": self.rate_bps, "busy_share": round(self.busy_share, 3),
                "rate_share_while_busy": round(self.rate_share, 3), "bytes": self.bytes,
                "should_saturate": self.should_saturate}


def link_use(nic: str, rate_bps: float, run: tuple[float, float], loads: Iterable[tuple[float, float, int]],
             mtu: int) -> LinkUse:
    """A storage NIC's use from its host agent's read log, clipped to the run [t0, t1]."""
    t0, t1 = run
    inside = [(max(s, t0), min(e, t1), n) for s, e, n in loads if e > t0 and s < t1]
    return LinkUse(nic, rate_bps, t1 - t0, busy_time((s, e) for s, e, _ in inside),
                   sum(n for _, _, n in inside), payload_share(mtu))


def _overruns(kind: str, recs: list[dict]) -> tuple[str, bool] | None:
    """(what overran, whether that is beyond the allowance), or None if nothing did."""
    late = [r for r in recs if r.get("overran")]
    if not late:
        return None
    worst = max(late, key=lambda r: r["late_s"] / r["held_s"] if r.get("held_s") else 0)
    text = (f"{len(late)} of {len(recs)} {kind} overran their emulated time (worst: "
            f"{worst['late_s'] * 1e3:.1f} ms late on a {worst['held_s'] * 1e3:.1f} ms window)")
    return text, len(late) > int(OVERRUN_SHARE * len(recs))


def verdict(passes: Iterable[dict], steps: Iterable[dict], cpu_busy: float,
            links: Iterable[LinkUse], cpu_own: float | None = None,
            jct_s: float | None = None, cpu_steal: float = 0.0,
            server_cpu: dict[str, float] | None = None) -> tuple[bool, list[str]]:
    """(faithful, reasons). `passes` and `steps` are PassTiming dicts with "overran";
    `cpu_own`, if known, is the testbed's own processes' share of the CPU (said in the reason);
    `jct_s` (testbed s), if known, bounds the lateness of all passes and steps together;
    `cpu_steal`, the hypervisor's share of the CPU, is named where it is part of a reason;
    `server_cpu`, each other server's busy share of its own cores over the run (None: unread)."""
    reasons = []
    passes, steps = list(passes), list(steps)
    for kind, recs in (("prefill passes", passes), ("decode steps", steps)):
        o = _overruns(kind, recs)
        if o is not None and o[1]:
            reasons.append(o[0])
    late_s = sum(r.get("late_s", 0.0) for r in passes + steps if r.get("overran"))
    if jct_s and late_s > LATENESS_MAX * jct_s:
        reasons.append(f"the passes and steps that overran were {late_s * 1e3:.0f} ms late in all, {late_s / jct_s:.1%} "
                       f"of the run's JCT (limit {LATENESS_MAX:.0%})")
    if cpu_busy > CPU_BUSY_MAX:
        own = f"; the testbed's processes {cpu_own:.0%}, the rest softirq and other work" if cpu_own is not None else ""
        own += f"; the hypervisor's steal {cpu_steal:.0%}" if cpu_steal >= 0.01 else ""
        reasons.append(f"CPU busy {cpu_busy:.0%} of both cores over the run (limit {CPU_BUSY_MAX:.0%}{own}): "
                       f"the host, not the emulated cluster, set the pace")
    for name, busy in (server_cpu or {}).items():
        if busy is None:
            reasons.append(f"server {name}: its CPU could not be read over SSH, so nothing says it kept up")
        elif busy > CPU_BUSY_MAX:
            reasons.append(f"server {name}: CPU busy {busy:.0%} of its cores over the run (limit {CPU_BUSY_MAX:.0%}): "
                           "that server, not the emulated cluster, set the pace")
    for u in links:
        if u.should_saturate and u.rate_share < SATURATION_MIN:
            reasons.append(f"{u.nic} was the bottleneck ({u.busy_share:.0%} of the run busy) but carried "
                           f"{u.rate_share:.0%} of its rate while busy (need {SATURATION_MIN:.0%})")
    return not reasons, reasons


def tolerated(passes: Iterable[dict], steps: Iterable[dict]) -> list[str]:
    """The overruns within the allowance, said in the report beside a FAITHFUL verdict."""
    out = []
    for kind, recs in (("prefill passes", list(passes)), ("decode steps", list(steps))):
        o = _overruns(kind, recs)
        if o is not None and not o[1]:
            out.append(f"{o[0]}: within the allowance of {OVERRUN_SHARE:.0%}")
    return out
