"""DSCP marking by port with nftables, for flows that cannot set IP TOS, and counters per class.

NIXL/UCX on TCP cannot mark packets, so kv-class agents listen in the kv port range and this table
marks that range AF11 in each namespace. Matching both source and destination port covers READ
responses, which leave from the target's listening port.

A user's program run in a class (`dualpath exec NODE --class kv|model`) has that class's group
(dualpath.traffic_classes.CLASS_GIDS): rules per class (`class_rules_script`, added to a namespace
the first time it runs one) mark whatever its connections send, by group.

Port-based marking is only right between namespaces that reserve the kv range from ephemeral
ports (the fabric's node namespaces do). The root namespace does not: the conductor's scheduler
service listens on an OS-chosen port and its RPC clients connect from ephemeral ones, so now and
then one of its ports is in the kv range, and a node's packets to it would be marked AF11: the
engine group leaders' CNICs then carry their scheduler traffic in the kv class, over their path
definitions. So the rules skip packets to `unreserved` addresses: the conductor carries no KV.

The same table counts what each namespace sends per class, by the DS field as it leaves (after
marking): `model_tx` counts EF (sockets that set IP_TOS to the model class themselves: the
collectives), `kv_tx` AF11. These counters see every packet whatever HTB does, so they name the
class of every byte also when `qos: off` collapses HTB into one FIFO. Unmarked traffic (control)
is in neither: HTB's default puts it in the model class, and HTB's class counters show that.
`model_rx` and `kv_rx` count what arrives, at prerouting: after every qdisc on the way, before
any socket. A flow's packets sent in one namespace against those received in its peer are then
what the emulated NICs lost, without what a starved receiver's socket buffer dropped.
"""
from __future__ import annotations

import json
from typing import Sequence

from dualpath.naming import PREFIX
from dualpath.traffic_classes import CLASS_GIDS, KV, KV_PORT_RANGE, MODEL, by_name

TABLE = f"{PREFIX}_qos"
COUNTERS = {MODEL.name: "model_tx", KV.name: "kv_tx"}  # traffic class -> named counter, sent
RX_COUNTERS = {MODEL.name: "model_rx", KV.name: "kv_rx"}  # the same, received


def nft_script(port_range: tuple[int, int] = KV_PORT_RANGE, unreserved: Sequence[str] = ()) -> str:
    """The table for one namespace. `unreserved`: addresses of peers whose ports in the range
    say nothing (they do not reserve it); their packets are left unmarked."""
    lo, hi = port_range
    dscp = KV.dscp
    skip = ""
    if unreserved:
        skip = f"ip daddr != {{ {', '.join(unreserved)} }} "  # the output hook: saddr is our own
    return (
        f"table ip {TABLE} {{\n"
        + "".join(f"  counter {c} {{ }}\n" for c in (*COUNTERS.values(), *RX_COUNTERS.values()))
        + f"  chain mark_out {{\n"
        f"    type filter hook output priority mangle; policy accept;\n"
        f"    {skip}tcp dport {lo}-{hi} ip dscp set {dscp}\n"
        f"    {skip}tcp sport {lo}-{hi} ip dscp set {dscp}\n"
        f"  }}\n"
        f"  chain count_out {{\n"
        f"    type filter hook postrouting priority 0; policy accept;\n"
        f"    ip dscp {MODEL.dscp} counter name \"{COUNTERS[MODEL.name]}\"\n"
        f"    ip dscp {KV.dscp} counter name \"{COUNTERS[KV.name]}\"\n"
        f"  }}\n"
        f"  chain count_in {{\n"
        f"    type filter hook prerouting priority 0; policy accept;\n"
        f"    ip dscp {MODEL.dscp} counter name \"{RX_COUNTERS[MODEL.name]}\"\n"
        f"    ip dscp {KV.dscp} counter name \"{RX_COUNTERS[KV.name]}\"\n"
        f"  }}\n"
        f"}}\n"
    )


def class_rules_script() -> str:
    """Rules appended to a namespace's mark_out chain the first time a program runs there in a
    class (`dualpath exec --class`): its group marks each connection it opens (conntrack), and
    the connection every packet, after the port rules; bytes a socket still sends after its
    program closed it have no owner whose group could be read. Added on demand, not at bring-up:
    conntrack in every namespace made a 1p1d run of every mode 39 % slower (76 s against 55 s)."""
    return ("".join(f"add rule ip {TABLE} mark_out meta skgid {gid} ct mark set {gid}\n" for gid in CLASS_GIDS.values())
            + "".join(f"add rule ip {TABLE} mark_out ct mark {gid} ip dscp set {by_name(c).dscp}\n"
                      for c, gid in CLASS_GIDS.items()))


def has_class_rules(chain_listing: str) -> bool:
    """Whether `nft list chain ip TABLE mark_out` already holds class_rules_script's rules."""
    return all(f"skgid {gid}" in chain_listing for gid in CLASS_GIDS.values())


def parse_counters(text: str, received: bool = False) -> dict[str, tuple[int, int]]:
    """(bytes, packets) per traffic class, sent (or `received`), from
    `nft -j list counters table ip <TABLE>`."""
    counters = RX_COUNTERS if received else COUNTERS
    names = {v: k for k, v in counters.items()}
    out = {k: (0, 0) for k in counters}
    for item in json.loads(text).get("nftables", []):
        c = item.get("counter")
        if c and c.get("table") == TABLE and c.get("name") in names:
            out[names[c["name"]]] = (int(c["bytes"]), int(c["packets"]))
    return out
