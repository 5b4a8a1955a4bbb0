"""RDMA (Soft-RoCE, rdma_rxe) for the transport: is it usable, which device, and did it carry the bytes.

Asking UCX for `rc_verbs` is configuration, not proof. Measured in the Soft-RoCE VM
(../shared/notes/softroce-vm): NIXL's wheel bundles its own libibverbs (rdma-core 48), which
cannot load the system's rxe provider; with `UCX_TLS=rc_verbs,tcp` UCX then moves every byte
over TCP, silently: the data is correct, and the rxe device's `sent_pkts` stays 0. Only a
process started with the system libibverbs preloaded uses the rxe device.

So this module does two things:

- `problems()`: every reason, known before NIXL starts, why RDMA cannot be used here (no RDMA
  device, none on the agent's interface, the system libibverbs not preloaded). A transport
  agent asked for RDMA raises RdmaUnavailableError naming them, and never falls back to TCP.
- `read_counters()` and `prove()`: the rxe devices' own `hw_counters`, before and after, against
  the KV bytes each device must have sent. If they are not there, RDMA did not carry them.

A device's name must fit UCX: UCX keeps an RDMA device's name in a 16-byte memory-domain name
(UCT_MD_NAME_MAX, NUL included). A longer name is cut, `UCX_NET_DEVICES=<name>:1` then matches no
device, and UCX runs on the TCP device listed beside it, again silently: measured in the VM with
dpt-p0e0-cnic-rxe (17 characters), UCX warned "network device ... is not available" and listed only
the 13-character devices; rxe sent 0 packets. So the testbed names each device after its
namespace (`rxe_device_name`) and refuses a name UCX would cut.

RoCEv2 on the wire (what byte accounting subtracts per packet): Ethernet 14 + IPv4 20 + UDP 8
(port 4791) + BTH 12 + ICRC 4 = 58 bytes; a WRITE's first packet adds a RETH (16), a READ
response's first and last an AETH (4); an ACK is those 58 + AETH 4 with no payload.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

SYSTEM_LIBIBVERBS = "/usr/lib/x86_64-linux-gnu/libibverbs.so.1"
SYSFS = Path("/sys/class/infiniband")
ROCE_UDP_PORT = 4791
# Per RoCEv2 packet: Ethernet, IPv4, UDP, BTH, ICRC (as HTB counts a frame: no FCS).
ROCE_HEADER_BYTES = 14 + 20 + 8 + 12 + 4
# rxe's own per-packet allowance when it derives its MTU from the netdev's (eth_mtu_int_to_enum):
# GRH 40 + UDP 8 + BTH 12 + XRC ext 4 + atomic ext 28 + ICRC 4.
_RXE_MTU_ALLOWANCE = 40 + 8 + 12 + 4 + 28 + 4
# A device proves it carried its KV when its kv-class packets are RoCE at least this often
# (the rest: UCX's TCP wire-up) and it sent at least as many packets as the bytes need.
MIN_ROCE_SHARE = 0.95
# UCX's UCT_MD_NAME_MAX is 16 bytes with the terminating NUL: longer device names are cut.
UCX_DEVICE_NAME_MAX = 15
# Only for showing that the counters catch the silent fallback (scripts/vm/rxe-smoke.sh's
# negative control): lets an agent start without the preload. The proof then fails the run.
ALLOW_UNPRELOADED = "DPT_RDMA_ALLOW_UNPRELOADED"
# A device that had fewer KV bytes than this to send proves nothing either way.
MIN_PROOF_BYTES = 64 << 10


def preloaded_libibverbs(environ: Mapping[str, str] | None = None, maps: str | None = None) -> bool:
    """Whether this process runs with the system libibverbs preloaded (LD_PRELOAD names it,
    and it is mapped), so UCX's ib module resolves ibv_* in it rather than in NIXL's bundled
    copy."""
    env = os.environ if environ is None else environ
    want = os.path.realpath(SYSTEM_LIBIBVERBS)
    named = any(p and os.path.realpath(p) == want
                for p in env.get("LD_PRELOAD", "").replace(":", " ").split())
    if not named:
        return False
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return named
    return want in maps


def preload_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """`env` (default os.environ) with the system libibverbs first in LD_PRELOAD: for a child
    process that will run an RDMA transport agent."""
    out = dict(os.environ if env is None else env)
    rest = [p for p in out.get("LD_PRELOAD", "").replace(":", " ").split()
            if os.path.realpath(p) != os.path.realpath(SYSTEM_LIBIBVERBS)]
    out["LD_PRELOAD"] = " ".join([SYSTEM_LIBIBVERBS, *rest])
    return out


def rxe_device_name(namespace: str) -> str:
    """The rxe device of a namespace's one RDMA NIC (an engine's CNIC, a node's host port):
    `<namespace>-rxe`, e.g. dpt-p0e0-rxe. Raises ValueError where UCX would cut it."""
    name = f"{namespace}-rxe"
    check_device_name(name)
    return name


def check_device_name(name: str) -> None:
    """ValueError unless UCX can address `name` whole (UCX_DEVICE_NAME_MAX)."""
    if len(name) > UCX_DEVICE_NAME_MAX:
        raise ValueError(
            f"RDMA device name {name!r} has {len(name)} characters: UCX keeps at most "
            f"{UCX_DEVICE_NAME_MAX} (UCT_MD_NAME_MAX), would not find it under UCX_NET_DEVICES and "
            f"would silently move every byte over TCP; use a shorter name")


def pinned_memory_problem(pinned_bytes: int, meminfo: str | None = None) -> str | None:
    """Why `pinned_bytes` of registered buffers cannot all be pinned here, else None.

    Over TCP, registering a buffer pins nothing and its pages are touched only as used; an RDMA
    device pins (and faults in) every registered byte at once. Measured in the 6 GiB VM: two
    host agents' 4 GiB DRAM buffers failed in ibv_reg_mr ("ucp_mem_map: Input/output error")."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return None
    avail = next((int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")), None)
    if avail is None or pinned_bytes <= 0.8 * avail:
        return None
    return (f"transport 'rdma' pins every registered buffer, {pinned_bytes / 2**30:.2f} GiB here (the nodes' "
            f"DRAM buffers and the engines' HBM), but only {avail / 2**30:.2f} GiB of memory is available "
            f"(at most 80 % of it may be pinned); lower dram_buffer_gib and hbm_gib_per_engine in the topology")


def devices(sysfs: Path = SYSFS) -> list[str]:
    """RDMA devices the kernel exposes ([] when none)."""
    try:
        return sorted(p.name for p in sysfs.iterdir())
    except OSError:
        return []


def device_for(iface: str, names: list[str] | None = None) -> str | None:
    """The RDMA device whose netdev is `iface` in this network namespace (rdma link shows a
    port's netdev only to its own namespace), else None."""
    try:
        out = subprocess.run(["rdma", "-j", "link", "show"], capture_output=True, text=True, timeout=10)
        links = json.loads(out.stdout or "[]") if out.returncode == 0 else []
    except (OSError, ValueError, subprocess.TimeoutExpired):
        links = []
    for link in links:
        if link.get("netdev") == iface and (names is None or link.get("ifname") in names):
            return link.get("ifname")
    return None


def problems(iface: str | None = None, device: str | None = None, *,
             environ: Mapping[str, str] | None = None, sysfs: Path = SYSFS) -> tuple[str | None, list[str]]:
    """(the device to use, every reason RDMA cannot be used). An empty list: usable."""
    why: list[str] = []
    devs = devices(sysfs)
    chosen = None
    if not devs:
        why.append("this kernel has no RDMA device (/sys/class/infiniband is empty or missing: no "
                    "rdma_rxe or siw; on this machine kind use the Soft-RoCE VM, scripts/vm.sh)")
    elif device is not None:
        if device not in devs:
            why.append(f"RDMA device {device!r} not found; have {devs}")
        else:
            chosen = device
    elif iface is not None:
        chosen = device_for(iface, devs)
        if chosen is None:
            why.append(f"no RDMA device on interface {iface!r} in this network namespace (have {devs}); "
                       f"the fabric gives each namespace one with --transport rdma")
    else:
        chosen = devs[0]
    env = os.environ if environ is None else environ
    if not preloaded_libibverbs(env) and env.get(ALLOW_UNPRELOADED) != "1":
        why.append(f"the system libibverbs is not preloaded: NIXL's wheel bundles its own "
                   f"(rdma-core 48), which cannot load this system's rxe provider, so UCX would "
                   f"silently move every byte over TCP; start the process with "
                   f"LD_PRELOAD={SYSTEM_LIBIBVERBS} (the testbed does this for --transport rdma)")
    return chosen, why


# ---- proof by counters ---------------------------------------------------------------------
Counters = dict[str, dict[str, int]]  # device -> hw counter -> value


def read_counters(sysfs: Path = SYSFS, port: int = 1) -> Counters:
    """Every RDMA device's port `port` hw_counters (sent_pkts, rcvd_pkts, retransmits...)."""
    out: Counters = {}
    for dev in devices(sysfs):
        d = sysfs / dev / "ports" / str(port) / "hw_counters"
        vals: dict[str, int] = {}
        try:
            for f in d.iterdir():
                try:
                    vals[f.name] = int(f.read_text().split()[0])
                except (OSError, ValueError, IndexError):
                    pass
        except OSError:
            continue
        out[dev] = vals
    return out


def counters_delta(after: Counters, before: Counters) -> Counters:
    return {dev: {k: v - before.get(dev, {}).get(k, 0) for k, v in c.items()} for dev, c in after.items()}


def rxe_mtu(netdev_mtu: int) -> int:
    """The RDMA MTU rxe gives a port on a netdev of this MTU (the largest IB MTU that fits)."""
    for m in (4096, 2048, 1024, 512, 256):
        if m <= netdev_mtu - _RXE_MTU_ALLOWANCE:
            return m
    return 256


@dataclass
class DeviceProof:
    device: str
    kv_bytes_sent: int  # what the path definitions (or the benchmark) say this device sent
    sent_pkts: int
    rcvd_pkts: int
    min_pkts: int  # the fewest RoCE packets that can carry kv_bytes_sent at the RDMA MTU
    kv_class_pkts: int | None = None  # packets in the NIC's kv HTB class (None: not shaped)
    roce_share: float | None = None
    proven: bool = False
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# rxe's hw_counters that say RC re-sent packets: the requester's retries (by ack timeout or on a
# NAK), the NAKs it got, and what the responders saw twice or out of order. rxe counts events,
# not bytes, so re-sent bytes cannot be taken off the NIC counts the way TCP's are; the report
# shows these beside the NIC bytes instead.
RETRY_COUNTERS = ("completer_retry_err", "rcvd_seq_err", "duplicate_request", "out_of_seq_request")


def prove(delta: Counters, kv_bytes_sent: Mapping[str, int], rdma_mtu: int | Mapping[str, int],
          kv_class_pkts: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Did RDMA carry the KV bytes? Per device: the KV bytes it had to send, against its
    `sent_pkts` (at least bytes / RDMA MTU), and, where HTB counts the NIC's kv class, the
    share of those packets that are RoCE. `rdma_proven` needs every device with at least
    MIN_PROOF_BYTES to send to pass, and at least one such device."""
    devs = []
    for dev, nbytes in sorted(kv_bytes_sent.items()):
        c = delta.get(dev, {})
        mtu = rdma_mtu if isinstance(rdma_mtu, int) else rdma_mtu.get(dev, 4096)
        p = DeviceProof(dev, int(nbytes), int(c.get("sent_pkts", 0)), int(c.get("rcvd_pkts", 0)),
                        -(-int(nbytes) // mtu))
        if kv_class_pkts is not None and dev in kv_class_pkts:
            p.kv_class_pkts = int(kv_class_pkts[dev])
            p.roce_share = round(min(p.sent_pkts, p.kv_class_pkts) / p.kv_class_pkts, 4) if p.kv_class_pkts else None
        if dev not in delta:
            p.why = "no hw_counters read for this device (no such device, or unreadable here)"
        elif nbytes < MIN_PROOF_BYTES:
            p.proven, p.why = True, f"under {MIN_PROOF_BYTES} KV bytes to send: nothing to prove"
        elif p.sent_pkts < p.min_pkts:
            p.why = (f"sent {p.sent_pkts} RoCE packets, fewer than the {p.min_pkts} that {nbytes} "
                     f"bytes need at RDMA MTU {mtu}")
        elif p.roce_share is not None and p.roce_share < MIN_ROCE_SHARE:
            p.why = (f"only {p.roce_share:.0%} of the NIC's {p.kv_class_pkts} kv-class packets were "
                     f"RoCE: the rest (KV over TCP) did not cross RDMA")
        else:
            p.proven = True
        devs.append(p)
    relevant = [p for p in devs if p.kv_bytes_sent >= MIN_PROOF_BYTES]
    total = {k: sum(c.get(k, 0) for c in delta.values()) for k in ("sent_pkts", "rcvd_pkts", *RETRY_COUNTERS)}
    return {"rdma_proven": bool(relevant) and all(p.proven for p in devs),
            "rxe_sent_pkts": total["sent_pkts"], "rxe_rcvd_pkts": total["rcvd_pkts"],
            "retries": {k: total[k] for k in RETRY_COUNTERS},
            "kv_bytes": sum(p.kv_bytes_sent for p in devs),
            "devices": [p.to_dict() for p in devs],
            "counters_delta": {d: {k: v for k, v in c.items() if v} for d, c in delta.items()}}


def not_proven_message(proof: Mapping[str, Any], what: str = "the run") -> str:
    """One paragraph: RDMA was asked for, and these counters say it did not carry the bytes."""
    bad = [d for d in proof["devices"] if not d["proven"]]
    if not bad and not [d for d in proof["devices"] if d["kv_bytes_sent"] >= MIN_PROOF_BYTES]:
        detail = "no device had KV bytes to send, so nothing was proven"
    else:
        detail = "; ".join(f"{d['device']}: {d['why']}" for d in bad)
    return (f"{what} asked for RDMA, but the rxe devices' hw_counters show the KV bytes did not "
            f"cross RDMA ({detail}; rxe sent_pkts +{proof['rxe_sent_pkts']} in all). UCX fell back "
            f"to TCP: is the system libibverbs preloaded ({SYSTEM_LIBIBVERBS}), and does UCX_TLS "
            f"select rc_verbs?")


def ipv4_gid_index(device: str, port: int = 1, sysfs: Path = SYSFS) -> int:
    """The GID index of the device's IPv4 RoCEv2 address (::ffff:a.b.c.d). Its packets are
    IPv4, so HTB's u32 filters see their DS field; the IPv6 link-local GID 0 would not be."""
    base = sysfs / device / "ports" / str(port)
    for i in range(256):
        try:
            gid = (base / "gids" / str(i)).read_text().strip()
        except OSError:
            break
        try:
            kind = (base / "gid_attrs" / "types" / str(i)).read_text().strip()
        except OSError:
            kind = ""
        if gid.startswith("0000:0000:0000:0000:0000:ffff:") and "v2" in kind.lower():
            return i
    raise RuntimeError(f"RDMA device {device!r} has no IPv4 RoCEv2 GID (is its netdev's IPv4 address set?)")
