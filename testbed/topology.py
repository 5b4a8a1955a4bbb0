"""Topology files: what cluster to emulate, validated with clear errors.

A topology names the paper's hardware in the paper's units (Gbit/s per NIC,
GiB of memory) plus one `scale` factor that maps them onto what two cores can
carry. Everything downstream reads the scaled numbers from `Topology`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from dualpath.analysis.bounds import pd_bounds


class TopologyError(ValueError):
    """A topology file is unusable. The message is one line: file, field, fix."""


# One fix hint per field, used in error messages.
_HINTS: dict[str, str] = {
    "name": "give the topology a short name, e.g. name: 1p1d",
    "scale": "set scale to a number in (0, 1], e.g. 0.0025 maps 400 Gbit/s to 1 Gbit/s",
    "prefill_nodes": "set prefill_nodes to an integer >= 1",
    "decode_nodes": "set decode_nodes to an integer >= 1",
    "engines_per_node": "set engines_per_node (g) to an integer >= 1",
    "cnic_gbps": "set cnic_gbps (B, per engine, paper units) to a positive number, e.g. 400",
    "snic_ratio": "set snic_ratio (s, SNIC = s*B per node) to a positive number, e.g. 0.25",
    "dram_gbps": "set dram_gbps (M, DRAM bandwidth per node, paper units) to a positive number",
    "dram_buffer_gib": "set dram_buffer_gib (DRAM KV buffer per node) to a positive number",
    "hbm_gib_per_engine": "set hbm_gib_per_engine to a positive number",
    "storage": "give a storage section: storage: {servers: 1, disk_gbps: 200, nic_gbps: 400}",
    "storage.servers": "set storage.servers to an integer >= 1",
    "storage.disk_gbps": "set storage.disk_gbps to a positive number (paper units)",
    "storage.nic_gbps": "set storage.nic_gbps to a positive number (paper units)",
    "qos": "set qos to on or off",
    "compute": "set compute to emulated (the target GPU's time) or cpu (the host's own time)",
    "target": "name a known GPU and model, e.g. target: {gpu: h800, model: qwen2.5-32b}",
    "target.gpu": "name a known GPU, e.g. h800 (see emulators/gpu/specs.py)",
    "target.model": "name a known target model, e.g. qwen2.5-32b (see emulators/gpu/models.py)",
    "mtu": "set mtu to an integer in [576, 9000]",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StorageSpec(_Strict):
    servers: int = Field(ge=1)
    disk_gbps: float = Field(gt=0)
    nic_gbps: float = Field(gt=0)


class TargetSpec(_Strict):
    """The cluster being emulated: a GPU and the model it serves (DESIGN.md section 3a)."""

    gpu: str = "h800"
    model: str = "qwen2.5-32b"

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

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    scale: float = Field(gt=0, le=1)
    prefill_nodes: int = Field(ge=1)
    decode_nodes: int = Field(ge=1)
    engines_per_node: int = Field(ge=1)
    cnic_gbps: float = Field(gt=0)
    snic_ratio: float = Field(gt=0)
    dram_gbps: float = Field(gt=0)
    dram_buffer_gib: float = Field(gt=0)
    hbm_gib_per_engine: float = Field(gt=0)
    storage: StorageSpec
    qos: bool = True
    mtu: int = Field(default=1500, ge=576, le=9000)
    # Time: "emulated" runs every pass and decode step for as long as the target takes
    # (times the dilation); "cpu" keeps the host's own time, for runs that time the CPU.
    compute: Literal["emulated", "cpu"] = "emulated"
    target: TargetSpec = TargetSpec()
    description: str = ""

    @model_validator(mode="after")
    def _fits_interface_names(self) -> "TopologySpec":
        # Linux interface names are at most 15 bytes; ours are dpt-p<N>e<M>-cnb.
        if max(self.prefill_nodes, self.decode_nodes) > 99 or self.engines_per_node > 99:
            raise ValueError("at most 99 nodes per role and 99 engines per node")
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

    @property
    def emulated(self) -> bool:
        return self.spec.compute == "emulated"

    def target(self):
        """The emulated GPU and model (emulators.gpu.cost.Target)."""
        from emulators.gpu.cost import target

        return target(self.spec.target.gpu, self.spec.target.model)

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
            f"storage NIC {_fmt(self.storage_nic_bps)} x{s.storage.servers}",
            f"P/D={self.pd_ratio:.3g} is {verdict} the bottleneck-free range "
            f"[{lo:.3g}, {hi:.3g}]; QoS {'on' if s.qos else 'off'}",
            time_line,
        ]


def _bps(gbps: float) -> int:
    return int(round(gbps * 1e9))


def _fmt(bps: float) -> str:
    return f"{bps / 1e9:.3g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.3g} Mbit/s"


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file; raise TopologyError with a one-line message."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise TopologyError(f"{path}: cannot read topology file ({e.strerror}); check the path") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" line {where.line + 1}" if where else ""
        raise TopologyError(f"{path}:{line} is not valid YAML; fix the syntax") from None
    return parse_topology(raw, source=str(path))


def parse_topology(raw: Any, source: str = "<topology>") -> Topology:
    if not isinstance(raw, dict):
        raise TopologyError(f"{source}: expected a mapping of fields at the top level; see topologies/1p1d.yaml")
    try:
        return Topology(spec=TopologySpec.model_validate(raw), source=source)
    except ValidationError as e:
        raise TopologyError(_one_line(e, source)) from None


def _one_line(e: ValidationError, source: str) -> str:
    err = e.errors()[0]
    field = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    if kind == "missing":
        problem = "is missing"
    elif kind == "extra_forbidden":
        return f"{source}: field '{field}' is not a topology field; remove it or fix its spelling"
    elif kind.endswith("_type") or kind.endswith("_parsing"):
        problem = f"has the wrong type ({type(err.get('input')).__name__} {err.get('input')!r})"
    else:
        problem = f"is invalid ({err['msg'].lower()}; got {err.get('input')!r})"
    hint = _HINTS.get(field, "see topologies/1p1d.yaml for a valid example")
    return f"{source}: field '{field}' {problem}; fix: {hint}"
