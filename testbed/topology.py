"""Topology files: what cluster to emulate, validated with clear errors.

A topology names the paper's hardware in the paper's units (Gbit/s per NIC,
GiB of memory) plus one `scale` factor that maps them onto what two cores can
carry. Everything downstream reads the scaled numbers from `Topology`.

Every error is one line naming the file, the field and the fix. Loading is
bounded whatever the file holds: only a regular file is read (a FIFO would
block, /dev/zero never ends), at most MAX_FILE_BYTES of it, as UTF-8; YAML is
composed with at most MAX_DEPTH levels of nesting and MAX_NODES nodes once
aliases are expanded (an alias bomb composes to a few nodes that expand to
billions); a scalar has at most MAX_SCALAR_CHARS characters and an integer at
most 18 digits; and no error message echoes more than a short repr.

Bounds on what the emulation can carry (each with its reason):
  * every shaped rate after `scale` (CNIC, SNIC, host port, storage NIC; the
    disk rate too) lies in [MIN_BPS, MAX_BPS] = [1 Mbit/s, 100 Gbit/s]. Below
    1 Mbit/s one 64 KiB Full Block of the demo model takes over half a second
    per NIC, HTB's kv class (15/255 of the link) is under 60 kbit/s, and a rate
    that rounds to 0 bit/s is no rate at all; above 100 Gbit/s HTB shapes
    nothing on this host (one TCP flow over loopback moves 13 Gbit/s on the
    2-core dev machine, a veth less), so the run would not emulate the rate the
    file names;
  * rates in paper units are finite and at most 10^6 Gbit/s, snic_ratio at most
    100: anything larger is a typo, and inf/NaN would reach tc as garbage;
  * dram_buffer_gib and hbm_gib_per_engine in [1/1024, 1024] GiB and at most
    this machine's memory: each buffer is allocated whole by one process, so a
    larger one fails at bring-up (a MemoryError after the namespaces exist);
  * at most 99 nodes per role, 99 engines per node (interface names) and 256
    engines in all (each is a process holding its own copy of the model), at
    most 99 storage servers.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from dualpath.analysis import method
from dualpath.analysis.bounds import pd_bounds
from dualpath.analysis.testbed_bounds import testbed_model
from testbed.paths import REPO
from testbed.topology_file import MAX_SCALAR_CHARS, TopologyError, _parse_yaml, _read, _short_name, _source
from testbed.topology_servers import ServerSpec, _Strict, check_placement


MIN_BPS = 1_000_000  # 1 Mbit/s, see the module docstring


MAX_BPS = 100_000_000_000  # 100 Gbit/s


MAX_GBPS = 1e6  # paper units


MIN_GIB, MAX_GIB = 2.0**-10, 1024.0


MAX_ENGINES = 256


TOPOLOGIES = REPO / "topologies"  # the shipped topologies


DEFAULT_TOPOLOGY = TOPOLOGIES / "1p1d.yaml"
PAPER_MAXLEN_TOKENS = 65536  # the paper's longest trace set (MaxLen 64K): `dualpath topo` sizes batches at it


# One fix hint per field, used in error messages.
_HINTS: dict[str, str] = {
    "name": "give the topology a short name, e.g. name: 1p1d",
    "scale": "set scale to a number in (0, 1], e.g. 0.0025 maps 400 Gbit/s to 1 Gbit/s",
    "prefill_nodes": "set prefill_nodes to an integer in [1, 99]",
    "decode_nodes": "set decode_nodes to an integer in [1, 99]",
    "engines_per_node": "set engines_per_node (g) to an integer in [1, 99]",
    "cnic_gbps": "set cnic_gbps (B, per engine, paper units) to a positive number, e.g. 400",
    "snic_ratio": "set snic_ratio (s, SNIC = s*B per node) to a positive number up to 100, e.g. 0.25",
    "dram_gbps": "set dram_gbps (M, DRAM bandwidth per node, paper units) to a positive number",
    "dram_buffer_gib": "set dram_buffer_gib (DRAM KV buffer per node) to a number of GiB in [1/1024, 1024] "
                       "that fits this machine's memory, e.g. 4",
    "hbm_gib_per_engine": "set hbm_gib_per_engine to a number of GiB in [1/1024, 1024] that fits this "
                          "machine's memory, e.g. 1",
    "storage": "give a storage section: storage: {servers: 1, disk_gbps: 200, nic_gbps: 400}",
    "storage.servers": "set storage.servers to an integer in [1, 99]",
    "storage.disk_gbps": "set storage.disk_gbps to a positive number (paper units)",
    "storage.nic_gbps": "set storage.nic_gbps to a positive number (paper units)",
    "qos": "set qos to on or off",
    "collectives": "set collectives to on (the target's per-layer AllToAll over the CNICs) or off",
    "compute": "set compute to emulated (the target GPU's time) or cpu (the host's own time)",
    "target": "name a known GPU and model, e.g. target: {gpu: h800, model: qwen2.5-32b}",
    "target.gpu": "name a known GPU, e.g. h800 (see emulators/gpu/specs.py)",
    "target.model": "name a known target model, e.g. qwen2.5-32b (see emulators/gpu/models.py)",
    "mtu": "set mtu to an integer in [576, 9000]",
    "gso_max_bytes": "set gso_max_bytes to an integer from the mtu to 65536, or leave it out (the kernel's 65536)",
    "hosts": "set hosts to namespaces (Mininet hosts, the default) or docker (one container per namespace)",
    "store": "set store to 3fs-like (the project's store on disk, the default) or mooncake (Mooncake Store: "
             "mooncake_master and DRAM segments on the storage hosts)",
    "container_limits": "give container_limits per kind, e.g. {engine: {cpus: 0.5, memory_gib: 4}} "
                        "(kinds: engine, host, storage), with hosts: docker",
    "description": f"keep description to at most {MAX_SCALAR_CHARS} characters",
    "servers": "list the servers, this machine first and without ssh: servers: [{name: here}, "
               "{name: b, ssh: root@10.0.0.2}] (docs/cluster.md)",
    "tunnel": "set tunnel to gretap (the default) or vxlan (for kernels without ip_gre)",
    "place": "map nodes (p0, d0, ...) and storage servers (s0, ...) to server names: place: {d0: b} "
             "(docs/cluster.md)",
}


_Gbps = Field(gt=0, le=MAX_GBPS)


_GiB = Field(ge=MIN_GIB, le=MAX_GIB)


class StorageSpec(_Strict):
    servers: int = Field(ge=1, le=99)
    disk_gbps: float = _Gbps
    nic_gbps: float = _Gbps


class LimitsSpec(_Strict):
    """One container's cgroup limits (hosts: docker); a field left out is unlimited."""

    cpus: float | None = Field(default=None, gt=0, le=1024)  # a hard cap (CFS quota), in CPUs
    cpu_shares: int | None = Field(default=None, ge=2, le=262144)  # a weight under contention (1024: default)
    memory_gib: float | None = Field(default=None, ge=MIN_GIB, le=MAX_GIB)


