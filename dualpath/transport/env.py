"""The UCX environment a transport agent needs, built and checked before NIXL starts.

Why each setting is mandatory (notes/platform-facts.md, NIXL section):

- ``UCX_TLS=tcp``: with the default transports (or ``sm``/``cma``/``posix``) UCX sees two
  namespaces of one machine as one node and moves bulk data through shared memory,
  bypassing the veth: the emulated NIC would carry nothing.
- ``UCX_NET_DEVICES=<iface>``: otherwise UCX spreads over every interface it sees.
- ``UCX_MODULES=^ib``: otherwise every process segfaults at exit (bundled libnl in _dl_fini).
- ``UCX_TCP_PORT_RANGE``: neither NIXL nor UCX can set IP TOS on TCP, so a kv-class agent
  listens inside ``KV_PORT_RANGE`` and nftables marks that range AF11 by port. A model-class
  agent must listen outside it. This is why a traffic class belongs to an agent (a UCX
  context), and why a class chosen per transfer needs one agent per class (multiclass.py).

A setting already present in the process environment that contradicts these is an error,
never silently overridden: whoever set it expected it to take effect.
"""
from __future__ import annotations

import os
from pathlib import Path

from dualpath.traffic_classes import KV, KV_PORT_RANGE, MODEL, by_name

# Listening ports of model-class transport agents: outside KV_PORT_RANGE so nftables never
# marks them AF11. (The model class is the default on a CNIC; see traffic_classes.)
MODEL_PORT_RANGE = (43000, 43999)

TRANSPORTS = ("tcp", "rdma")

# UCX transports that move bytes without touching a network interface.
_BYPASS_TLS = {"sm", "shm", "mm", "cma", "posix", "sysv", "xpmem", "knem", "all",
               "cuda_ipc", "rocm_ipc", "cuda_copy", "rocm_copy"}

# Keys this module owns. Tuning keys (UCX_TCP_SNDBUF, ...) are passed through unchecked.
MANAGED_KEYS = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_MODULES", "UCX_TCP_PORT_RANGE",
                "UCX_IB_TRAFFIC_CLASS")

# The RC transport's ack timeout on rxe (UCX's default is 1 s: IB exponent 18, 1.07 s). rxe
# acknowledges from kernel work items that compete with the engines for the CPU, so on a starved
# host (the VM under TCG ran both cores at 99 %) an ACK can come later than 1 s: the requester then
# re-sends everything unacknowledged although it arrived. That is what the s25-vm run measured:
# completer_retry_err 10 with rcvd_seq_err 2 on one device (retries by timeout, not by loss), and
# the responders counting 199 duplicate requests; NIC bytes came out 2.1-8.4 % over the paths.
# Measured since (s26-vm, s26b-vm): with 30 s the re-sends remain (5-15 retries per mode, few
# NAKs) and follow losses (3-9 out-of-order requests per mode) that neither HTB nor the receive
# backlog counts, so this removes spurious timeouts but does not settle the NIC bytes.
# A lost packet is still re-sent at once on the NAK that the next packet draws; only a lost tail
# waits for this timer, and a dead peer is still caught by the transfers' own timeout
# (agent.DEFAULT_TIMEOUT_S). 30 s is IB exponent 23 (34 s). A user's own UCX_RC_TIMEOUT wins.
RC_TIMEOUT = "30s"


class TransportError(RuntimeError):
    """Base class of every transport error."""


class UcxEnvError(TransportError):
    """The process environment contradicts the UCX settings the testbed needs."""


class RdmaUnavailableError(TransportError):
    """RDMA was asked for but cannot be used: no device, or the system libibverbs is not
    preloaded (never falls back to TCP)."""


class RdmaNotProvenError(TransportError):
    """RDMA was asked for, but the rxe devices' counters show the KV bytes did not cross it."""


def parse_port_range(text: str) -> tuple[int, int]:
    text = text.strip()
    if "-" in text:
        lo, hi = text.split("-", 1)
        first, last = int(lo), int(hi)
    else:
        first = last = int(text)
    if not (0 <= first <= last <= 65535):
        raise ValueError(f"bad port range {text!r}")
    return first, last


