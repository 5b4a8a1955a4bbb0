"""Live fault injection (`dualpath run --fault KIND[:TARGET]@T`) and what each fault did.

A fault is injected T *emulated* seconds after the mode's first request (after its warm-up),
that is T x dilation testbed seconds on the run's clock (README "Time"). Kinds and what they do:

  snic-down[:NODE]      the node's storage NIC loses its link (its switch port goes down)
  snic-up[:NODE]        ... and gets it back
  store-crash[:SERVER]  SIGKILL of a storage server; it restarts on the same disk and address
                        RESTART_DELAY_S emulated seconds later
  host-kill[:NODE]      SIGKILL of the node's host agent (its DRAM buffer and store client)
  pe-kill[:ENGINE]      SIGKILL of a prefill engine
  de-kill[:ENGINE]      SIGKILL of a decode engine
  corrupt-block[:SERVER] one bit of one acknowledged block flipped on the server's disk: a
                        block of the shared system prompt (every later turn reads it) when the
                        server holds one, chosen by the run's seed, else any acknowledged block
  disk-full[:SERVER]    the server's filesystem fills up (the store's root is then a tmpfs of
                        DISK_FULL_TMPFS_BYTES, filled by one file); the file is removed, freeing
                        the disk, DISK_FULL_S emulated seconds later

TARGET defaults: the first prefill node (snic-*, host-kill), its first engine (pe-kill), the
first decode node's first engine (de-kill), the first storage server (store and disk faults).
Names may omit the testbed's "dpt-" prefix.

Attribution: the conductor tells the FaultLog what happened to each request (a process it used
died and it was retried, a load failed and it recomputed, its read path avoided a node, a
write-back was refused, a store call was retried), and the log charges each event to the fault
that explains it. Per fault the summary then gives `affected` (requests charged), `completed`
and `failed` (of those), `wrong_tokens` (generated tokens, over every request that finished
after the fault, that differ from recomputation), `lost_blocks` (blocks acknowledged before the
fault that do not read back whole with a correct CRC from the store's disk after the mode) and
`recovery_s` (emulated seconds from the fault to the end of the last request it affected;
for snic-up, to the first read the node's SNIC served again).
"""
from __future__ import annotations

import asyncio
import math
import os
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dualpath.naming import PREFIX
from dualpath.store.checksum import checksum
from dualpath.store.striping import group_by_server
from emulators.kvstore.blockfile import HEADER_SIZE, decode_header

if TYPE_CHECKING:
    from testbed.cluster.processes import Cluster
    from dualpath.lifecycle.record import RequestRecord
    from testbed.cluster.conductor import Conductor
    from testbed.fabric.network import Fabric
    from testbed.topology import Topology

KINDS = ("snic-down", "snic-up", "store-crash", "host-kill", "pe-kill", "de-kill", "corrupt-block", "disk-full")
NODE_KINDS = ("snic-down", "snic-up", "host-kill")
ENGINE_KINDS = ("pe-kill", "de-kill")
SERVER_KINDS = ("store-crash", "corrupt-block", "disk-full")
RESTART_DELAY_S = 2.0  # emulated seconds a crashed storage server stays down
DISK_FULL_S = 3.0  # emulated seconds the disk stays full
DISK_FULL_TMPFS_BYTES = 256 << 20  # a store root's tmpfs in a run with disk-full (its blocks fit many times)
MAX_FAULTS = 32
MAX_AT_S = 3600.0
FILLER = "FILLER"  # the file that fills a disk, beside the store's blocks/ (never read as a block)
_SPEC = re.compile(r"(?P<kind>[a-z-]+)(?::(?P<target>[A-Za-z0-9-]{1,64}))?@(?P<at>[^@:]{1,32})")


class FaultError(ValueError):
    """A --fault that cannot be injected on this topology; one line naming it and the fix."""


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    target: str  # resolved: a full endpoint name (dpt-p0, dpt-p0e0, dpt-s0)
    at_s: float  # emulated seconds after the mode's first request
    text: str  # as given

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.target}@{self.at_s:g}"