class ContainerLimitsSpec(_Strict):
    """Limits per kind of namespace: every engine's container, every node's host container,
    every storage server's."""

    engine: LimitsSpec | None = None
    host: LimitsSpec | None = None
    storage: LimitsSpec | None = None


class TargetSpec(_Strict):
    """The cluster being emulated: a GPU and the model it serves (DESIGN.md section 3a)."""

    gpu: str = Field(default="h800", max_length=64)
    model: str = Field(default="qwen2.5-32b", max_length=64)
    # The workload's lengths are the target's divided by this (the paper presets' --length-scale).
    # The HBM budget is divided by it too, so that an engine holds as many of the testbed's
    # requests as the target holds of the unscaled ones: otherwise lengths / 32 leave 32 times the
    # room and the target's HBM never binds (DESIGN.md 3a). 1: the budget in the target's bytes.
    hbm_length_scale: float = Field(default=1.0, ge=1, le=1024)

    @model_validator(mode="after")
    def _known(self) -> "TargetSpec":
        from emulators.gpu.cost import target

        try:
            target(self.gpu, self.model)
        except KeyError as e:  # names the bad one and the known ones, in one line
            raise ValueError(e.args[0]) from None
        return self


class TopologySpec(_Strict):
    """The file as written: paper units."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    scale: float = Field(gt=0, le=1)
    prefill_nodes: int = Field(ge=1, le=99)
    decode_nodes: int = Field(ge=1, le=99)
    engines_per_node: int = Field(ge=1, le=99)
    cnic_gbps: float = _Gbps
    snic_ratio: float = Field(gt=0, le=100)
    dram_gbps: float = _Gbps
    dram_buffer_gib: float = _GiB
    hbm_gib_per_engine: float = _GiB
    storage: StorageSpec
    qos: bool = True
    # Model-class traffic: the engines of a group run the target's per-layer collective (the
    # AllToAll of expert parallelism) over their CNICs and every pass waits for it. Off by
    # default: the shipped targets' Qwen2.5-32B is served data-parallel and has none.
    collectives: bool = False
    mtu: int = Field(default=1500, ge=576, le=9000)
    # The largest packet a CNIC or host port sends into its HTB (the kernel's gso_max_size of the
    # sending end; None keeps the kernel's 64 KiB). HTB cannot preempt a packet: a model-class
    # packet that arrives just after a kv packet left waits that packet's time at the link rate
    # (64 KiB is 0.5 ms at 1 Gbit/s). InfiniBand's virtual lanes interleave at packet granularity
    # (an MTU of at most 4 KiB), so the isolation experiment caps it. Smaller costs CPU per byte.
    gso_max_bytes: int | None = Field(default=None, ge=576, le=65536)
    # Time: "emulated" runs every pass and decode step for as long as the target takes
    # (times the dilation); "cpu" keeps the host's own time, for runs that time the CPU.
    compute: Literal["emulated", "cpu"] = "emulated"
    target: TargetSpec = TargetSpec()
    # How a node's namespaces are made: Mininet hosts, or Docker containers of the project's
    # node image (testbed/fabric/containers.py), with optional cgroup limits.
    hosts: Literal["namespaces", "docker"] = "namespaces"
    container_limits: ContainerLimitsSpec | None = None
    # The KV store on the storage hosts: the project's 3FS-like store (emulators/kvstore, on disk),
    # or Mooncake Store (emulators/mooncake_store.py: mooncake_master and DRAM segments).
    store: Literal["3fs-like", "mooncake"] = "3fs-like"
    description: str = Field(default="", max_length=MAX_SCALAR_CHARS)
    # A team's KV connector, MODULE:CLASS or FILE.py:CLASS (a FILE relative to this topology's
    # folder): what `dualpath run --connector` names (dualpath/kv/plugin.py, docs/connectors.md).
    connector: str | None = Field(default=None, min_length=3, max_length=300, pattern=r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$")
    # Several servers (DESIGN.md section 12, docs/cluster.md): none means this machine alone.
    servers: list[ServerSpec] = Field(default_factory=list, max_length=16)
    place: dict[str, str] = Field(default_factory=dict, max_length=400)
    # What joins the servers' bridges: gretap (Mininet's cluster edition, MaxiNet), or VXLAN where
    # a kernel has no ip_gre (this project's dev machine: docs/cluster.md).
    tunnel: Literal["gretap", "vxlan"] = "gretap"
    # Linux interface names are at most 15 bytes; ours are dpt-p<N>e<M>-cnb: hence <= 99 (le above).

    @field_validator("gso_max_bytes")
    @classmethod
    def _gso_holds_a_packet(cls, v: int | None, info: ValidationInfo) -> int | None:
        mtu = info.data.get("mtu")
        if v is not None and mtu is not None and v < mtu:
            raise ValueError(f"{v} is below the mtu {mtu}")
        return v

    @model_validator(mode="after")
    def _limits_need_containers(self) -> "TopologySpec":
        if self.container_limits is not None and self.hosts != "docker":
            raise ValueError("container_limits apply to hosts: docker only")
        return self

    @model_validator(mode="after")
    def _placement_names_servers(self) -> "TopologySpec":
        check_placement(self)
        return self


@dataclass(frozen=True)
class Topology:
    """A validated topology with emulated (scaled) rates in bit/s."""

    spec: TopologySpec
    source: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def g(self) -> int:
        return self.spec.engines_per_node

    @property
    def cnic_bps(self) -> int:
        return _bps(self.spec.cnic_gbps * self.spec.scale)

    @property
    def snic_bps(self) -> int:
        return _bps(self.spec.snic_ratio * self.spec.cnic_gbps * self.spec.scale)

    @property
    def dram_bps(self) -> int:
        return _bps(self.spec.dram_gbps * self.spec.scale)

    @property
    def host_port_bps(self) -> int:
        """The host port stands for the DRAM side of all g CNICs: g*B, or M if smaller."""
        return min(self.g * self.cnic_bps, self.dram_bps)

    @property
    def host_port_basis(self) -> str:
        return "g*B" if self.g * self.cnic_bps <= self.dram_bps else "M (DRAM bandwidth)"

    @property
    def storage_nic_bps(self) -> int:
        return _bps(self.spec.storage.nic_gbps * self.spec.scale)

    @property
    def disk_bps(self) -> int:
        return _bps(self.spec.storage.disk_gbps * self.spec.scale)

    def pd_range(self) -> tuple[float, float]:
        s = self.spec
        return pd_bounds(g=s.engines_per_node, s=s.snic_ratio, m_over_b=s.dram_gbps / s.cnic_gbps)

    @property
    def pd_ratio(self) -> float:
        return self.spec.prefill_nodes / self.spec.decode_nodes

    def in_bottleneck_free_range(self) -> bool:
        lo, hi = self.pd_range()
        return lo <= self.pd_ratio <= hi

    def testbed_model(self) -> method.Model:
        """The testbed's own resources at this topology's emulated rates (its veths, each
        direction apart; dualpath/analysis/testbed_bounds.py)."""
        return testbed_model(self.g, self.cnic_bps, self.snic_bps, self.host_port_bps,
                             self.spec.storage.servers * self.storage_nic_bps)

    def testbed_range(self) -> method.PDRange:
        """The testbed's own bottleneck-free P/D range, by the paper's method over its links."""
        return method.pd_range(self.testbed_model())

    def predicted_bottleneck(self) -> str:
        """The resource the testbed's analysis predicts saturates first at this P and D."""
        return method.first_saturating(self.testbed_model(), self.spec.prefill_nodes, self.spec.decode_nodes)

    @property
    def emulated(self) -> bool:
        return self.spec.compute == "emulated"

    def _collectives_line(self) -> str:
        return _collectives_line(self)

    def target(self):
        """The emulated GPU and model (emulators.gpu.cost.Target)."""
        from emulators.gpu.cost import target

        return target(self.spec.target.gpu, self.spec.target.model)

    def hbm_budget(self):
        """One engine's HBM on the target, in target bytes (emulators.gpu.memory.HbmBudget)."""
        from emulators.gpu.memory import hbm_budget

        return hbm_budget(self.target(), self.spec.target.hbm_length_scale)

    def hbm_plan(self, testbed_kv_bytes_per_token: int | None):
        """What passes and decode batches are packed against (dualpath.scheduler.hbm.HbmPlan): the
        target's budget, decode capped by this topology's own HBM buffer in the testbed's bytes per
        token (None: the target's units, where that buffer means nothing)."""
        cap = (int(self.spec.hbm_gib_per_engine * 2**30) // testbed_kv_bytes_per_token
               if testbed_kv_bytes_per_token else None)
        return self.hbm_budget().plan(cap)

    def dilation(self, testbed_kv_bytes_per_token: int) -> float:
        """k: testbed seconds per emulated second, for a testbed model with this many KV bytes
        per token (1 on the CPU's own clock)."""
        if not self.emulated:
            return 1.0
        from emulators.gpu.cost import dilation

        return dilation(testbed_kv_bytes_per_token, self.target().model.kv_bytes_per_token, self.spec.scale)

    def describe(self, testbed_kv_bytes_per_token: int | None = None) -> list[str]:
        """What the file describes; with the testbed model's KV bytes per token, also the time scale."""
        s = self.spec
        lo, hi = self.pd_range()
        verdict = "inside" if self.in_bottleneck_free_range() else "OUTSIDE"
        tgt = self.target()
        if not self.emulated:
            time_line = (f"compute: cpu: passes take what the host's CPU takes (target {s.target.model} on "
                         f"{s.target.gpu} not emulated); timings measure this machine")
        elif testbed_kv_bytes_per_token:
            k = self.dilation(testbed_kv_bytes_per_token)
            time_line = (f"target {s.target.model} on {s.target.gpu} ({tgt.model.kv_bytes_per_token:,} KV bytes/token); "
                         f"dilation k = {k:.3g} for the testbed model's {testbed_kv_bytes_per_token:,} B/token: "
                         f"one emulated second lasts {k:.3g} s here")
        else:
            time_line = f"target {s.target.model} on {s.target.gpu} (emulated clock)"
        return [
            f"topology {s.name} ({self.source}): {s.prefill_nodes}P{s.decode_nodes}D, "
            f"g={s.engines_per_node}, s={s.snic_ratio}, scale={s.scale:g}",
            f"CNIC {_fmt(self.cnic_bps)} per engine, SNIC {_fmt(self.snic_bps)} per node, "
            f"host port {_fmt(self.host_port_bps)} ({self.host_port_basis}), "
            f"storage NIC {_fmt(self.storage_nic_bps)} x{s.storage.servers}"
            + (" (Mooncake Store)" if s.store == "mooncake" else ""),
            f"P/D={self.pd_ratio:.3g} is {verdict} the paper's bottleneck-free range "
            f"[{lo:.3g}, {hi:.3g}]; QoS {'on' if s.qos else 'off'}; collectives {self._collectives_line()}"
            + (f"; CNICs and host ports send packets of at most {s.gso_max_bytes} B (gso_max_bytes)"
               if s.gso_max_bytes else ""),
            *self._testbed_bound_lines(),
            time_line,
            *self._hbm_lines(),
            *([self._hosts_line()] if s.hosts == "docker" else []),
        ]

    def _hbm_lines(self) -> list[str]:
        """Each engine's HBM for KV on the target, and the largest prefill batch it allows."""
        if not self.emulated:
            return []
        from dualpath.workload.spec import PAPER_SCALE

        b, ctx = self.hbm_budget(), PAPER_MAXLEN_TOKENS // PAPER_SCALE
        basic, lw = b.largest_batch_tokens(ctx, True), b.largest_batch_tokens(ctx, False)
        over = f" / {b.length_scale:g} (hbm_length_scale)" if b.length_scale != 1 else ""

        def budget(weights: float, left: float) -> str:
            room = (f"{b.capacity_bytes / 1e9:.0f} GB less {weights / 1e9:.1f} GB of weights less a "
                    f"{b.reserve_bytes / 1e9:.0f} GB reserve")
            return f"{f'({room}){over}' if over else room} = {left / 1e9:.2f} GB for KV"

        decode = (f"; decode {budget(b.decode_weight_bytes, b.decode_budget_bytes)}"
                  if b.decode_weight_bytes != b.weight_bytes else "")
        return [f"HBM per engine (target bytes): prefill {budget(b.weight_bytes, b.budget_bytes)}{decode}; "
                f"{b.decode().tokens:,} tokens (a decode batch's limit)",
                f"largest prefill batch at a {ctx:,}-token context (the 64K MaxLen at length scale {PAPER_SCALE}): "
                f"Basic {basic:,} tokens ({b.largest_batch_requests(ctx, True)} requests), Layerwise and DualPath "
                f"{lw:,} tokens ({b.largest_batch_requests(ctx, False)} requests)"]

    def _hosts_line(self) -> str:
        lim = self.spec.container_limits
        parts = [f"{kind} {', '.join(f'{k} {v:g}' for k, v in getattr(lim, kind).model_dump().items() if v)}"
                 for kind in ("engine", "host", "storage") if lim and getattr(lim, kind)]
        return ("hosts: docker, a container of the node image per namespace (testbed/fabric/containers.py); limits: "
                + ("; ".join(parts) if parts else "none"))

    def _testbed_bound_lines(self) -> list[str]:
        """The testbed's own range (its veths' rx and tx, not PCIe and DRAM), the storage NICs'
        limit on the cluster's size, and the resource predicted to saturate first here."""
        rng = self.testbed_range()
        p, d = self.spec.prefill_nodes, self.spec.decode_nodes
        inside = "inside" if rng.contains(self.pd_ratio) else "OUTSIDE"
        lines = [f"testbed's own range (its links, each direction): {method.format_range(rng)}; "
                 f"P/D={self.pd_ratio:.3g} is {inside} it"]
        for c in rng.cluster_limits:
            lines.append(f"  cluster size: {c.describe()} ({p + d} nodes: "
                         f"{'holds' if c.holds(p, d) else 'EXCEEDED'})")
        u = method.utilizations(self.testbed_model(), p, d)
        first = method.first_saturating(self.testbed_model(), p, d)
        lines.append(f"  predicted to saturate first here: {first} (at {u[first]:.2f} of its rate with "
                     f"every SNIC at full rate)")
        return lines


