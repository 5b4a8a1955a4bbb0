"""`dualpath profile run`: a workload run under a sampling profiler, with its physical floor beside it.

The run is `dualpath run` itself, started as a child from a checkout (this one by default, or
another, so that two versions of the code are profiled the same way, one after the other). Three
things watch it:
- a sampler here reads every descendant process's own CPU counters from /proc while it lives,
  and the machine's softirq and irq time (the emulated NICs' veths, HTB and TCP): the totals;
- py-spy (`--subprocesses --nonblocking`, a sampling profiler that reads the processes' stacks
  from outside) splits each process's total into activities;
- the run's own summary gives the emulated time it covered.
Afterwards the floor: the run's tokens through the bare model in a tight loop, and iperf3's CPU
per GB on the same topology's KV links, times the KV bytes the run moved.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from testbed.measure.monitor import cpu_fields
from testbed.measure.cpu_profile import (ProcessCpu, by_role, floor_summary, in_modes, mode_mark, parse_raw, role_of,
                                         summarize)

_TICK = os.sysconf("SC_CLK_TCK")


class ProfileError(RuntimeError):
    """The profile could not be taken (no py-spy, the run failed to start, ...): said in one line."""


def _stat_fields(pid: int) -> tuple[int, int, int] | None:
    """(ppid, utime, stime) of a process, None once it has gone."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(f[1]), int(f[11]), int(f[12])


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def machine_cpu() -> dict[str, int]:
    """All cores' jiffies from /proc/stat's first line, by kind."""
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return dict(zip(names, cpu_fields()))


def busy_s(a: dict[str, int], b: dict[str, int]) -> float:
    """Busy CPU seconds between two machine readings, the hypervisor's steal left out."""
    kinds = ("user", "nice", "system", "irq", "softirq")
    return sum(b[k] - a[k] for k in kinds) / _TICK


