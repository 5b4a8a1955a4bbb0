"""Traffic classes: the testbed's stand-in for InfiniBand virtual lanes.

Two classes share every compute NIC (DESIGN.md section 4). Each is a DSCP code
point on the wire; HTB on every CNIC classifies by the DS field.

On the TCP transport neither NIXL nor UCX can set IP TOS, so a kv-class NIXL
agent listens in KV_PORT_RANGE (UCX_TCP_PORT_RANGE) and nftables in each
namespace marks that range AF11 by port, in both directions (sport or dport).
Sockets we own (control, collectives) set IP_TOS directly with `tos_byte`.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficClass:
    name: str
    dscp: int
    htb_prio: int  # 0 is served first
    weight: int  # share of the paper's 255-unit VL arbiter

    @property
    def tos_byte(self) -> int:
        """The IPv4 TOS byte carrying this class (DSCP in the top six bits)."""
        return self.dscp << 2


# Paper's arbiter: the high class may take about 240/255 of a busy link.
MODEL = TrafficClass(name="model", dscp=46, htb_prio=0, weight=240)  # EF
KV = TrafficClass(name="kv", dscp=10, htb_prio=1, weight=15)  # AF11
CLASSES = (MODEL, KV)

# Listening ports of kv-class transport agents; nftables marks them AF11. Below Linux's ephemeral
# range (32768-60999), so the kernel never hands them out as source ports, and so that Mooncake's
# transfer engine accepts them (it refuses a port range inside the ephemeral one and falls back to
# 15000-17000, unmarked). It was 42000-42999 until Mooncake came in.
KV_PORT_RANGE = (22000, 22999)

# A user's program in a class (`dualpath exec NODE --class C`): it runs with this group as its
# real and effective gid, and nftables in every node namespace marks each packet its sockets send
# with the class's DSCP (`meta skgid`), whatever its ports and whatever it is (iperf3, UCX, its own
# sockets). Numbers no Debian system group uses.
CLASS_GIDS = {"model": 42046, "kv": 42010}


def by_name(name: str) -> TrafficClass:
    for tc in CLASSES:
        if tc.name == name:
            return tc
    raise ValueError(f"unknown traffic class {name!r}; expected one of {[c.name for c in CLASSES]}")
