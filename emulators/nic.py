"""Emulated NICs: HTB shaping and the two QoS classes, as real tc commands.

Each emulated NIC is one end of a veth pair. Shaping egress on both ends of
the pair shapes both directions: the namespace end's egress is what the node
sends, the bridge end's egress is what it receives. No IFB is needed.

On compute NICs (CNICs) HTB has two classes that stand in for InfiniBand
virtual lanes (DESIGN.md section 4): model (EF, prio 0, 240/255 of the link
guaranteed) and kv (AF11, prio 1, 15/255 guaranteed), both may borrow up to
the full link. u32 filters classify by the DS field; unmarked traffic goes to
the model class. With QoS off there is one FIFO class.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dualpath.traffic_classes import KV, MODEL, TrafficClass

ROOT_CLASS = "1:1"
# Leaf class ids by traffic class; the single FIFO class when QoS is off.
CLASS_IDS = {MODEL.name: "1:10", KV.name: "1:20"}
FIFO_CLASS = "1:10"


@dataclass(frozen=True)
class NicShape:
    """How one veth end is shaped."""

    dev: str
    rate_bps: int
    classes: bool  # two DSCP classes (CNIC with QoS on) or one FIFO class
    mtu: int = 1500


def burst_bytes(rate_bps: int, mtu: int) -> int:
    """HTB's bucket (burst and cburst) for a class shaped at `rate_bps`, wire bytes."""
    # Veths hand HTB GSO segments of up to 64 KiB; a bucket smaller than one
    # segment makes HTB undershoot its rate. 1 ms of line rate, at least 64 KiB.
    return max(rate_bps // 8 // 1000, 64 * 1024 + mtu)


QUEUE_BYTES = 16 << 20


def _queue_bytes(rate_bps: int) -> int:
    # The fabrics DualPath runs on are lossless (InfiniBand credits). TCP in
    # flight is bounded by its socket buffers (a few MiB per flow) and BBR keeps
    # standing queues short, so a deep queue emulates "no drops": a drop here
    # would be a TCP retransmission the real fabric never makes, counted on the
    # sender's NIC. Loss under overload is still shown by traffic that does not
    # back off (the UDP flood of `dualpath check`).
    return QUEUE_BYTES


def unshape_batch(dev: str) -> str:
    """Remove a device's shaping (HTB cannot switch between one and two classes in place)."""
    return f"qdisc del dev {dev} root\n"


def htb_batch(shape: NicShape) -> str:
    """The `tc -batch` script that shapes one (unshaped) device."""
    d, r = shape.dev, shape.rate_bps
    burst = burst_bytes(r, shape.mtu)
    queue = _queue_bytes(r)
    lines = [
        f"qdisc add dev {d} root handle 1: htb default {FIFO_CLASS.split(':')[1]} r2q 100",
        f"class replace dev {d} parent 1: classid {ROOT_CLASS} htb rate {r}bit ceil {r}bit "
        f"burst {burst}b cburst {burst}b",
    ]
    if shape.classes:
        for tc in (MODEL, KV):
            lines += _leaf(d, CLASS_IDS[tc.name], _class_rate(r, tc), r, tc.htb_prio, burst, queue)
        # Match the DS field (top six bits of the TOS byte).
        for tc in (MODEL, KV):
            lines.append(
                f"filter replace dev {d} parent 1: protocol ip prio {10 + tc.htb_prio} "
                f"u32 match ip dsfield {tc.tos_byte:#04x} 0xfc flowid {CLASS_IDS[tc.name]}"
            )
    else:
        lines += _leaf(d, FIFO_CLASS, r, r, 0, burst, queue)
    return "\n".join(lines) + "\n"


def _class_rate(link_bps: int, tc: TrafficClass) -> int:
    total = MODEL.weight + KV.weight
    return max(link_bps * tc.weight // total, 8000)


def _leaf(dev: str, classid: str, rate: int, ceil: int, prio: int, burst: int, queue: int) -> list[str]:
    handle = classid.split(":")[1]
    return [
        f"class replace dev {dev} parent {ROOT_CLASS} classid {classid} htb rate {rate}bit "
        f"ceil {ceil}bit prio {prio} burst {burst}b cburst {burst}b",
        f"qdisc replace dev {dev} parent {classid} handle {handle}: bfifo limit {queue}",
    ]


def class_for(classes: bool, tc: TrafficClass) -> str:
    """The HTB class id that carries traffic class `tc` on a shaped device."""
    return CLASS_IDS[tc.name] if classes else FIFO_CLASS


_CLASS_RE = re.compile(r"^class htb (\S+) .*?\n Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", re.M | re.S)


def parse_class_stats(text: str) -> dict[str, int]:
    """Bytes sent per HTB class id, from `tc -s class show` (its -j omits HTB stats)."""
    return {m.group(1): int(m.group(2)) for m in _CLASS_RE.finditer(text)}


def parse_class_drops(text: str) -> dict[str, int]:
    """Packets dropped per HTB class id."""
    return {m.group(1): int(m.group(4)) for m in _CLASS_RE.finditer(text)}


def parse_class_packets(text: str) -> dict[str, int]:
    """Packets (segments: HTB counts a GSO bundle as its segments) sent per HTB class id."""
    return {m.group(1): int(m.group(3)) for m in _CLASS_RE.finditer(text)}
