"""Is a run a result? The fidelity verdict of one mode (DESIGN.md section 3a, Mininet-HiFi's rule).

A mode is FAITHFUL only when all of these held over its run:
- no prefill pass and no decode step overran its emulated time: the CPU finished each one's real
  compute inside the window the target GPU would have taken (dualpath/engines/clock.py states the
  margin: 5 % of the window, at least 1 ms);
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

from testbed.metrics import busy_time

CPU_BUSY_MAX = 0.85
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


def verdict(passes: Iterable[dict], steps: Iterable[dict], cpu_busy: float,
            links: Iterable[LinkUse], cpu_own: float | None = None) -> tuple[bool, list[str]]:
    """(faithful, reasons). `passes` and `steps` are PassTiming dicts with "overran";
    `cpu_own`, if known, is the testbed's own processes' share of the CPU (said in the reason)."""
    reasons = []
    for kind, recs in (("prefill passes", list(passes)), ("decode steps", list(steps))):
        late = [r for r in recs if r.get("overran")]
        if late:
            worst = max(late, key=lambda r: r["late_s"] / r["held_s"] if r.get("held_s") else 0)
            reasons.append(f"{len(late)} of {len(recs)} {kind} overran their emulated time (worst: "
                           f"{worst['late_s'] * 1e3:.1f} ms late on a {worst['held_s'] * 1e3:.1f} ms window)")
    if cpu_busy > CPU_BUSY_MAX:
        own = f"; the testbed's processes {cpu_own:.0%}, the rest softirq and other work" if cpu_own is not None else ""
        reasons.append(f"CPU busy {cpu_busy:.0%} of both cores over the run (limit {CPU_BUSY_MAX:.0%}{own}): "
                       f"the host, not the emulated cluster, set the pace")
    for u in links:
        if u.should_saturate and u.rate_share < SATURATION_MIN:
            reasons.append(f"{u.nic} was the bottleneck ({u.busy_share:.0%} of the run busy) but carried "
                           f"{u.rate_share:.0%} of its rate while busy (need {SATURATION_MIN:.0%})")
    return not reasons, reasons
