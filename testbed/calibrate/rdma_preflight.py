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


def rdma_check(fab, progress=print, fallback_control: bool = True) -> dict[str, Any]:
    """`dualpath check --rdma` on a fabric brought up with transport rdma: the preflight of the
    rxe devices the fabric made, then one byte-exact NIXL READ and WRITE check between two
    engines (p0e0, d0e0) over them, proven by their hw_counters, with the HTB class bytes the
    check put on the initiator's CNIC (RoCEv2 in the kv class: its DSCP reached HTB)."""
    from dualpath.traffic_classes import KV, MODEL
    from emulators.nic import class_for
    from testbed.calibrate.benches import _transport_pair
    from testbed.fabric.counters import class_bytes

    rep = rdma_preflight()
    rep["fabric_rxe"] = dict(fab.rxe)
    rep["rdma_mtu"] = fab.rdma_mtu()
    ini = fab.endpoint("p0e0").nic("cnic")
    progress("  NIXL READ/WRITE check over rxe between p0e0 and d0e0 ...")
    before = {c.name: class_bytes(ini.bridge_dev).get(class_for(True, c), 0) for c in (KV, MODEL)}
    res = _transport_pair(fab, ["--transport", "rdma", "--mode", "check", "--size", str(8 << 20)], 300)
    after = {c.name: class_bytes(ini.bridge_dev).get(class_for(True, c), 0) for c in (KV, MODEL)}
    proof = res.get("rdma", {"rdma_proven": False, "rxe_sent_pkts": 0, "devices": []})
    rep["transport_check"] = {"bytes_exact": bool(res.get("check", {}).get("ok")),
                              "transport_in_use": res.get("transport_in_use"),
                              "bytes_moved": res.get("bytes_moved"), "error": res.get("error")}
    rep["class_bytes_into_initiator"] = {k: after[k] - before[k] for k in after}
    rep["rdma"] = proof
    rep["rdma_proven"] = bool(proof.get("rdma_proven")) and rep["transport_check"]["bytes_exact"]
    if not rep["rdma_proven"]:
        rep["reason"] = res.get("error") or "the READ/WRITE check over rxe was not byte-exact"
    if fallback_control:
        rep["fallback_control"] = _fallback_control(fab, progress)
    from testbed.calibrate.benches.transport_mooncake import rdma_check as mooncake_rdma_check

    rep["mooncake"] = mooncake_rdma_check(fab, progress)  # beside NIXL's proof, not part of it
    return rep


def _fallback_control(fab, progress=print) -> dict[str, Any]:
    """The same check in processes without the system libibverbs preloaded (the preload check
    overridden). NIXL's bundled libibverbs sees no rxe device, and `caught` says the run did not
    pass for RDMA, in either of the two ways it can fail:
    - `refused`: UCX finds no usable transport and the agent cannot start (with UCX_TLS
      rc_verbs,ud_verbs, which leaves UCX no TCP to fall back to);
    - `counters`: the bytes arrive intact over some other transport and only the rxe counters
      tell (with TCP among UCX_TLS, as measured before the testbed dropped it).
    A counter read that failed altogether proves nothing and is not counted as caught."""
    import os

    from dualpath.transport.rdma import ALLOW_UNPRELOADED
    from testbed.calibrate.benches import _transport_pair

    progress("  the same check without the system libibverbs preloaded (must be caught) ...")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env[ALLOW_UNPRELOADED] = "1"
    try:
        res = _transport_pair(fab, ["--transport", "rdma", "--mode", "check", "--size", str(2 << 20)], 300, env=env)
    except RuntimeError as e:  # the initiator could not start
        refused = "no usable transports" in str(e)
        return {"caught": refused, "how": "refused" if refused else None, "bytes_exact": False,
                "bytes_moved": None, "rxe_sent_pkts": None, "error": " ".join(str(e).split())[:600]}
    err = res.get("error") or ""
    # caught: the proof failed because the rxe devices sent too few packets (not because their
    # counters could not be read, which would fail every run and so tell nothing)
    why = [d.get("why", "") for d in res.get("rdma", {}).get("devices", [])]
    caught = "did not cross RDMA" in err and any("RoCE packets" in w or "were RoCE" in w for w in why)
    return {"caught": caught, "how": "counters" if caught else None, "bytes_exact": bool(res.get("check", {}).get("ok")),
            "bytes_moved": res.get("bytes_moved"), "rxe_sent_pkts": res.get("rdma", {}).get("rxe_sent_pkts"),
            "error": err or None}
