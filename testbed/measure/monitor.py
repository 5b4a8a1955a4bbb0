"""Fidelity monitor: samples CPU use and per-link byte counters during a run.

The bridge end of every emulated NIC lives in the root namespace, so one
thread reading /sys/class/net there sees every link in both directions without
entering any namespace: the bridge end's tx is what the node received, its rx
what the node sent.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

CPU_SATURATED = 0.90  # busy share of all cores above which a run measures the CPU, not the NICs


@dataclass(frozen=True)
class Sample:
    t: float
    cpu_busy: int  # jiffies, all cores
    cpu_total: int
    bytes: dict[str, tuple[int, int]]  # bridge dev -> (rx, tx)
    own: int = 0  # jiffies of the watched processes (the testbed's own), user + system
    steal: int = 0  # jiffies the hypervisor ran something else (in cpu_busy too)


def cpu_fields() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def busy_total(fields: list[int]) -> tuple[int, int]:
    """(busy, total) jiffies from /proc/stat's cpu line, any machine's."""
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """Share of all cores busy between two busy_total readings (0..1)."""
    return (after[0] - before[0]) / max(after[1] - before[1], 1)


def _read_cpu() -> tuple[int, int]:
    return busy_total(cpu_fields())


def read_steal() -> tuple[int, int]:
    """(steal, total) jiffies, all cores: the time a hypervisor ran something else while this
    machine's CPUs wanted to run (counted as busy by cpu_busy)."""
    fields = cpu_fields()
    return fields[7], sum(fields[:8])


def steal_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    dt = after[1] - before[1]
    return (after[0] - before[0]) / dt if dt > 0 else 0.0


def _read_proc_jiffies(pid: int) -> int:
    """utime + stime of a process, all its threads (0 once it has gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def _read_threads(pid: int) -> dict[str, int]:
    """utime + stime per thread name of a process (threads of one name added up)."""
    out: dict[str, int] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[name] = out.get(name, 0) + int(fields[11]) + int(fields[12])
    return out


def _read_bytes(dev: str) -> tuple[int, int]:
    base = Path("/sys/class/net") / dev / "statistics"
    try:
        return int((base / "rx_bytes").read_text()), int((base / "tx_bytes").read_text())
    except OSError:
        return (0, 0)


class ServersCpu:
    """Other servers' CPU over a measurement: each one's /proc/stat cpu fields read at the start
    and the end by `readers` (server -> a call returning them, or None when it could not)."""

    def __init__(self, readers: dict[str, Callable[[], list[int] | None]]) -> None:
        self.readers = readers
        self.start: dict[str, list[int] | None] = {}
        self.end: dict[str, list[int] | None] = {}

    def __enter__(self) -> "ServersCpu":
        self.start = {name: read() for name, read in self.readers.items()}
        return self

    def __exit__(self, *exc: object) -> None:
        self.end = {name: read() for name, read in self.readers.items()}

    def busy(self) -> dict[str, float | None]:
        """Each server's busy share of its cores between the two readings (None: unread)."""
        return {name: round(busy_share(busy_total(a), busy_total(b)), 3) if (a := self.start[name]) and
                (b := self.end.get(name)) else None for name in self.start}


class Monitor:
    """Background sampler; use as a context manager around a measurement."""

    def __init__(self, devs: list[str], interval_s: float = 0.1, max_samples: int = 100_000,
                 pids: list[int] | None = None):
        """`pids`: processes whose CPU counts as the testbed's own; the rest of the machine's
        busy time is someone else's (a run beside other work is judged, and told, apart)."""
        self.devs = devs
        self.pids = list(pids or [])
        self.interval_s = interval_s
        self.max_samples = max_samples
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpt-monitor", daemon=True)

    def sample(self) -> Sample:
        busy, total = _read_cpu()
        s = Sample(time.monotonic(), busy, total, {d: _read_bytes(d) for d in self.devs},
                   sum(_read_proc_jiffies(p) for p in self.pids), read_steal()[0])
        if len(self.samples) < self.max_samples:
            self.samples.append(s)
        return s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _threads(self) -> dict[tuple[int, str], int]:
        return {(p, name): j for p in self.pids for name, j in _read_threads(p).items()}

    def __enter__(self) -> "Monitor":
        self._threads0 = self._threads()
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sample()
        self._threads1 = self._threads()

    def cpu_by_thread(self, names: dict[int, str], top: int = 12) -> list[dict]:
        """The busiest threads of the watched processes over the run, as shares of all cores:
        where the testbed's own CPU went ({process, thread, share}), busiest first."""
        span = max(self.samples[-1].cpu_total - self.samples[0].cpu_total, 1)
        rows = [{"process": names.get(p, str(p)), "thread": t, "share": round((j - self._threads0.get((p, t), 0)) / span, 4)}
                for (p, t), j in self._threads1.items()]
        return sorted((r for r in rows if r["share"] > 0), key=lambda r: -r["share"])[:top]

    def window(self, t0: float, t1: float) -> tuple[Sample, Sample]:
        inside = [s for s in self.samples if t0 <= s.t <= t1]
        if len(inside) < 2:
            raise ValueError("measurement window too short for the sampling interval")
        return inside[0], inside[-1]

    def cpu_busy(self, t0: float | None = None, t1: float | None = None) -> float:
        """Share of all cores busy over the window (0..1)."""
        a, b = self.window(t0 if t0 is not None else -1e18, t1 if t1 is not None else 1e18)
        return busy_share((a.cpu_busy, a.cpu_total), (b.cpu_busy, b.cpu_total))

    def cpu_own(self) -> float:
        """Share of all cores the watched processes used over the whole run (0..1). Kernel
        work done on their behalf in softirq (the emulated NICs' TCP) is not in it."""
        a, b = self.samples[0], self.samples[-1]
        return (b.own - a.own) / max(b.cpu_total - a.cpu_total, 1)

    def cpu_steal(self) -> float:
        """Share of all cores the hypervisor took over the whole run (0..1): part of cpu_busy
        that no process here used; a contended host shows up in it."""
        a, b = self.samples[0], self.samples[-1]
        return (b.steal - a.steal) / max(b.cpu_total - a.cpu_total, 1)

    def cpu_peak(self, t0: float, t1: float, span_s: float = 0.5) -> float:
        """Highest CPU busy share over any sub-window of about span_s."""
        inside = [s for s in self.samples if t0 <= s.t <= t1]
        peak = 0.0
        j = 0
        for i, s in enumerate(inside):
            while j < len(inside) and inside[j].t - s.t < span_s:
                j += 1
            if j < len(inside):
                e = inside[j]
                peak = max(peak, busy_share((s.cpu_busy, s.cpu_total), (e.cpu_busy, e.cpu_total)))
        return peak
