"""What the simulator takes from testbed measurements: a few latencies and one link efficiency.

Everything else in the simulator is the testbed's own code or arithmetic (the scheduler, the batch
packing, the request planning, the cost model, the byte accounting, the max-min link model). What
is left are costs of the testbed's implementation that no model of the target predicts:

  rpc_s           one control round trip (ZeroMQ + msgpack between processes on shared cores): a
                  leader's report gathering, its pull, each assignment it hands on, the conductor's
                  commands (submit, load, prefill_batch, wait_notifs, decode, flush). Testbed s.
  pass_fixed_s    a prefill pass's own work outside the layer windows (embedding, logits,
                  connector set-up, the reply), beyond the command's round trip.
  step_gap_s      between two decode steps of an engine (its loop's poll), per step.
  load_fixed_s    a store load's own latency (the request frames, the first block's CRC).
  flush_fixed_s   a write-back flush's own latency (durable puts: temp file, fsync, link).
  compute_efficiency  share of a compute NIC's or host port's payload rate that NIXL's
                  one-sided transfers over UCX/TCP reach (per-layer descriptor lists, requests).
  read_contention_s   a flush leaves a node whose storage NIC is reading: its acknowledgements
                  queue behind the reads on the SNIC's busy direction; this long per flush.
  exposed_io      the engines' transfers move only while the engine waits on them (no progress
                  thread: NIXL over UCX/TCP here), so a pass's READs and WRITEs add to its layer
                  windows instead of hiding behind them; False is the design (RDMA, layerwise).
  xfer_latency_s  with exposed_io, each transfer's own latency (one READ and one WRITE per
                  request and layer of a pass).
  burst_extra_bytes  per shaped NIC kind, the payload bytes an idle link lets a fresh flow send
                  at once beyond its HTB bucket (HTB sends while a class's tokens are not negative
                  and charges the whole segment afterwards), as `dualpath bench burst` measured on
                  the topology's own links; a kind it does not name gets the bucket alone.
  jitter          how much one such latency varies from one message to the next on the testbed
                  (processes sharing a few cores are scheduled late by chance): each is drawn as
                  its value times a lognormal factor of mean 1 and this relative standard
                  deviation, from the simulation's seed. 0: every latency exactly its value (one
                  order of events). An offline JCT is the slowest agent's: a max over noisy chains,
                  so a simulation without the noise comes out early (a max of means is below the
                  mean of the max), and round-robin's path draws follow the order of events.

The host's CPU. The testbed's processes share a few cores with the NICs' emulation, and every
latency above stretches as they fill: a latency is its calibrated value times an M/M/c queue's
response factor (parts.queue_stretch: 1 / (1 - U^2) on two cores; it was 1 / (1 - U), one core's,
which made every latency of the held-out runs at U ~ 0.6 too long), U the share of the cores busy
over the last `cpu_window_s`, predicted as the testbed's CPU was measured
to go (cores busy = cpu_base + cpu_per_compute x the engines' compute seconds per second +
cpu_per_mbps x KV MB per second over all NICs), the engines' compute from their own logs (a pass:
pass_cpu = (s, per request, per predicted emulated second); a decode step: step_cpu likewise).
cpu_cores = 0 turns the host off: a projected cluster has no testbed host.

A Calibration is written by `dualpath sim --calibrate RUN [--calibrate RUN ...]` with the run
folders it was fitted on (path, command, topology, APS, digest of each summary; the dilation) and
the fit's own residuals; it is never typed in. Its times are real seconds, as the testbed's processes spent them (testbed
seconds): the same in a simulation of any testbed configuration, whatever its dilation, and kept
as they are in a simulation in the target's own time (what this software stack would cost
beside a real cluster's GPUs).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

COMMITTED = Path(__file__).with_name("calibration.json")  # fitted on the committed runs; package data

FIELDS = ("rpc_s", "pass_fixed_s", "step_gap_s", "load_fixed_s", "flush_fixed_s", "compute_efficiency",
          "read_contention_s", "exposed_io", "xfer_latency_s", "cpu_cores", "cpu_base", "cpu_per_compute",
          "cpu_per_mbps", "pass_cpu", "step_cpu", "cpu_window_s", "jitter", "burst_extra_bytes")
TIMES = ("rpc_s", "pass_fixed_s", "step_gap_s", "load_fixed_s", "flush_fixed_s", "read_contention_s",
         "xfer_latency_s")


@dataclass(frozen=True)
class Calibration:
    rpc_s: float = 0.0
    pass_fixed_s: float = 0.0
    step_gap_s: float = 0.0
    load_fixed_s: float = 0.0
    flush_fixed_s: float = 0.0
    compute_efficiency: float = 1.0
    read_contention_s: float = 0.0
    exposed_io: bool = False
    xfer_latency_s: float = 0.0
    cpu_cores: float = 0.0  # 0: no host model
    cpu_base: float = 0.0
    cpu_per_compute: float = 0.0
    cpu_per_mbps: float = 0.0
    pass_cpu: tuple[float, float, float] = (0.0, 0.0, 0.0)
    step_cpu: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cpu_window_s: float = 1.0
    jitter: float = 0.0  # relative standard deviation of each latency above (0: exact)
    burst_extra_bytes: dict[str, float] = field(default_factory=dict)  # NIC kind -> payload bytes
    dilation: float = 1.0  # the source run's (provenance: its emulated second in testbed seconds)
    source: dict[str, Any] = field(default_factory=dict)  # the run it was fitted on, and the fit

    def __post_init__(self) -> None:
        for k in TIMES:
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v >= 0 and v == v and v != float("inf")):
                raise ValueError(f"calibration {k} must be a finite number of seconds >= 0, got {v!r}")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(f"calibration compute_efficiency must be in (0, 1], got {self.compute_efficiency!r}")
        for kind, b in self.burst_extra_bytes.items():
            if not (isinstance(b, (int, float)) and 0 <= b < 1 << 30):
                raise ValueError(f"calibration burst_extra_bytes[{kind!r}] must be a byte count in [0, 1 GiB), got {b!r}")
        if not (isinstance(self.jitter, (int, float)) and 0 <= self.jitter < 10):
            raise ValueError(f"calibration jitter must be a relative standard deviation in [0, 10), got {self.jitter!r}")
        if not self.dilation > 0:
            raise ValueError(f"calibration dilation must be > 0, got {self.dilation!r}")

    def constants(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FIELDS}

    def without_host(self) -> "Calibration":
        """The same latencies with the host's CPU model off (a projection: no testbed host, so none of
        its scheduling noise either)."""
        return replace(self, cpu_cores=0.0, jitter=0.0)

    def exact(self) -> "Calibration":
        """The same constants, every latency exactly its value (one order of events)."""
        return replace(self, jitter=0.0)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Calibration":
        known = {f.name for f in fields(cls)}
        extra = set(d) - known
        if extra:
            raise ValueError(f"calibration: unknown field(s) {', '.join(sorted(extra))}")
        d = dict(d)
        for k in ("pass_cpu", "step_cpu"):
            if k in d:
                d[k] = tuple(float(x) for x in d[k])
        return cls(**d)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "Calibration":
        try:
            d = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a calibration file ({e})") from None
        return cls.from_dict(d)


UNCALIBRATED = Calibration(source={"note": "no testbed calibration: every latency 0, links at their rate"})
