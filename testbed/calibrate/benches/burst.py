"""`dualpath bench burst`: how many bytes an idle shaped NIC lets a fresh TCP transfer send at once.

The simulator (simulator) models HTB's bucket: a link idle long enough sends its bucket
(emulators/nic.py's burst_bytes) at line rate, then its rate. HTB sends while a class's tokens are
not negative and charges the whole segment afterwards (a GSO segment of up to 64 KiB on a veth),
so a fresh flow gets somewhat more than the bucket, by an amount that depends on the segments TCP
builds. This measures it on the topology's own shaped links: after IDLE_S of silence, a transfer of
a fixed size crosses the NIC in its receive direction (as a read crosses an SNIC), timed from the
sender's first write to the receiver's acknowledgement of the last byte, REPEATS times. Per NIC
kind, the extra bytes are the rate times how much sooner the transfer ended than the bucket model
says (payload bytes, as the simulator counts them); their mean (a transfer's first packets leave in
a burst of 0 to several segments, so single transfers differ by whole packets) is what a
simulated read's mean time needs. `dualpath sim --calibrate ... --burst FOLDER`
takes the means into the calibration.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Any, Callable

from emulators.nic import burst_bytes
from testbed.calibrate.check import link_cases
from testbed.fabric.network import Fabric
from testbed.measure.fidelity import payload_share
from testbed.fabric.shell import ns_argv

IDLE_S = 1.0  # longer than any bucket takes to refill at its rate
REPEATS = 15
TRANSFER_S = 0.2  # each transfer lasts about this long at line rate
PORT = 5391


def bucket_model_s(payload: int, rate_bps: float, mtu: int) -> float:
    """How long `payload` bytes take through an idle HTB class at `rate_bps` (wire) if its bucket
    alone leaves at once (the simulator's model without burst_extra_bytes)."""
    return max(0.0, payload / payload_share(mtu) - burst_bytes(int(rate_bps), mtu)) * 8 / rate_bps


def extra_bytes(payload: int, seconds: float, rate_bps: float, mtu: int) -> float:
    """Payload bytes beyond the HTB bucket that a transfer of `payload` bytes must have sent at
    once to end after `seconds` at `rate_bps` (wire): the bucket model's time minus the measured
    one, at the rate. Negative: it ended later than the bucket model says."""
    return (bucket_model_s(payload, rate_bps, mtu) - seconds) * rate_bps / 8 * payload_share(mtu)


def _timed_transfers(src_ns: str, dst_ns: str, dst_ip: str, nbytes: int, tos: int) -> list[float]:
    import subprocess

    peer = [sys.executable, "-m", "testbed.calibrate.benches.burst_peer"]
    server = subprocess.Popen(ns_argv(dst_ns, [*peer, "serve", dst_ip, str(PORT), str(nbytes), str(REPEATS)]),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out = subprocess.run(ns_argv(src_ns, [*peer, "send", dst_ip, str(PORT), str(nbytes), str(REPEATS),
                                              str(IDLE_S), str(tos)]),
                             capture_output=True, text=True, timeout=REPEATS * (IDLE_S + 10) + 10)
        if out.returncode != 0:
            raise RuntimeError(f"burst sender in {src_ns} failed: {out.stderr.strip()[-300:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.kill()
        server.wait(timeout=10)


def bench_burst(fab: Fabric, mtu: int, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Per NIC kind (receive direction): the transfers' times and the extra bytes beyond the bucket."""
    out: dict[str, Any] = {"idle_s": IDLE_S, "repeats": REPEATS, "mtu": mtu, "kinds": {}}
    seen = set()
    for nic, direction, peer_ns, peer_ip, tc in link_cases(fab):
        if direction != "rx" or nic.kind in seen:
            continue
        seen.add(nic.kind)
        n = int(nic.rate_bps * TRANSFER_S / 8)
        progress(f"  {nic.kind:<10} rx: {REPEATS} transfers of {n} B after {IDLE_S:g} s idle ...")
        times = _timed_transfers(peer_ns, nic.ns, nic.ip, n, tc.tos_byte)
        extras = [extra_bytes(n, t, nic.rate_bps, mtu) for t in times]
        out["kinds"][nic.kind] = {
            "rate_bps": nic.rate_bps, "bytes": n, "bucket_bytes": burst_bytes(nic.rate_bps, mtu),
            "seconds": [round(t, 6) for t in times],
            "bucket_model_s": round(bucket_model_s(n, nic.rate_bps, mtu), 6),
            "extra_payload_bytes": [round(e) for e in extras],
            "median_extra_payload_bytes": round(statistics.median(extras)),
            "mean_extra_payload_bytes": round(statistics.fmean(extras))}
        k = out["kinds"][nic.kind]
        progress(f"    mean {statistics.fmean(times) * 1e3:.1f} ms against {k['bucket_model_s'] * 1e3:.1f} ms with "
                 f"the bucket alone: {k['mean_extra_payload_bytes']} B beyond it")
    return out


def burst_lines(res: dict[str, Any]) -> list[str]:
    """The report: per NIC kind, the transfers against the bucket model and the extra bytes."""
    lines = [f"idle {res['idle_s']:g} s before each of {res['repeats']} transfers; MTU {res['mtu']}"]
    for kind, k in res["kinds"].items():
        ms = ", ".join(f"{t * 1e3:.1f}" for t in k["seconds"])
        lines.append(f"{kind:<10} {k['rate_bps'] / 1e6:g} Mbit/s, bucket {k['bucket_bytes']} B: {k['bytes']} B took "
                     f"{ms} ms (bucket model {k['bucket_model_s'] * 1e3:.1f} ms); beyond the bucket: mean "
                     f"{k['mean_extra_payload_bytes']} B of payload (median {k['median_extra_payload_bytes']})")
    return lines