def _collectives_line(topo: "Topology") -> str:
    if not topo.spec.collectives:
        return "off"
    from emulators.gpu.collectives import collective_traffic

    c = collective_traffic(topo.target().model)
    return (f"on ({c.kind} of EP {c.ep} over {c.nodes} nodes: {c.bytes_per_token / 1e6:.3g} MB per token on the "
            f"target's CNIC, {c.bytes_per_token / topo.target().model.kv_bytes_per_token:.3g}x its KV bytes; scaled like KV)")


def _bps(gbps: float) -> int:
    return int(round(gbps * 1e9))


def _fmt(bps: float) -> str:
    return f"{bps / 1e9:.3g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.3g} Mbit/s"


def load_topology(path: str | Path, carried: bool = True) -> Topology:
    """Read and validate a topology file; raise TopologyError with a one-line message.
    `carried=False` skips the bounds of what this machine's emulation can carry (rates, engine
    count, buffer sizes): for the simulator, which runs clusters no testbed here could."""
    path = Path(path)
    src = _source(path)
    return parse_topology(_parse_yaml(_read(path, src), src), source=src, carried=carried)


def machine_memory_bytes() -> int:
    """This machine's physical memory (0 if unknown: no memory bound is then applied)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def parse_topology(raw: Any, source: str = "<topology>", memory_bytes: int | None = None,
                   carried: bool = True) -> Topology:
    """Validate a topology's fields; `memory_bytes` (default: this machine's) bounds the buffers;
    `carried=False` skips those emulation bounds altogether (see load_topology)."""
    if not isinstance(raw, dict):
        raise TopologyError(f"{source}: expected a mapping of fields at the top level; "
                            "fix: see topologies/1p1d.yaml")
    try:
        topo = Topology(spec=TopologySpec.model_validate(raw), source=source)
    except ValidationError as e:
        raise TopologyError(_one_line(e, source)) from None
    if carried:
        _check_carried(topo, source, machine_memory_bytes() if memory_bytes is None else memory_bytes)
    return topo


def _check_carried(t: Topology, source: str, memory_bytes: int) -> None:
    """What the emulation can carry: shaped rates after scale, engine count, buffer sizes."""
    s = t.spec

    def fail(field: str, problem: str, fix: str) -> None:
        raise TopologyError(f"{source}: field '{field}' is invalid ({problem}); fix: {fix}")

    scale_fix = "choose scale (or the rate) so every emulated NIC runs at 1 Mbit/s .. 100 Gbit/s"
    for field, bps, what in (("cnic_gbps", t.cnic_bps, "the CNIC"), ("snic_ratio", t.snic_bps, "the SNIC (s*B)"),
                             ("dram_gbps", t.host_port_bps, "the host port (min(g*B, M))"),
                             ("storage.nic_gbps", t.storage_nic_bps, "the storage NIC"),
                             ("storage.disk_gbps", t.disk_bps, "the disk")):
        if not MIN_BPS <= bps <= MAX_BPS:
            fail(field, f"at scale {s.scale:g} {what} would run at {_fmt(bps)}, outside "
                        f"[{_fmt(MIN_BPS)}, {_fmt(MAX_BPS)}]", scale_fix)
    engines = (s.prefill_nodes + s.decode_nodes) * s.engines_per_node
    if engines > MAX_ENGINES:
        fail("engines_per_node", f"{engines} engines in all, more than {MAX_ENGINES} processes this host can run",
             "use fewer nodes or engines per node")
    if s.collectives:
        from emulators.gpu.collectives import NoCollective, collective_traffic

        try:
            collective_traffic(t.target().model)
        except NoCollective as e:
            fail("collectives", str(e), "set collectives: off, or name a target with cross-node expert "
                 "parallelism (e.g. target: {gpu: h800, model: deepseek-v3.2})")
        if s.engines_per_node < 2 and s.prefill_nodes < 2:
            fail("collectives", "no engine group has two engines, so nothing would exchange",
                 "give the group peers: engines_per_node >= 2 or prefill_nodes >= 2")
    gib = 2.0**30
    for field, v in (("dram_buffer_gib", s.dram_buffer_gib), ("hbm_gib_per_engine", s.hbm_gib_per_engine)):
        if memory_bytes and v * gib > memory_bytes:
            fail(field, f"{v:g} GiB is more than this machine's {memory_bytes / gib:.3g} GiB of memory",
                 _HINTS[field])


def _one_line(e: ValidationError, source: str) -> str:
    err = e.errors()[0]
    field = _short_name(".".join(str(p) for p in err["loc"]) or "(top level)", 60)
    kind = err["type"]
    shown = _short_repr(err.get("input"))
    if kind == "missing":
        problem = "is missing"
    elif kind == "extra_forbidden":
        return f"{source}: field '{field}' is not a topology field; fix: remove it or fix its spelling"
    elif kind.endswith("_type") or kind.endswith("_parsing"):
        problem = f"has the wrong type ({type(err.get('input')).__name__} {shown})"
    else:
        problem = f"is invalid ({_short_name(err['msg'].lower(), 120)}; got {shown})"
    hint = next((_HINTS[k] for k in (field, field.split(".")[0]) if k in _HINTS),
                "see topologies/1p1d.yaml for a valid example")
    return f"{source}: field '{field}' {problem}; fix: {hint}"


def _short_repr(v: Any, limit: int = 40) -> str:
    """A bounded repr, in bounded time, of any value YAML can make (a DAG of aliases included)."""
    from dualpath.store.errors import short_repr

    return short_repr(v, limit)


def resolve_topology(name: str | os.PathLike[str] | None) -> Path:
    """A topology path, or the name of a shipped one ("1p1d" -> topologies/1p1d.yaml)."""
    if name is None:
        return DEFAULT_TOPOLOGY
    p = Path(name)
    if p.exists() or p.suffix in (".yaml", ".yml") or os.sep in str(name):
        return p
    shipped = TOPOLOGIES / f"{name}.yaml"
    return shipped if shipped.exists() else p


def topology_with(name: str, overrides: dict[str, Any]):
    """topologies/<name>.yaml, validated, with `overrides` applied (the name then says so)."""
    path = TOPOLOGIES / f"{name}.yaml"
    if not overrides:
        return load_topology(path)
    raw = yaml.safe_load(path.read_text())
    raw.update(overrides)
    if "name" not in overrides:
        tail = "".join(f"-{k}{v}" for k, v in sorted(overrides.items()) if k != "description")
        raw["name"] = (name + re.sub(r"[^A-Za-z0-9.-]", "", tail))[:60]  # the name's alphabet
    return parse_topology(raw, source=f"{path} with {overrides}")
