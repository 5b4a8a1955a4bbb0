"""DSCP marking by port with nftables, for flows that cannot set IP TOS.

NIXL/UCX on TCP cannot mark packets, so kv-class agents listen in the kv port
range and this table marks that range AF11 in each namespace. Matching both
source and destination port covers READ responses, which leave from the
target's listening port.
"""
from __future__ import annotations

from dualpath.naming import PREFIX
from dualpath.traffic_classes import KV, KV_PORT_RANGE

TABLE = f"{PREFIX}_qos"


def nft_script(port_range: tuple[int, int] = KV_PORT_RANGE) -> str:
    lo, hi = port_range
    dscp = KV.dscp
    return (
        f"table ip {TABLE} {{\n"
        f"  chain mark_out {{\n"
        f"    type filter hook output priority mangle; policy accept;\n"
        f"    tcp dport {lo}-{hi} ip dscp set {dscp}\n"
        f"    tcp sport {lo}-{hi} ip dscp set {dscp}\n"
        f"  }}\n"
        f"}}\n"
    )
