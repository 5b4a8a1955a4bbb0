"""iperf3 flows between testbed namespaces (only to addresses the testbed made)."""
from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

from testbed.fabric.shell import CommandError, ns_argv, run


@dataclass(frozen=True)
class FlowResult:
    goodput_bps: float  # what the receiver got
    bytes: int  # received
    seconds: float
    lost_percent: float = 0.0


class IperfServer:
    """A one-shot iperf3 server in a namespace; always killed on exit."""

    def __init__(self, ns: str, ip: str, port: int):
        self.ns, self.ip, self.port = ns, ip, port
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "IperfServer":
        self.proc = subprocess.Popen(
            ns_argv(self.ns, ["iperf3", "-s", "-1", "-B", self.ip, "-p", str(self.port)]),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if run(["ss", "-Hltn", f"sport = :{self.port}"], ns=self.ns, check=False).strip():
                return self
            time.sleep(0.05)
        self.__exit__()
        raise CommandError(f"iperf3 server in {self.ns} did not listen on {self.ip}:{self.port}")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
        if self.proc:
            self.proc.wait(timeout=5)


def client_argv(ip: str, port: int, seconds: float, tos: int | None = None,
                udp_bps: int | None = None, parallel: int = 1, udp_len: int = 1400,
                pacing_us: int | None = None) -> list[str]:
    argv = ["iperf3", "-c", ip, "-p", str(port), "-t", f"{seconds:g}", "-J", "-P", str(parallel)]
    if tos is not None:
        argv += ["--tos", str(tos)]
    if udp_bps is not None:
        # A 4 MiB socket buffer keeps the receiving socket from dropping
        # datagrams when the CPU is busy: loss must come from the link.
        argv += ["-u", "-b", str(udp_bps), "-l", str(udp_len), "-w", "4M"]
    if pacing_us is not None:  # iperf3 sends what the rate allows once per tick (default 1 ms)
        argv += ["--pacing-timer", str(pacing_us)]
    return argv


def parse_client(out: str) -> FlowResult:
    try:
        doc = json.loads(out)
    except json.JSONDecodeError:
        raise CommandError(f"iperf3 printed no JSON: {out[:200]!r}") from None
    if "error" in doc:
        raise CommandError(f"iperf3: {doc['error']}")
    r = doc["end"]["sum_received"]  # the receiver's view, TCP and UDP alike
    return FlowResult(r["bits_per_second"], r["bytes"], r["seconds"], float(r.get("lost_percent", 0.0)))


def flow(src_ns: str, dst_ns: str, dst_ip: str, port: int, seconds: float, **kw: object) -> FlowResult:
    """One iperf3 flow from src_ns to dst_ns; returns the receiver's view."""
    with IperfServer(dst_ns, dst_ip, port):
        out = run(client_argv(dst_ip, port, seconds, **kw), ns=src_ns, timeout=seconds + 15)  # type: ignore[arg-type]
    return parse_client(out)
