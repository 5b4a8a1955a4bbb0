"""A saturating kv-class load on the engines' CNICs, for the isolation experiment.

One TCP flow per engine, from its node's host namespace (the DRAM side) into the engine: the
direction of H2D and of the DE->PE KV READs, so it fills the same shaped queue (the CNIC's
receiving side) that the group's collectives arrive through. The flow goes to a port in the kv
range, so nftables marks it AF11 exactly as it marks the KV transport; nothing sets its TOS.

Congestion control is loss-based (cubic) on purpose. The load stands for RDMA KV transfers on a
lossless fabric, which keep the link full and never back off because a queue grew; the testbed's
leaf queues are deep (16 MiB) to emulate "lossless", and a loss-based TCP fills them the same way.
The namespaces' default, BBR, paces to its estimate of the bottleneck and keeps the standing
queue short, which would understate what KV traffic does to a FIFO. (`cc` makes it a choice.)

Every flow is bounded in time (iperf3 -t) and ended on exit, whatever happens.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from dualpath.traffic_classes import KV_PORT_RANGE
from testbed.fabric.network import Endpoint, Fabric
from testbed.fabric.shell import CommandError, ns_argv, run

LOAD_PORTS = (KV_PORT_RANGE[1] - 63, KV_PORT_RANGE[1])  # the top of the kv range (UCX rarely lands there)
MAX_LOAD_S = 1800.0  # the flows' own bound; a condition stops them long before


@dataclass
class _Flow:
    engine: str
    server: subprocess.Popen
    client: subprocess.Popen
    port: int


@dataclass
class KvLoad:
    """Use as a context manager around a condition's run: the flows run in between."""

    fab: Fabric
    engines: list[Endpoint]
    cc: str = "cubic"
    max_s: float = MAX_LOAD_S
    flows: list[_Flow] = field(default_factory=list)

    def __enter__(self) -> "KvLoad":
        try:
            for e in self.engines:
                self.flows.append(self._start(e))
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, eng: Endpoint) -> _Flow:
        host = self.fab.endpoint(eng.node)
        ip = eng.nic("cnic").ip
        used = {f.port for f in self.flows}
        for port in range(LOAD_PORTS[0], LOAD_PORTS[1] + 1):
            if port in used or run(["ss", "-Htan", f"sport = :{port}"], ns=eng.name, check=False).strip():
                continue  # a transport agent listens there
            server = subprocess.Popen(ns_argv(eng.name, ["iperf3", "-s", "-1", "-B", ip, "-p", str(port)]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if self._listening(eng.name, port, server):
                client = subprocess.Popen(
                    ns_argv(host.name, ["iperf3", "-c", ip, "-p", str(port), "-t", f"{self.max_s:g}", "-C", self.cc,
                                        "-J", "--connect-timeout", "5000"]),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                return _Flow(eng.name, server, client, port)
            _end(server)
        raise CommandError(f"no free port in {LOAD_PORTS[0]}-{LOAD_PORTS[1]} for the kv load into {eng.name}")

    @staticmethod
    def _listening(ns: str, port: int, proc: subprocess.Popen, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if run(["ss", "-Hltn", f"sport = :{port}"], ns=ns, check=False).strip():
                return True
            time.sleep(0.05)
        return False

    def alive(self) -> list[str]:
        """Engines whose flow is still running (all of them, while the load holds)."""
        return [f.engine for f in self.flows if f.client.poll() is None]

    def stop(self) -> None:
        for f in self.flows:
            _end(f.client)
            _end(f.server)
        self.flows.clear()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
