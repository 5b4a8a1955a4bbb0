"""Access to a live fabric from this process: claiming it for a foreground command, and running
a program in one of its nodes, in a traffic class (`dualpath exec`, `Testbed.exec`)."""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from testbed.fabric import rundir


class TestbedError(RuntimeError):
    """Something about the testbed is unusable; the message is one line saying what and why."""

    __test__ = False  # not a pytest test class


def fabric_record(fab: Any, topology_path: Path | None = None) -> dict[str, Any]:
    """What a run directory records of a fabric that is up: enough for `dualpath status` to show
    it and for `dualpath down` to remove it after its owner died."""
    from testbed.fabric.network import COMPUTE_BRIDGE, STORAGE_BRIDGE

    shells = []
    for node in (*fab.net.hosts, *fab.net.switches):  # Mininet's shells: tagged mininet:<name>
        ref = rundir.ProcRef.of(node.shell.pid) if getattr(node, "shell", None) is not None else None
        if ref is not None:
            shells.append({"name": node.name, **ref.to_dict()})
    return {
        "topology": {"name": fab.topo.name, **({"path": str(topology_path)} if topology_path else {})},
        "qos": fab.qos,
        "bridges": [COMPUTE_BRIDGE, STORAGE_BRIDGE],
        "endpoints": [{"name": ep.name, "role": ep.role, "kind": ep.kind, "node": ep.node,
                       "nics": [{"kind": n.kind, "dev": n.dev, "bridge_dev": n.bridge_dev, "ip": n.ip,
                                 "rate_bps": n.rate_bps, "classes": n.classes} for n in ep.nics]}
                      for ep in fab.endpoints],
        "mininet_shells": shells,
        "containers": dict(fab.containers),  # namespace -> its container's init pid (hosts: docker)
    }


@contextmanager
def claimed_fabric(topo: Any, transport: str = "tcp", shares: Sequence[Path] = (),
                   owner_kind: str = "run") -> Iterator[Any]:
    """A bare fabric (testbed.fabric.network.Fabric) for a command that runs in the foreground
    (`dualpath run`, `check`, `bench`, `up --hold`, a reproduce's runs, the isolation
    experiment), holding the machine's run directory while it is up as a Testbed does:
    `dualpath status` and `exec` see it, a second testbed is refused saying whose it is, and
    `dualpath down` removes what it made if this process is killed. Raises TestbedError when
    the machine is taken or holds leftovers; released however the block ends."""
    from testbed.fabric.network import Fabric

    try:
        state = rundir.claim(owner_kind, topo.name)
    except rundir.RunDirBusy as e:
        raise TestbedError(str(e)) from None
    try:
        refuse_leftovers()
        with Fabric(topo, transport, shares) as fab:
            state.update({**fabric_record(fab), "phase": "up", "timings": {"fabric_s": round(fab.timings["up_s"], 3)}})
            rundir.write(state)
            yield fab
    finally:
        st = rundir.read()
        if st is None or rundir.owner(st).pid == os.getpid():  # not one that `dualpath clean` let in meanwhile
            rundir.release()


def refuse_leftovers() -> None:
    """Once the run directory is claimed, anything else of the testbed's on the machine is what
    a dead run left: building over it would mix the two."""
    from testbed.fabric.cleanup import find_leftovers

    left = find_leftovers(exclude_pids={os.getpid()})
    left.run_dirs = []  # ours, just claimed
    if not left.empty():
        raise TestbedError(f"leftovers of an earlier run exist ({left.summary()}); run `dualpath clean` first")


def node_argv(state: Mapping[str, Any], node: str, argv: Sequence[str] | str) -> list[str]:
    """`argv` (a string: run by /bin/sh) prefixed to run in `node`'s namespace."""
    ns = find_endpoint(state, node)["name"]
    cmd = ["/bin/sh", "-c", argv] if isinstance(argv, str) else list(argv)
    if not cmd:
        raise TestbedError("exec: empty command")
    if ns in state.get("containers", {}):
        from testbed.fabric.containers import enter_argv

        return enter_argv(state["containers"][ns], cmd)
    return ["ip", "netns", "exec", ns, *cmd]


