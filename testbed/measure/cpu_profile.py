"""Where a run's CPU goes: process roles, activities from sampled stacks, and the physical floor.

Pure logic for `dualpath profile run` (testbed/calibrate/run_profile.py does the I/O). The
exact numbers are each process's own counters (utime + stime, read from /proc while it lives)
and the kernel's softirq and irq time; a sampling profiler's stacks only split each process's
measured CPU into activities, in the proportions its samples fell in. So a profiler that
samples sparsely blurs the split but never the totals.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

# A process's role from its command line: the testbed starts each one with `python -m MODULE`.
_MODULE_ROLES = {
    "dualpath.nodes.host": "host agents",
    "emulators.kvstore": "store",
    "emulators.mooncake_store": "store",
    "testbed.cli": "cli and conductor",
}
ROLES = ("prefill engines", "decode engines", "host agents", "store", "cli and conductor", "verification",
         "tools", "kernel", "unattributed")

# Activities, in the order a report lists them.
ACTIVITIES = ("model compute", "kv transfer", "control rpcs", "scheduling", "timing", "verification",
              "monitoring", "start-up", "event loop", "other python")

# A stack's activity is decided by its innermost frame in the project's own code, by file; the
# first pattern that matches wins. Library frames below it (torch under a KV copy, zmq under a
# control call) are the project frame's work, not their library's.
_PROJECT_RULES: tuple[tuple[str, str], ...] = (
    ("testbed/cluster/verify.py", "verification"),
    ("testbed/measure/monitor.py", "monitoring"),
    ("testbed/fabric/counters.py", "monitoring"),
    ("emulators/gpu/", "timing"),
    ("dualpath/engines/clock.py", "timing"),
    ("testbed/cluster/runclock.py", "timing"),
    ("dualpath/model/", "model compute"),
    ("dualpath/transport/", "kv transfer"),
    ("dualpath/kv/", "kv transfer"),
    ("dualpath/store/", "kv transfer"),
    ("emulators/kvstore", "kv transfer"),
    ("emulators/mooncake_store", "kv transfer"),
    ("dualpath/control.py", "control rpcs"),
    ("dualpath/scheduler/", "scheduling"),
    ("testbed/cluster/scheduling.py", "scheduling"),
)
# A stack with no project frame at all: by the library its innermost frame is in.
_LIBRARY_RULES: tuple[tuple[str, str], ...] = (
    ("torch/", "model compute"),
    ("transformers/", "model compute"),
    ("nixl", "kv transfer"),
    ("zmq/", "control rpcs"),
    ("msgpack", "control rpcs"),
    ("asyncio/", "event loop"),
    ("selectors.py", "event loop"),
)
# A stack that passes through one of these anywhere is that activity, whatever its leaf.
_CONTEXT_RULES: tuple[tuple[str, str], ...] = (
    ("<frozen importlib", "start-up"),
    ("testbed/cluster/verify.py", "verification"),
)
_PROJECT_DIRS = ("dualpath/", "emulators/", "testbed/")

# py-spy puts the process chain first, each as `process PID:"cmdline"`; a command line may
# itself hold ';' (python -c "a; b"), so these are matched before the stack is split
_PROCESS_FRAME = re.compile(r'process (\d+):"(.*?)"(?:;|$)')
_FRAME_FILE = re.compile(r"\(([^()]*?)(?::\d+)?\)$")


def role_of(argv: list[str]) -> str:
    """The testbed role of a process, from its command line (argv as /proc/PID/cmdline gives it)."""
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        module = argv[argv.index("-m") + 1]
        if module == "dualpath.nodes.engine":
            role = argv[argv.index("--role") + 1] if "--role" in argv[:-1] else "prefill"
            return "decode engines" if role == "decode" else "prefill engines"
        if module in _MODULE_ROLES:
            return _MODULE_ROLES[module]
    text = " ".join(argv)
    if "multiprocessing" in text:  # the verification pool's spawned workers
        return "verification"
    return "tools"  # ip, tc, ss, iperf3, mininet's shells: what the fabric runs for a moment


_FRAME_LINE = re.compile(r"\(([^()]*?):(\d+)\)$")
# A thread whose innermost Python frame is at one of these calls is waiting in it. py-spy's own
# idle filter does not see it for the testbed's processes (a thread that sleeps 20 ms at a time in
# a namespace's process was sampled as running 4 % of the run), so the source line decides.
WAITING = "waiting"
_BLOCKING_CALLS = re.compile(r"(?<![A-Za-z0-9])(?:sleep|wait|wait_for|poll|select|acquire|recv|recv_into|recv_multipart|"
                             r"accept|run_until_complete|_run_once)\(")


def frame_line(frame: str) -> tuple[str, int] | None:
    """(file, line) of a py-spy frame `name (file:line)`, None without a line."""
    m = _FRAME_LINE.search(frame)
    return (m.group(1), int(m.group(2))) if m else None


def is_waiting(frames: list[str], source: Callable[[str, int], str]) -> bool:
    """Is the innermost frame's source line a blocking call (`source(file, line)` gives it)?"""
    where = frame_line(frames[-1]) if frames else None
    return bool(where) and bool(_BLOCKING_CALLS.search(source(*where)))


