"""`dualpath check --rdma`: what RDMA this kernel offers, via pyverbs."""
from __future__ import annotations

from typing import Any


def rdma_preflight() -> dict[str, Any]:
    """Devices with their ports' GID 0 and active MTU, or why there are none."""
    report: dict[str, Any] = {"devices": [], "available": False, "reason": ""}
    try:
        import pyverbs.device as d
        from pyverbs.enums import IBV_PORT_ACTIVE  # noqa: F401  (proves the bindings load)
    except ImportError as e:
        report["reason"] = f"pyverbs is not installed ({e}); run scripts/bootstrap.sh"
        return report
    try:
        devs = d.get_device_list()
    except Exception as e:  # pyverbs raises PyverbsRDMAError when the kernel has no RDMA
        report["reason"] = (f"the kernel offers no RDMA ({e}); no rdma_rxe or siw here, so the "
                            "data plane runs over TCP. Use the Vagrant VM for Soft-RoCE.")
        return report
    for dev in devs:
        name = dev.name.decode()
        entry: dict[str, Any] = {"name": name, "ports": []}
        try:
            with d.Context(name=name) as ctx:
                for port in range(1, ctx.query_device().phys_port_cnt + 1):
                    attr = ctx.query_port(port)
                    entry["ports"].append({"port": port, "state": int(attr.state),
                                           "active_mtu": 128 << int(attr.active_mtu),
                                           "gid0": str(ctx.query_gid(port, 0))})
        except Exception as e:
            entry["error"] = str(e)
        report["devices"].append(entry)
    report["available"] = bool(report["devices"])
    if not report["available"]:
        report["reason"] = "no RDMA devices (ibv_get_device_list is empty)"
    return report