def node_env(state: Mapping[str, Any], node: str, ucx: bool = False,
             base: Mapping[str, str] | None = None, traffic_class: str | None = None) -> dict[str, str]:
    """The environment of a command in `node` (Testbed.env)."""
    ep = find_endpoint(state, node)
    nic = ep["nics"][0]
    env = dict(os.environ if base is None else base)
    env.update({"DUALPATH_NODE": ep["name"], "DUALPATH_IFACE": nic["dev"], "DUALPATH_IP": nic["ip"]})
    if traffic_class is not None:
        class_gid(traffic_class)  # a known class, or one line
        env["DUALPATH_CLASS"] = traffic_class
    if ucx or traffic_class is not None:
        env.update(ucx_env(nic["dev"], traffic_class or "kv", env))
    return env


def enable_class_marking(ns: str) -> None:
    """Add the class rules to namespace `ns`'s marking table once (dscp_marking.class_rules_script):
    a program in a class (`class_argv`) is marked by them."""
    from emulators import dscp_marking
    from testbed.fabric.shell import CommandError, run

    try:
        listing = run(["nft", "list", "chain", "ip", dscp_marking.TABLE, "mark_out"], ns=ns)
        if not dscp_marking.has_class_rules(listing):
            run(["nft", "-f", "-"], ns=ns, stdin=dscp_marking.class_rules_script())
    except CommandError as e:
        raise TestbedError(f"{ns}: cannot mark a program's class there ({e}); --class applies to the compute "
                           f"namespaces (engines and host agents), not storage hosts") from None


def class_argv(argv: Sequence[str], traffic_class: str | None) -> list[str]:
    """`argv` run with the class's group as its real and effective gid (util-linux setpriv), so
    that nftables marks every packet its sockets send in that class (emulators/dscp_marking.py,
    once `enable_class_marking` added the rules to its namespace); `argv` itself without a class."""
    if traffic_class is None:
        return list(argv)
    return ["setpriv", f"--regid={class_gid(traffic_class)}", "--clear-groups", "--", *argv]


def class_gid(traffic_class: str) -> int:
    from dualpath.traffic_classes import CLASS_GIDS

    if traffic_class not in CLASS_GIDS:
        raise TestbedError(f"no traffic class {traffic_class!r}; choose {' or '.join(CLASS_GIDS)}")
    return CLASS_GIDS[traffic_class]


def ucx_env(iface: str, traffic_class: str, base: Mapping[str, str] | None) -> dict[str, str]:
    from dualpath.transport.env import TransportError, build_ucx_env

    try:
        return build_ucx_env(iface, traffic_class, "tcp", base=dict(base or {}))
    except (TransportError, ValueError) as e:
        raise TestbedError(str(e)) from None


def find_endpoint(state: Mapping[str, Any], node: str) -> dict[str, Any]:
    from dualpath.naming import PREFIX

    eps = state.get("endpoints", [])
    full = node if node.startswith(f"{PREFIX}-") else f"{PREFIX}-{node}"
    for e in eps:
        if e["name"] == full:
            return e
    names = ", ".join(e["name"].removeprefix(f"{PREFIX}-") for e in eps)
    raise TestbedError(f"no node {node!r} in this testbed; nodes: {names or 'none'}")


def nic_of(ep: Mapping[str, Any], kind: str | None) -> dict[str, Any]:
    if kind is None:
        return ep["nics"][0]
    for n in ep["nics"]:
        if n["kind"] == kind:
            return n
    raise TestbedError(f"{ep['name']} has no {kind!r} NIC; it has {', '.join(n['kind'] for n in ep['nics'])}")


def short_cmd(argv: Sequence[str] | str) -> str:
    text = argv if isinstance(argv, str) else " ".join(argv)
    return text if len(text) <= 60 else text[:57] + "..."