def frame_file(frame: str) -> str:
    """The file part of a py-spy frame, `name (file:line)` -> file ('' for none)."""
    m = _FRAME_FILE.search(frame)
    return m.group(1) if m else ""


def activity_of(frames: list[str]) -> str:
    """One sampled stack's activity; `frames` outermost first, process and thread frames removed."""
    for frame in frames:
        for pattern, activity in _CONTEXT_RULES:
            if pattern in frame:
                return activity
    files = [frame_file(f) for f in frames]
    for path in reversed(files):
        if any(d in path for d in _PROJECT_DIRS):
            for pattern, activity in _PROJECT_RULES:
                if pattern in path:
                    return activity
            return "other python"
    for path in reversed(files):
        for pattern, activity in _LIBRARY_RULES:
            if pattern in path:
                return activity
    return "other python"


@dataclass
class Stacks:
    """py-spy's raw (collapsed) samples, counted per process and activity."""
    by_pid: dict[int, dict[str, int]] = field(default_factory=dict)
    argv: dict[int, str] = field(default_factory=dict)  # pid -> the command line py-spy printed
    leaves: dict[str, int] = field(default_factory=dict)  # innermost frame -> samples
    samples: int = 0


def parse_raw(lines: Iterable[str], source: Callable[[str, int], str] | None = None) -> Stacks:
    """Read py-spy's `--format raw` output: one stack per line, frames joined by ';' (with
    `--subprocesses`, the process chain first as `process PID:"cmdline"` frames), then a count.
    With `source` (file, line -> that line's text), a stack waiting in a blocking call counts as
    WAITING, which no process's CPU is split into."""
    out = Stacks()
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        pid = 0
        while m := _PROCESS_FRAME.match(stack):
            pid = int(m.group(1))
            out.argv[pid] = m.group(2)
            stack = stack[m.end():]
        frames = [f for f in stack.split(";") if f and not f.startswith("thread (")]
        act = WAITING if source is not None and is_waiting(frames, source) else activity_of(frames)
        per = out.by_pid.setdefault(pid, {})
        per[act] = per.get(act, 0) + n
        if frames and act != WAITING:
            out.leaves[frames[-1]] = out.leaves.get(frames[-1], 0) + n
        out.samples += n
    return out


@dataclass(frozen=True)
class ProcessCpu:
    """One process's CPU over the run, from its own counters (the last reading before it ended)."""
    pid: int
    role: str
    user_s: float
    system_s: float

    @property
    def cpu_s(self) -> float:
        return self.user_s + self.system_s


def split_by_activity(procs: list[ProcessCpu], stacks: Stacks) -> dict[str, dict[str, float]]:
    """role -> activity -> CPU seconds: each process's measured CPU in the shares its samples
    fell in. A process with no samples (too short, or not Python) counts as 'unsampled'."""
    out: dict[str, dict[str, float]] = {}
    for p in procs:
        per = {a: n for a, n in stacks.by_pid.get(p.pid, {}).items() if a != WAITING}
        total = sum(per.values())
        row = out.setdefault(p.role, {})
        if not total:
            row["unsampled"] = row.get("unsampled", 0.0) + p.cpu_s
            continue
        for act, n in per.items():
            row[act] = row.get(act, 0.0) + p.cpu_s * n / total
    return out