def parse_fault(text: str, topo_names: dict[str, list[str]]) -> FaultSpec:
    """One --fault value against the topology's names: {"prefill_nodes", "decode_nodes",
    "prefill_engines", "decode_engines", "servers"} -> endpoint names in order."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    m = _SPEC.fullmatch(text.strip())
    if not m:
        raise FaultError(f"--fault {shown!r}: expected KIND[:TARGET]@T, e.g. pe-kill@1.5 or snic-down:p0@2; "
                         f"kinds: {', '.join(KINDS)}")
    kind = m["kind"]
    if kind not in KINDS:
        raise FaultError(f"--fault {shown!r}: unknown kind {kind!r}; fix: use one of {', '.join(KINDS)}")
    try:
        at = float(m["at"])
    except ValueError:
        at = math.nan
    if not (math.isfinite(at) and 0 <= at <= MAX_AT_S):
        raise FaultError(f"--fault {shown!r}: T must be emulated seconds in [0, {MAX_AT_S:g}] after the mode's "
                         f"first request, got {m['at']!r}")
    if kind in NODE_KINDS:
        allowed, default = topo_names["prefill_nodes"] + topo_names["decode_nodes"], topo_names["prefill_nodes"][0]
        what = "a node"
    elif kind == "pe-kill":
        allowed, default, what = topo_names["prefill_engines"], topo_names["prefill_engines"][0], "a prefill engine"
    elif kind == "de-kill":
        allowed, default, what = topo_names["decode_engines"], topo_names["decode_engines"][0], "a decode engine"
    else:
        allowed, default, what = topo_names["servers"], topo_names["servers"][0], "a storage server"
    target = m["target"] or default
    full = target if target.startswith(f"{PREFIX}-") else f"{PREFIX}-{target}"
    if full not in allowed:
        raise FaultError(f"--fault {shown!r}: {target!r} is not {what} of this topology; fix: name one of "
                         f"{', '.join(allowed)}")
    return FaultSpec(kind, full, at, text)


def parse_faults(texts: list[str], topo_names: dict[str, list[str]]) -> list[FaultSpec]:
    if len(texts) > MAX_FAULTS:
        raise FaultError(f"--fault: {len(texts)} faults, at most {MAX_FAULTS} per run")
    return sorted((parse_fault(t, topo_names) for t in texts), key=lambda f: f.at_s)


def check_on_first_server(specs: list[FaultSpec], topo: "Topology") -> None:
    """A fault acts on this machine: it kills a process by its pid here, sets a bridge port down
    here, flips a bit or fills a disk in a folder here. One whose target runs on another server
    (testbed/placement.py) is refused, in one line, before anything starts."""
    from testbed.placement import server_of_namespace, servers

    first = servers(topo)[0].name
    for f in specs:
        where = server_of_namespace(topo, f.target)
        if where != first:
            raise FaultError(f"--fault {f.text!r}: {f.target} runs on server {where}; faults act on the first "
                             f"server's ({first}) processes, links and disks only: target one placed there")


def topology_names(endpoints) -> dict[str, list[str]]:
    """The names --fault may target, from a fabric plan (testbed.fabric.network.plan)."""
    out: dict[str, list[str]] = {"prefill_nodes": [], "decode_nodes": [], "prefill_engines": [],
                                 "decode_engines": [], "servers": []}
    for ep in endpoints:
        if ep.kind == "storage":
            out["servers"].append(ep.name)
        elif ep.kind == "host":
            out[f"{ep.role}_nodes"].append(ep.name)
        else:
            out[f"{ep.role}_engines"].append(ep.name)
    return out


# -- what happened ---------------------------------------------------------------------------
@dataclass
class Fault:
    spec: FaultSpec
    t_injected: float | None = None  # conductor clock (testbed s since its start)
    t_healed: float | None = None  # the restart, the link back, the disk freed
    acked_before: frozenset[str] = frozenset()  # blocks acknowledged when it struck
    affected: dict[str, list[str]] = field(default_factory=dict)  # request -> what it met
    detail: dict[str, Any] = field(default_factory=dict)
    t_first_read: float | None = None  # snic-up: the node's SNIC served a read again

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def kind(self) -> str:
        return self.spec.kind

    def active(self, now: float) -> bool:
        return self.t_injected is not None and self.t_injected <= now


class FaultLog:
    """The run's faults and the requests each affected (see the module docstring)."""

    def __init__(self, specs: list[FaultSpec] = ()) -> None:
        self.faults = [Fault(s) for s in specs]
        self.unattributed: list[tuple[str, str]] = []  # (request, what) no fault explains

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _latest(self, now: float, kinds: tuple[str, ...], target: str | None = None,
                unhealed: bool = False) -> Fault | None:
        best = None
        for f in self.faults:
            if f.kind in kinds and f.active(now) and (target is None or f.spec.target == target) \
                    and not (unhealed and f.t_healed is not None and f.t_healed < now):
                if best is None or f.t_injected >= best.t_injected:  # type: ignore[operator]
                    best = f
        return best

    def _charge(self, rec: "RequestRecord", fault: Fault | None, what: str) -> str:
        if fault is None:
            if self.faults:
                self.unattributed.append((rec.request, what))
            note = what
        else:
            fault.affected.setdefault(rec.request, []).append(what)
            note = f"{fault.label}: {what}"
        if note not in rec.faults:
            rec.faults.append(note)
        return note

    # events, from the conductor; `now` on its clock
    def process_died(self, rec: "RequestRecord", name: str, now: float, what: str) -> str:
        kinds = ("host-kill",) if self._is_node(name) else ("pe-kill", "de-kill")
        return self._charge(rec, self._latest(now, kinds, name), what)

    def load_failed(self, rec: "RequestRecord", node: str, codes: set[str], now: float, what: str,
                    host_dead: bool) -> str:
        f = None
        if host_dead:
            f = self._latest(now, ("host-kill",), node)
        if f is None and "corrupt" in codes:
            f = self._latest(now, ("corrupt-block",))
        if f is None and "connection" in codes:
            f = self._latest(now, ("snic-down",), node) or self._latest(now, ("store-crash",))
        if f is None:
            f = self._latest(now, ("corrupt-block", "store-crash", "snic-down", "host-kill"))
        return self._charge(rec, f, what)

    def avoided(self, rec: "RequestRecord", node: str, now: float) -> str:
        f = self._latest(now, ("snic-down", "host-kill"), node)
        return self._charge(rec, f, f"its reads avoided {node}, whose SNIC was down: read by the other path")

    def store_retried(self, rec: "RequestRecord", node: str, now: float, what: str) -> str:
        f = self._latest(now, ("store-crash",)) or self._latest(now, ("snic-down",), node)
        return self._charge(rec, f, what)

    def flush_failed(self, rec: "RequestRecord", node: str, codes: set[str], now: float, what: str) -> str:
        f = None
        if "full" in codes:
            f = self._latest(now, ("disk-full",))
        if f is None and "connection" in codes:
            f = self._latest(now, ("snic-down",), node) or self._latest(now, ("store-crash",))
        return self._charge(rec, f or self._latest(now, ("disk-full", "store-crash", "snic-down")), what)

    def failed(self, rec: "RequestRecord", now: float) -> str:
        """A request that ends in an error while faults are in effect: charged to the latest."""
        f = self._latest(now, tuple(k for k in KINDS if k != "snic-up"))
        return self._charge(rec, f, f"failed: {rec.error}")

    def stored(self, keys: list[str], now: float) -> None:
        """Blocks a write-back stored: a corrupted one among them is repaired from then on."""
        for f in self.faults:
            if f.kind == "corrupt-block" and f.detail.get("block") in keys and "repaired_at" not in f.detail:
                f.detail["repaired_at"] = now

    def load_ok(self, node: str, now: float) -> None:
        for f in self.faults:
            if f.kind == "snic-up" and f.spec.target == node and f.active(now) and f.t_first_read is None:
                f.t_first_read = now

    def label_of(self, rec: "RequestRecord") -> str:
        """The faults a request met, for its error message."""
        names = sorted({n.split(": ", 1)[0] for n in rec.faults if ":" in n and "@" in n.split(": ", 1)[0]})
        return ", ".join(names)

    @staticmethod
    def _is_node(name: str) -> bool:
        return re.fullmatch(rf"{PREFIX}-[pd]\d+", name) is not None

    # -- the summary ---------------------------------------------------------------------------
    def summary(self, records: list["RequestRecord"], wrong: dict[str, int], lost: dict[str, int],
                dilation: float) -> list[dict[str, Any]]:
        """summary.json's `faults` of one mode; `wrong` request -> wrong tokens (verification),
        `lost` fault label -> lost blocks."""
        by = {r.request: r for r in records}
        out = []
        for f in self.faults:
            row: dict[str, Any] = {"kind": f.kind, "target": f.spec.target, "at_s": f.spec.at_s,
                                   "injected": f.t_injected is not None}
            if f.t_injected is None:
                row.update(affected=0, completed=0, failed=0, wrong_tokens=0, lost_blocks=0, recovery_s=None,
                           detail={"note": "not injected: the mode ended before its time"})
                out.append(row)
                continue
            hit = [by[r] for r in f.affected if r in by]
            done = [r for r in hit if not r.error]
            after = [r for r in records if not r.error and r.t_done >= f.t_injected]
            if "repaired_at" in f.detail:
                f.detail["repaired_at_s"] = round((f.detail.pop("repaired_at") - f.t_injected) / dilation, 4)
            if f.kind == "snic-up":
                end = f.t_first_read
            else:
                end = max((r.t_done for r in hit), default=None)
            row.update({
                "injected_at_s": round(f.t_injected / dilation, 4),
                "affected": len(hit), "completed": len(done), "failed": len(hit) - len(done),
                "wrong_tokens": sum(wrong.get(r.request, 0) for r in after),
                "lost_blocks": lost.get(f.label, 0),
                "acked_before": len(f.acked_before),
                "recovery_s": round((end - f.t_injected) / dilation, 4) if end is not None else None,
                "errors": sorted({r.error for r in hit if r.error})[:5],
                "what": _tally(f.affected),
                "detail": f.detail,
            })
            out.append(row)
        return out