class TreeSampler:
    """Every descendant of `root`'s CPU counters, read every `interval_s` until stopped: a process
    that ends keeps its last reading (so up to one interval of its CPU is missed)."""

    def __init__(self, root: int, interval_s: float = 0.25):
        self.root, self.interval_s = root, interval_s
        self.seen: dict[int, tuple[list[str], int, int]] = {}  # pid -> (argv, utime, stime) jiffies
        self._lock = threading.Lock()  # the sampler thread and snapshot()'s caller both read and write it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dpt-profile-sampler", daemon=True)

    def start(self) -> "TreeSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                self.sample()
                return

    def sample(self) -> None:
        parent: dict[int, int] = {}
        times: dict[int, tuple[int, int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                f = _stat_fields(int(d))
                if f is not None:
                    parent[int(d)], times[int(d)] = f[0], (f[1], f[2])
        with self._lock:
            for pid, t in times.items():
                if self._descends(pid, parent):
                    argv = self.seen[pid][0] if pid in self.seen else _argv(pid)
                    self.seen[pid] = (argv, *t)

    def snapshot(self) -> dict[str, float]:
        """CPU seconds so far by role, and the kernel's softirq and irq: one end of a window."""
        self.sample()
        out = by_role(self.processes())
        cpu = machine_cpu()
        out["kernel"] = (cpu["irq"] + cpu["softirq"]) / _TICK
        return out

    def _descends(self, pid: int, parent: dict[int, int]) -> bool:
        for _ in range(64):
            if pid == self.root:
                return True
            if pid in self.seen and pid != self.root:
                return True  # was ours once: a process re-parented to init when its parent ended
            pid = parent.get(pid, 0)
            if pid <= 1:
                return False
        return False

    def processes(self) -> list[ProcessCpu]:
        with self._lock:
            seen = list(self.seen.items())
        return [ProcessCpu(pid, role_of(argv), u / _TICK, s / _TICK) for pid, (argv, u, s) in seen]


def py_spy() -> str:
    """The py-spy binary: the venv's (requirements.lock pins it), else one on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    found = str(here) if here.exists() else shutil.which("py-spy")
    if not found:
        raise ProfileError("py-spy is not installed: run `make setup` (requirements.lock pins it)")
    return found


def _spy(pid: int, rate: int, out: Path, log: Path) -> subprocess.Popen:
    argv = [py_spy(), "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--rate", str(rate),
            "--format", "raw", "--output", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=open(log, "wb"))


def _newest_run(folder: Path) -> Path | None:
    runs = sorted((p for p in folder.glob("*/summary.json")), key=lambda p: p.stat().st_mtime)
    return runs[-1].parent if runs else None


def run_under_profiler(run_args: list[str], checkout: Path, out: Path, rate: int,
                       progress: Callable[[str], None]) -> dict[str, Any]:
    """`dualpath run RUN_ARGS --out OUT/run` from `checkout`, watched; returns the measurements."""
    run_out = out / "run"
    run_out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "testbed.cli", "run", *run_args, "--out", str(run_out.resolve())]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cpu0, t0, own0 = machine_cpu(), time.monotonic(), time.process_time()
    child = subprocess.Popen(argv, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    sampler = TreeSampler(child.pid).start()
    windows: list[tuple[str, str, dict[str, float]]] = []  # (mode, "start" or "end", snapshot)
    verifying: float | None = None
    time.sleep(0.5)  # py-spy needs the interpreter up before it can read its stacks
    spy = _spy(child.pid, rate, out / "stacks.txt", out / "py-spy.log")
    try:
        with open(out / "run.log", "w") as log:
            for line in child.stdout:  # type: ignore[union-attr]
                log.write(line)
                progress("  | " + line.rstrip("\n"))
                mark = mode_mark(line)
                if mark is not None:  # the run says when a mode starts and ends: its window's CPU
                    windows.append((*mark, sampler.snapshot()))
                elif line.startswith("  verifying ") and verifying is None:
                    verifying = time.monotonic()  # from here to the run's end: its verification
        t_out = time.monotonic()
        rc = child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)  # the run cleans up after itself on SIGINT
        child.wait(timeout=120)
        raise
    finally:
        sampler.stop()
        spy_cpu = _wait_cpu(spy, 60)  # it writes its file once the process it watched has ended
    wall, cpu1 = time.monotonic() - t0, machine_cpu()
    own = time.process_time() - own0
    return {"rc": rc, "wall_s": wall, "busy_s": busy_s(cpu0, cpu1),
            "kernel_s": sum(cpu1[k] - cpu0[k] for k in ("irq", "softirq")) / _TICK,
            "profiler_s": own + spy_cpu, "py_spy_s": spy_cpu, "sampler_s": own, "processes": sampler.processes(),
            "run_dir": _newest_run(run_out), "stacks": out / "stacks.txt", "windows": windows,
            "verification_wall_s": round(t_out - verifying, 2) if verifying is not None else None}


def _wait_cpu(proc: subprocess.Popen, timeout_s: float) -> float:
    """Wait for a child (SIGINT after `timeout_s`) and return its own CPU seconds, from its
    rusage (not os.times(), which adds up every child waited for, the run's too)."""
    deadline, signals = time.monotonic() + timeout_s, [signal.SIGINT, signal.SIGKILL]
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return ru.ru_utime + ru.ru_stime
        if time.monotonic() > deadline and signals:
            proc.send_signal(signals.pop(0))
            deadline = time.monotonic() + 30
        time.sleep(0.1)


def source_lines(checkout: Path) -> Callable[[str, int], str]:
    """(file, line) -> that source line, for py-spy's short file names: the checkout's own files,
    else the interpreter's path (the venv's libraries); '' where none is found."""
    import linecache

    roots = [checkout, *(Path(p) for p in sys.path if p)]
    found: dict[str, str | None] = {}

    def line(file: str, n: int) -> str:
        if file not in found:
            found[file] = next((str(r / file) for r in roots if (r / file).is_file()), None)
        return linecache.getline(found[file], n) if found[file] else ""

    return line


def emulated_s(summary: dict[str, Any]) -> float:
    """The emulated time a run covered: its modes' JCTs, one after the other."""
    return sum(m.get("jct_s") or 0.0 for m in summary.get("modes", {}).values())


def kv_bytes_by_kind(summary: dict[str, Any]) -> dict[str, int]:
    """Bytes the run's NICs sent, by NIC kind (snic, cnic, host_port, storage_nic), every mode."""
    out: dict[str, int] = {}
    for m in summary.get("modes", {}).values():
        for row in m.get("kv_bytes_vs_expected", {}).get("per_direction", []):
            if row["dir"] == "tx":
                kind = row["nic"].rsplit("/", 1)[-1]
                out[kind] = out.get(kind, 0) + int(row["measured"])
    return out


def model_floor(run_dir: Path, checkpoint: str, device: str = "cpu") -> tuple[float, dict[str, int]]:
    """The run's tokens through the bare model, single-threaded like the engines, the cheapest
    way this code has: per mode, the trajectories in lockstep (testbed.cluster.verify.Reference,
    the verification's own recomputation), each turn's new tokens prefilled on its trajectory's
    context and every turn's output decoded in batched steps. Token ids are stand-ins (the records
    keep lengths, not prompts); the model's cost does not depend on which ids they are.
    Returns (CPU s, tokens)."""
    import torch

    from testbed.cluster.verify import Reference
    from testbed.cluster.runclock import run_geometry

    torch.set_num_threads(1)
    recs = [json.loads(x) for x in (run_dir / "records.jsonl").read_text().splitlines() if x.strip()]
    recs = [r for r in recs if r["trajectory"] >= 0 and not r.get("error")]
    geom = run_geometry(Path(checkpoint))
    prefilled = decoded = 0
    cpu = 0.0
    for mode in sorted({r["mode"] for r in recs}):
        ref = Reference(checkpoint, geom, device)  # a fresh one: every mode computed its requests
        turns: dict[int, list[dict]] = {}
        for r in sorted((r for r in recs if r["mode"] == mode), key=lambda r: (r["trajectory"], r["turn"])):
            turns.setdefault(r["trajectory"], []).append(r)
        context: dict[int, list[int]] = {t: [] for t in turns}
        t0 = time.process_time()
        for i in range(max(map(len, turns.values()), default=0)):
            now = {t: rs[i] for t, rs in turns.items() if i < len(rs)}
            items = []
            for t, r in now.items():
                ctx = context[t] if r["n_prompt"] >= len(context[t]) else []
                new = r["n_prompt"] - len(ctx)
                items.append((ctx + [(7 * k + i) % ref.model.config.vocab_size for k in range(new)], r["gen_len"]))
                prefilled, decoded = prefilled + new, decoded + r["gen_len"]
            ref.run_many(items)
            for (t, _), (prompt, gen) in zip(now.items(), items):
                context[t] = prompt + ref.run(prompt, gen)[0][:-1]  # computed just above
        cpu += time.process_time() - t0
    return cpu, {"prefilled": prefilled, "decoded": decoded, "requests": len(recs)}


def kernel_cost(topology: Path, seconds: float, progress: Callable[[str], None]) -> dict[str, Any]:
    """iperf3's machine-wide CPU per GB through the topology's KV links (a CNIC in the kv class,
    and a node's SNIC reading from storage), each flow's CPU less the same span idle just before."""
    from dualpath.traffic_classes import KV
    from testbed.fabric.access import claimed_fabric
    from testbed.fabric.iperf import flow
    from testbed.topology import load_topology

    out: dict[str, Any] = {}
    with claimed_fabric(load_topology(topology), owner_kind="profile") as fab:
        p_node = next(e for e in fab.endpoints if e.role == "prefill" and e.kind == "host")
        d_node = next(e for e in fab.endpoints if e.role == "decode" and e.kind == "host")
        p_eng = next(e for e in fab.endpoints if e.role == "prefill" and e.kind == "engine")
        store = next(e for e in fab.endpoints if e.kind == "storage")
        cases = {"cnic": (p_eng.name, d_node.name, d_node.nic("host_port").ip),
                 "snic": (store.name, p_node.name, p_node.nic("snic").ip)}
        for i, (kind, (src, dst, ip)) in enumerate(cases.items()):
            a = machine_cpu()
            time.sleep(seconds)
            idle = busy_s(a, machine_cpu())
            a = machine_cpu()
            res = flow(src, dst, ip, 5301 + i, seconds, tos=KV.tos_byte)
            cpu = busy_s(a, machine_cpu()) - idle
            out[kind] = {"bytes": res.bytes, "goodput_bps": round(res.goodput_bps), "cpu_s": round(cpu, 3),
                         "cpu_s_per_gb": round(cpu / (res.bytes / 1e9), 3) if res.bytes else None}
            progress(f"  iperf3 over a {kind}: {res.goodput_bps / 1e6:.1f} Mbit/s, {cpu:.2f} CPU s for "
                     f"{res.bytes / 1e6:.1f} MB")
    return out


def kernel_floor(kinds: dict[str, int], cost: dict[str, Any]) -> tuple[int, float | None]:
    """(KV bytes, CPU s per GB averaged over them): the SNIC's cost for SNIC and storage-NIC
    bytes, the CNIC's for the rest (host ports and CNICs share the compute bridge)."""
    total = sum(kinds.values())
    per = {k: (cost.get("snic" if k in ("snic", "storage_nic") else "cnic") or {}).get("cpu_s_per_gb")
           for k in kinds}
    if not total or any(v is None for v in per.values()):
        return total, None
    return total, sum(kinds[k] * per[k] for k in kinds) / total


def profile(topology: Path, run_args: list[str], out: Path, *, checkout: Path, rate: int = 10,
            floor: bool = True, iperf_s: float = 3.0, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The whole profile: the run watched, then its floor; returns summary.json's contents."""
    out.mkdir(parents=True, exist_ok=True)
    m = run_under_profiler([str(topology), *run_args], checkout, out, rate, progress)
    if m["rc"] != 0 or m["run_dir"] is None:
        raise ProfileError(f"the run failed (exit {m['rc']}): see {out / 'run.log'}")
    summary = json.loads((m["run_dir"] / "summary.json").read_text())
    stacks = parse_raw(m["stacks"].read_text().splitlines() if m["stacks"].exists() else [], source_lines(checkout))
    if not stacks.samples:
        progress(f"  py-spy took no samples ({(out / 'py-spy.log').read_text()[-300:].strip()}): "
                 "the totals stand, the activities do not")
    fl = None
    if floor:
        progress("floor: the run's tokens through the bare model ...")
        ckpt = Path(summary["checkpoint"])  # shown relative to the checkout that ran it
        model_s, tokens = model_floor(m["run_dir"], str(ckpt if ckpt.is_absolute() else checkout / ckpt))
        progress(f"  {model_s:.2f} CPU s for {tokens['prefilled']} prefilled and {tokens['decoded']} decoded tokens")
        progress("floor: iperf3 on the topology's KV links ...")
        cost = kernel_cost(topology, iperf_s, progress)
        kv, per_gb = kernel_floor(kv_bytes_by_kind(summary), cost)
        fl = floor_summary(model_s, tokens, kv, per_gb, cost)
    cores = len(os.sched_getaffinity(0))
    res = summarize(m["processes"], stacks, machine_busy_s=m["busy_s"], kernel_s=m["kernel_s"],
                    profiler_s=m["profiler_s"], emulated_s=emulated_s(summary), wall_s=m["wall_s"],
                    cores=cores, floor=fl)
    res["in_modes"] = in_modes(m["windows"], {k: v.get("jct_s") or 0.0 for k, v in summary.get("modes", {}).items()})
    res.update({"run": str(m["run_dir"]), "checkout": str(checkout), "faithful": summary.get("faithful"),
                "dilation": summary.get("dilation"), "modes": sorted(summary.get("modes", {})),
                "verification_wall_s": m["verification_wall_s"], "rate_hz": rate, "profiler": {"py_spy_cpu_s": round(m["py_spy_s"], 2),
                                              "sampler_cpu_s": round(m["sampler_s"], 2)}})
    return res