def class_port_range(traffic_class: str) -> tuple[int, int]:
    tc = by_name(traffic_class)
    return KV_PORT_RANGE if tc is KV else MODEL_PORT_RANGE


def _overlaps(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _check_port_range(rng: tuple[int, int], traffic_class: str, source: str) -> None:
    tc = by_name(traffic_class)
    if rng == (0, 0):
        raise UcxEnvError(
            f"{source}: UCX_TCP_PORT_RANGE=0 lets the kernel pick the listening port, so nftables "
            f"cannot mark the {tc.name} class by port; use a range inside {class_port_range(tc.name)}")
    if tc is KV:
        if not (KV_PORT_RANGE[0] <= rng[0] and rng[1] <= KV_PORT_RANGE[1]):
            raise UcxEnvError(
                f"{source}: UCX_TCP_PORT_RANGE={rng[0]}-{rng[1]} is not inside the kv port range "
                f"{KV_PORT_RANGE[0]}-{KV_PORT_RANGE[1]}: nftables would not mark this agent's "
                f"traffic AF11 (DSCP {KV.dscp})")
    elif _overlaps(rng, KV_PORT_RANGE):
        raise UcxEnvError(
            f"{source}: UCX_TCP_PORT_RANGE={rng[0]}-{rng[1]} overlaps the kv port range "
            f"{KV_PORT_RANGE[0]}-{KV_PORT_RANGE[1]}: {MODEL.name}-class traffic would be marked AF11")


def check_tls(value: str, transport: str, source: str = "process environment") -> None:
    """Raise UcxEnvError unless UCX_TLS keeps bulk bytes on the network."""
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if not tokens or value.strip().startswith("^"):
        raise UcxEnvError(
            f"{source}: UCX_TLS={value!r} lets UCX choose shared memory (sm/cma) between two "
            f"namespaces of one machine, so bytes would bypass the emulated NICs; use UCX_TLS=tcp")
    bad = sorted({t.lstrip("\\") for t in tokens} & _BYPASS_TLS)
    if bad:
        raise UcxEnvError(
            f"{source}: UCX_TLS={value!r} contains {','.join(bad)}: UCX would move bulk data "
            f"through shared memory between the two namespaces and bypass the emulated NICs; "
            f"use UCX_TLS=tcp")
    if transport == "tcp":
        extra = sorted(set(tokens) - {"tcp", "self"})
        if "tcp" not in tokens or extra:
            raise UcxEnvError(
                f"{source}: UCX_TLS={value!r} does not select the TCP transport alone "
                f"(found {','.join(extra) or 'no tcp'}); the tcp data plane needs UCX_TLS=tcp")


def build_ucx_env(iface: str, traffic_class: str = "kv", transport: str = "tcp", *,
                  port_range: tuple[int, int] | None = None,
                  rdma_device: str | None = None,
                  base: dict[str, str] | None = None,
                  tuning: dict[str, str] | None = None) -> dict[str, str]:
    """Return the UCX_* variables an agent needs, after checking `base` does not contradict them.

    `base` is the environment to check (default: os.environ). `tuning` adds performance knobs
    (UCX_TCP_SNDBUF, ...); it may not touch the managed keys.
    """
    if transport not in TRANSPORTS:
        raise TransportError(f"unknown transport {transport!r}; expected one of {TRANSPORTS}")
    if not iface:
        raise TransportError("a network interface is required (UCX_NET_DEVICES)")
    tc = by_name(traffic_class)
    base = dict(os.environ if base is None else base)
    src = "process environment"
    want_range = port_range or class_port_range(tc.name)
    _check_port_range(want_range, tc.name, "requested port range")

    env: dict[str, str] = {}
    if transport == "tcp":
        if "UCX_TLS" in base:
            check_tls(base["UCX_TLS"], "tcp", src)
        env["UCX_TLS"] = "tcp"
        if "UCX_NET_DEVICES" in base and base["UCX_NET_DEVICES"] != iface:
            raise UcxEnvError(
                f"{src}: UCX_NET_DEVICES={base['UCX_NET_DEVICES']!r} but this agent must use "
                f"{iface!r} only: otherwise UCX spreads over every interface it sees")
        env["UCX_NET_DEVICES"] = iface
        if "UCX_MODULES" in base:
            mods = base["UCX_MODULES"].strip()
            if not (mods.startswith("^") and "ib" in [m.strip() for m in mods[1:].split(",")]):
                raise UcxEnvError(
                    f"{src}: UCX_MODULES={mods!r} loads the ib module: the bundled libnl "
                    f"segfaults every process at exit; use UCX_MODULES=^ib on the tcp transport")
        env["UCX_MODULES"] = "^ib"
    else:
        # rdma: rc_verbs for the bytes, ud_verbs to wire it up (rc_verbs alone cannot connect), and
        # no tcp: with `rc_verbs,tcp` UCX 1.23 splits every PUT of 128 KiB or more 50/50 over the
        # rxe device and the veth's TCP (UCX_PROTO_INFO in the VM: "50% on rc_verbs/...-rxe:1 and
        # 50% on tcp/...-cnic"), so half of a large WRITE silently skipped RDMA.
        if not rdma_device:
            raise RdmaUnavailableError("rdma transport needs an RDMA device")
        from .rdma import check_device_name

        try:
            check_device_name(rdma_device)
        except ValueError as e:
            raise RdmaUnavailableError(str(e)) from None
        if "UCX_TLS" in base:
            check_tls(base["UCX_TLS"], "rdma", src)
        env["UCX_TLS"] = "rc_verbs,ud_verbs"
        env["UCX_NET_DEVICES"] = f"{rdma_device}:1"
        if "UCX_MODULES" in base and "ib" in base["UCX_MODULES"] and base["UCX_MODULES"].startswith("^"):
            raise UcxEnvError(f"{src}: UCX_MODULES={base['UCX_MODULES']!r} excludes ib; rdma needs it")
        env["UCX_IB_TRAFFIC_CLASS"] = str(tc.tos_byte)  # rxe copies it into the IPv4 TOS byte
        if "UCX_RC_TIMEOUT" not in base:
            env["UCX_RC_TIMEOUT"] = RC_TIMEOUT

    if "UCX_TCP_PORT_RANGE" in base:
        try:
            have = parse_port_range(base["UCX_TCP_PORT_RANGE"])
        except ValueError as e:
            raise UcxEnvError(f"{src}: {e}") from None
        _check_port_range(have, tc.name, src)
        if port_range is not None and have != tuple(port_range):
            raise UcxEnvError(
                f"{src}: UCX_TCP_PORT_RANGE={base['UCX_TCP_PORT_RANGE']} but {port_range[0]}-"
                f"{port_range[1]} was requested")
        want_range = have
    env["UCX_TCP_PORT_RANGE"] = f"{want_range[0]}-{want_range[1]}"

    for k, v in (tuning or {}).items():
        if not k.startswith("UCX_"):
            raise TransportError(f"tuning key {k!r} is not a UCX_ variable")
        if k in MANAGED_KEYS:
            raise TransportError(f"tuning may not override {k}: it is mandatory (see env.py)")
        env[k] = str(v)
    return env


def rdma_devices() -> list[str]:
    """RDMA devices the kernel exposes: /sys/class/infiniband, else pyverbs. [] when none."""
    from . import rdma

    devs = rdma.devices()
    if devs:
        return devs
    try:
        from pyverbs.device import get_device_list  # type: ignore
    except Exception:
        return []
    try:
        return sorted(d.name.decode() if isinstance(d.name, bytes) else str(d.name)
                      for d in get_device_list())
    except Exception:
        return []


def require_rdma(device: str | None = None, iface: str | None = None) -> str:
    """Return the RDMA device to use (the one on `iface`, if given) or raise
    RdmaUnavailableError naming every cause (rdma.problems). Never falls back to TCP."""
    from . import rdma

    chosen, why = rdma.problems(iface, device)
    if why or chosen is None:
        raise RdmaUnavailableError(
            "transport 'rdma' was requested but cannot be used here: " + "; ".join(why or ["no device"])
            + ". The testbed does not fall back to TCP: ask for transport='tcp' explicitly")
    return chosen
