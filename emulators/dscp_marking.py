"""DSCP marking by port with nftables, for flows that cannot set IP TOS, and counters per class.

NIXL/UCX on TCP cannot mark packets, so kv-class agents listen in the kv port range and this table
marks that range AF11 in each namespace. Matching both source and destination port covers READ
responses, which leave from the target's listening port.

The same table counts what each namespace sends per class, by the DS field as it leaves (after
marking): `model_tx` counts EF (sockets that set IP_TOS to the model class themselves: the
collectives), `kv_tx` AF11. These counters see every packet whatever HTB does, so they name the
class of every byte also when `qos: off` collapses HTB into one FIFO. Unmarked traffic (control)
is in neither: HTB's default puts it in the model class, and HTB's class counters show that.
"""
from __future__ import annotations

import json

from dualpath.naming import PREFIX
from dualpath.traffic_classes import KV, KV_PORT_RANGE, MODEL

TABLE = f"{PREFIX}_qos"
COUNTERS = {MODEL.name: "model_tx", KV.name: "kv_tx"}  # traffic class -> named counter


def nft_script(port_range: tuple[int, int] = KV_PORT_RANGE) -> str:
    lo, hi = port_range
    dscp = KV.dscp
    return (
        f"table ip {TABLE} {{\n"
        + "".join(f"  counter {c} {{ }}\n" for c in COUNTERS.values())
        + f"  chain mark_out {{\n"
        f"    type filter hook output priority mangle; policy accept;\n"
        f"    tcp dport {lo}-{hi} ip dscp set {dscp}\n"
        f"    tcp sport {lo}-{hi} ip dscp set {dscp}\n"
        f"  }}\n"
        f"  chain count_out {{\n"
        f"    type filter hook postrouting priority 0; policy accept;\n"
        f"    ip dscp {MODEL.dscp} counter name \"{COUNTERS[MODEL.name]}\"\n"
        f"    ip dscp {KV.dscp} counter name \"{COUNTERS[KV.name]}\"\n"
        f"  }}\n"
        f"}}\n"
    )


def parse_counters(text: str) -> dict[str, tuple[int, int]]:
    """(bytes, packets) per traffic class from `nft -j list counters table ip <TABLE>`."""
    names = {v: k for k, v in COUNTERS.items()}
    out = {k: (0, 0) for k in COUNTERS}
    for item in json.loads(text).get("nftables", []):
        c = item.get("counter")
        if c and c.get("table") == TABLE and c.get("name") in names:
            out[names[c["name"]]] = (int(c["bytes"]), int(c["packets"]))
    return out