def _tally(affected: dict[str, list[str]]) -> dict[str, int]:
    """How many requests met each kind of event (the note without its request-specific part)."""
    out: dict[str, int] = {}
    for notes in affected.values():
        for n in set(re.sub(r"\b\d+\b", "N", n.split(" (")[0]) for n in notes):
            out[n] = out.get(n, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:8])


# -- the blocks' integrity -------------------------------------------------------------------
def block_intact(root: Path, key: str) -> bool:
    """Whether the block file under a store root is whole and its payload CRC matches."""
    path = root / "blocks" / key[:2] / key
    try:
        raw = path.read_bytes()
        h = decode_header(raw[:HEADER_SIZE], key)
    except Exception:  # missing, unreadable, or a header that does not decode
        return False
    return len(raw) - HEADER_SIZE == h.payload_len and checksum(raw[HEADER_SIZE:], h.algo) == h.payload_crc


def lost_blocks(roots: list[Path], keys: frozenset[str]) -> list[str]:
    """Of `keys` (blocks once acknowledged), those that do not read back intact from the disk
    of the server their stripe places them on."""
    keys = sorted(keys)
    bad = []
    for server, positions in group_by_server(keys, len(roots)).items():
        bad += [keys[p] for p in positions if not block_intact(roots[server], keys[p])]
    return sorted(bad)