def by_role(procs: list[ProcessCpu]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        out[p.role] = out.get(p.role, 0.0) + p.cpu_s
    return out


def summarize(procs: list[ProcessCpu], stacks: Stacks, *, machine_busy_s: float, kernel_s: float,
              profiler_s: float, emulated_s: float, wall_s: float, cores: int,
              floor: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile's numbers. `machine_busy_s`: all cores' busy time over the command (from
    /proc/stat, steal excluded); `kernel_s`: its softirq and irq part, which no process is
    charged with (the emulated NICs' veths, HTB and TCP); `profiler_s`: the profiler's own CPU
    (py-spy and this process's sampler), taken off the machine's total; `emulated_s`: the
    emulated time the run covered (its modes' JCTs)."""
    roles = by_role(procs)
    roles["kernel"] = kernel_s
    accounted = sum(roles.values())
    # exited short-lived processes, the last poll interval of each process, and anything else
    # that ran on the machine: never negative (the counters are read at slightly different times)
    roles["unattributed"] = max(0.0, machine_busy_s - profiler_s - accounted)
    total = sum(roles.values())
    activities = split_by_activity(procs, stacks)
    activities["kernel"] = {"kernel (softirq, irq)": kernel_s}
    per_s = total / emulated_s if emulated_s > 0 else None
    out: dict[str, Any] = {
        "cpu_s": round(total, 2), "emulated_s": round(emulated_s, 4), "wall_s": round(wall_s, 2),
        "cpu_s_per_emulated_s": round(per_s, 3) if per_s is not None else None,
        "cores": cores, "cpu_share_of_machine": round(total / (wall_s * cores), 3) if wall_s > 0 else None,
        "by_role": {r: round(v, 2) for r, v in sorted(roles.items(), key=lambda kv: -kv[1])},
        "by_role_per_emulated_s": ({r: round(v / emulated_s, 3) for r, v in roles.items()} if emulated_s > 0 else {}),
        "by_activity": _activity_totals(activities),
        "by_role_and_activity": {r: {a: round(v, 2) for a, v in sorted(row.items(), key=lambda kv: -kv[1])}
                                 for r, row in activities.items()},
        "system_s_by_role": _system_by_role(procs),
        "profiler_overhead_s": round(profiler_s, 2), "samples": stacks.samples,
        "samples_waiting": sum(per.get(WAITING, 0) for per in stacks.by_pid.values()),
        "hottest_frames": [{"frame": f, "samples": n} for f, n in
                           sorted(stacks.leaves.items(), key=lambda kv: -kv[1])[:15]],
    }
    if floor is not None:
        out["floor"] = floor
        f = floor.get("cpu_s")
        if f and per_s is not None:
            out["floor"]["cpu_s_per_emulated_s"] = round(f / emulated_s, 4)
            out["over_floor"] = round(total / f, 1)
    return out


def _activity_totals(activities: dict[str, dict[str, float]]) -> dict[str, float]:
    tot: dict[str, float] = {}
    for row in activities.values():
        for a, v in row.items():
            tot[a] = tot.get(a, 0.0) + v
    return {a: round(v, 2) for a, v in sorted(tot.items(), key=lambda kv: -kv[1])}


def _system_by_role(procs: list[ProcessCpu]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        out[p.role] = out.get(p.role, 0.0) + p.system_s
    return {r: round(v, 2) for r, v in out.items()}


def floor_summary(model_s: float, model_tokens: dict[str, int], kv_bytes: int, cpu_s_per_gb: float | None,
                  iperf: dict[str, Any] | None) -> dict[str, Any]:
    """The physical floor: the run's tokens through the bare model, and its KV bytes at the
    kernel's cost per byte on the same links (iperf3's, CPU seconds per GB)."""
    kernel_s = kv_bytes / 1e9 * cpu_s_per_gb if cpu_s_per_gb is not None else None
    return {"model_cpu_s": round(model_s, 3), "tokens": model_tokens, "kv_bytes": kv_bytes,
            "kernel_cpu_s_per_gb": round(cpu_s_per_gb, 3) if cpu_s_per_gb is not None else None,
            "kernel_cpu_s": round(kernel_s, 3) if kernel_s is not None else None,
            "cpu_s": round(model_s + (kernel_s or 0.0), 3), "iperf3": iperf}


_MODE_START = re.compile(r"^  mode (\S+)")
_MODE_END = re.compile(r"^    (\S+): (?:UN)?FAITHFUL, JCT")


def mode_mark(line: str) -> tuple[str, str] | None:
    """(mode, "start" or "end") where a `dualpath run` output line starts or ends a mode."""
    m = _MODE_START.match(line)
    if m:
        return m.group(1), "start"
    m = _MODE_END.match(line)
    return (m.group(1), "end") if m else None


def in_modes(marks: list[tuple[str, str, dict[str, float]]], jct_s: dict[str, float]) -> dict[str, Any]:
    """CPU while the modes ran (from each mode's start line to its verdict line: warm-up, requests,
    drain), by role, against their emulated JCTs: the CPU that bounds the dilation, without the
    command's set-up, verification and teardown."""
    starts = {m: snap for m, kind, snap in marks if kind == "start"}
    roles: dict[str, float] = {}
    emulated = 0.0
    for mode, kind, end in marks:
        if kind != "end" or mode not in starts:
            continue
        emulated += jct_s.get(mode, 0.0)
        for r, v in end.items():
            roles[r] = roles.get(r, 0.0) + v - starts[mode].get(r, 0.0)
    total = sum(roles.values())
    return {"cpu_s": round(total, 2), "emulated_s": round(emulated, 4),
            "cpu_s_per_emulated_s": round(total / emulated, 3) if emulated > 0 else None,
            "by_role": {r: round(v, 2) for r, v in sorted(roles.items(), key=lambda kv: -kv[1])}}


def report_lines(s: dict[str, Any]) -> list[str]:
    """The profile as a person reads it: per role and activity, per emulated second."""
    e = s["emulated_s"] or 1.0
    lines = [f"{s['cpu_s']:.1f} CPU s over {s['emulated_s']:.2f} emulated s: "
             f"{s['cpu_s_per_emulated_s']} CPU s per emulated s (wall {s['wall_s']:.0f} s, "
             f"{s['cpu_share_of_machine']:.0%} of {s['cores']} cores)"]
    im = s.get("in_modes") or {}
    if im.get("cpu_s_per_emulated_s") is not None:  # what bounds the dilation
        lines.append(f"while the modes ran: {im['cpu_s']:.1f} CPU s, {im['cpu_s_per_emulated_s']} per emulated s ("
                     + ", ".join(f"{r} {v:.1f}" for r, v in list(im["by_role"].items())[:5]) + ")")
    lines += ["",
             f"{'role':<20} {'CPU s':>8} {'per emu s':>10}  biggest activities"]
    for role, v in s["by_role"].items():
        acts = s["by_role_and_activity"].get(role, {})
        top = ", ".join(f"{a} {x:.1f}" for a, x in list(acts.items())[:3])
        lines.append(f"{role:<20} {v:>8.1f} {v / e:>10.3f}  {top}")
    lines += ["", f"{'activity':<22} {'CPU s':>8} {'per emu s':>10}"]
    lines += [f"{a:<22} {v:>8.1f} {v / e:>10.3f}" for a, v in s["by_activity"].items()]
    f = s.get("floor")
    if f:
        lines += ["", f"floor: the bare model over the run's tokens {f['model_cpu_s']:.2f} CPU s"
                  + (f", the kernel at iperf3's {f['kernel_cpu_s_per_gb']:.2f} CPU s/GB over its "
                     f"{f['kv_bytes'] / 1e9:.3f} GB {f['kernel_cpu_s']:.2f} CPU s" if f.get("kernel_cpu_s") is not None else "")
                  + (f": {f['cpu_s_per_emulated_s']} CPU s per emulated s; the run costs {s['over_floor']}x its floor"
                     if "over_floor" in s else "")]
    lines.append(f"profiler's own CPU (not counted above): {s['profiler_overhead_s']:.1f} s, {s['samples']} samples")
    return lines