def server_of(key: str, n_servers: int) -> int:
    return next(iter(group_by_server([key], n_servers)))


def flip_bit(root: Path, key: str, rng: random.Random) -> int:
    """Flip one payload bit of a stored block in place (fsynced); returns its byte offset."""
    path = root / "blocks" / key[:2] / key
    size = path.stat().st_size
    off = HEADER_SIZE + rng.randrange(size - HEADER_SIZE)
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, off)
        os.pwrite(fd, bytes([b[0] ^ (1 << rng.randrange(8))]), off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return off


def is_tmpfs_mount(root: Path) -> bool:
    target = str(Path(root).resolve())
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return False
    return any(len(p := line.split()) >= 3 and p[1] == target and p[2] == "tmpfs" for line in lines)


def fill_disk(root: Path) -> int:
    """Take every free byte of the filesystem under `root` with one file; returns its size.
    Only a tmpfs mounted at `root` itself (a store root's own disk): never a shared filesystem."""
    if not is_tmpfs_mount(root):
        raise RuntimeError(f"{root} is not a tmpfs mount point; disk-full fills only a store root's own tmpfs")
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    fd = os.open(root / FILLER, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        got = 0
        for chunk in (free, 1 << 20, 64 << 10, 4096):  # what fallocate cannot take at once
            while True:
                try:
                    os.posix_fallocate(fd, got, chunk)
                    got += chunk
                except OSError:
                    break
        os.fsync(fd)
    finally:
        os.close(fd)
    return got


def free_disk(root: Path) -> None:
    try:
        (root / FILLER).unlink()
    except FileNotFoundError:
        pass


# -- the injector ----------------------------------------------------------------------------
class Injector:
    """Injects a mode's faults on the conductor's loop, each at its time, and heals what is
    left at the end (links up, servers restarted, disks freed) so the next mode starts whole."""

    def __init__(self, log: FaultLog, cluster: "Cluster", fab: "Fabric", conductor: "Conductor",
                 dilation: float, seed: int, shared_keys: list[str], progress: Callable[[str], None] = print):
        self.log, self.c, self.fab, self.co = log, cluster, fab, conductor
        self.k, self.seed, self.shared = dilation, seed, shared_keys
        self.progress = progress
        self._later: list[asyncio.Task] = []

    async def run(self, t_first: float) -> None:
        """From the mode's first request (conductor clock `t_first`)."""
        for i, f in enumerate(self.log.faults):
            wait = t_first + f.spec.at_s * self.k - self.co._now()
            if wait > 0:
                await asyncio.sleep(wait)
            f.acked_before = frozenset(self.co.index.persisted)
            f.t_injected = self.co._now()
            try:
                await self._inject(f, random.Random(f"{self.seed}/{i}/{f.label}"))
            except Exception as e:  # an injection that failed is reported, and the run goes on
                f.detail["injection_error"] = f"{type(e).__name__}: {e}"
            self.progress(f"    fault {f.label} injected at {f.t_injected / self.k:.2f} s emulated"
                          + (f" ({f.detail['injection_error']})" if "injection_error" in f.detail else ""))

    async def _inject(self, f: Fault, rng: random.Random) -> None:
        kind, target = f.kind, f.spec.target
        loop = asyncio.get_running_loop()
        if kind in ("snic-down", "snic-up"):
            dev = self.fab.endpoint(target).nic("snic").bridge_dev
            await loop.run_in_executor(None, self._link, dev, kind == "snic-up")
            f.detail["link"] = dev
            if kind == "snic-up":
                for g in self.log.faults:
                    if g.kind == "snic-down" and g.spec.target == target and g.t_injected is not None \
                            and g.t_healed is None:
                        g.t_healed = f.t_injected
        elif kind in ("host-kill", "pe-kill", "de-kill"):
            p = self.c.procs[target]
            f.detail["pid"] = p.proc.pid
            p.proc.kill()
            await loop.run_in_executor(None, p.proc.wait, 10)
        elif kind == "store-crash":
            sp = self.c.stores[self._server(target)]
            sp.kill()
            f.detail["restart_after_s"] = RESTART_DELAY_S

            async def restart() -> None:
                await asyncio.sleep(RESTART_DELAY_S * self.k)
                await loop.run_in_executor(None, sp.start)
                f.t_healed = self.co._now()
                f.detail["restarted_at_s"] = round(f.t_healed / self.k, 4)
            self._later.append(asyncio.ensure_future(restart()))
        elif kind == "corrupt-block":
            i = self._server(target)
            root = self.c.stores[i].root
            n = len(self.c.stores)
            mine = sorted(k for k in f.acked_before if server_of(k, n) == i)
            shared = [k for k in self.shared if k in f.acked_before and server_of(k, n) == i]
            pool = shared or mine
            if not pool:
                raise RuntimeError(f"{target} holds no acknowledged block yet")
            key = rng.choice(pool)
            off = await loop.run_in_executor(None, flip_bit, root, key, rng)
            f.detail.update(block=key, shared_prefix=bool(shared), byte=off)
        elif kind == "disk-full":
            root = self.c.stores[self._server(target)].root
            if not self.c.disk_mounts.get(root):
                raise RuntimeError(f"{root} is not on its own tmpfs; disk-full fills only that")
            f.detail["filled_bytes"] = await loop.run_in_executor(None, fill_disk, root)
            f.detail["free_after_s"] = DISK_FULL_S

            async def free() -> None:
                await asyncio.sleep(DISK_FULL_S * self.k)
                free_disk(root)
                f.t_healed = self.co._now()
            self._later.append(asyncio.ensure_future(free()))

    def _server(self, name: str) -> int:
        return [e.name for e in self.fab.endpoints if e.kind == "storage"].index(name)

    @staticmethod
    def _link(dev: str, up: bool) -> None:
        from testbed.fabric.shell import run

        run(["ip", "link", "set", "dev", dev, "up" if up else "down"])

    async def heal(self) -> None:
        """Whatever a fault left broken at the mode's end is mended (timers cut short)."""
        for t in self._later:
            if not t.done():
                t.cancel()
        if self._later:
            await asyncio.wait(self._later, timeout=5)
        loop = asyncio.get_running_loop()
        for f in self.log.faults:
            if f.kind == "snic-down" and f.t_injected is not None:
                await loop.run_in_executor(None, self._link, self.fab.endpoint(f.spec.target).nic("snic").bridge_dev,
                                           True)
        for sp in self.c.stores:
            if sp.proc is None or sp.proc.poll() is not None:
                await loop.run_in_executor(None, sp.start)
        for root in self.c.disk_mounts:
            free_disk(root)

