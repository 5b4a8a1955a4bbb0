"""The testbed as a library: bring a topology up, use it from Python, tear it down.

    from testbed import Testbed

    with Testbed("topologies/1p1d.yaml", services=True) as tb:
        tb.exec("p0e0", ["ip", "-br", "addr"])          # a command in an engine's namespace
        tb.address("d0e0")                               # its CNIC's address
        tb.store.put(key, block)                         # a ready store client
        tb.agents["dpt-p0e0"]                            # each engine's transport agent name

The fabric alone (services=False) is up in about a second; services add the store servers,
host agents and engines (their own start-up time is in `tb.timings`). Teardown runs on
leaving the `with` block, on an exception in it, on SIGTERM (turned into KeyboardInterrupt
while the testbed is up, as the CLI does) and at interpreter exit; it ends every process in
the testbed's namespaces, user processes started with `exec`/`popen` included.

The state of a live testbed is recorded in one run directory (testbed/fabric/rundir.py), so the
CLI sees it (`dualpath status`, `exec`, `down`) and a second testbed on the machine fails
to start with a clear error. `Testbed.attach()` gives the same view of a testbed someone
else owns (e.g. one `dualpath up --detach` started in an earlier CI step).
"""
from __future__ import annotations

import atexit
import os
import signal
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from testbed.fabric import rundir
from testbed.fabric.access import (TestbedError, class_argv, enable_class_marking, fabric_record, find_endpoint,
                                   nic_of, node_argv, node_env, refuse_leftovers, short_cmd, ucx_env)
from testbed.paths import REPO
from testbed.topology import Topology, resolve_topology


_live: list["Testbed"] = []  # owned testbeds still up, for the atexit safety net


def demo_checkpoint() -> Path:
    """The tiny deterministic demo model the services load unless told otherwise (made once,
    atomically, by the one builder of it: dualpath.model.registry.prepare_tiny)."""
    from dualpath.model.registry import prepare_tiny

    return prepare_tiny()


class Testbed:
    """A live emulated cluster: its fabric and, with `services=True`, its node processes.

    Args:
        topology: a topology YAML path, a shipped topology's name ("1p1d"), or a loaded Topology.
        services: also start the store servers, host agents and engines (wired to each other).
        checkpoint: the model the engines load (default: the tiny demo model).
        transport: "tcp", or "rdma" (fails where the kernel has none, never falls back).
        shares: more folders the nodes read and write (shared into docker hosts).
        owner: what `dualpath status` calls its owner ("api"; `dualpath run` says "run").
    """

    __test__ = False  # not a pytest test class, whatever module imports it

    def __init__(self, topology: str | os.PathLike[str] | Topology | None = None, *, services: bool = False,
                 checkpoint: str | os.PathLike[str] | None = None, transport: str = "tcp",
                 shares: Sequence[os.PathLike[str]] = (), owner: str = "api", server: str | None = None):
        from testbed.topology import load_topology

        if isinstance(topology, Topology):  # loaded already, perhaps with a command's overrides
            self.topo = topology
            source = Path(topology.source)
            self.topology_path = source.resolve() if source.is_file() else None
        else:
            self.topology_path = resolve_topology(topology).resolve()
            self.topo = load_topology(self.topology_path)  # TopologyError: one line, before anything is made
        if transport not in ("tcp", "rdma"):
            raise TestbedError(f"transport {transport!r} is not tcp or rdma")
        self.shares = tuple(Path(p) for p in shares)  # more folders the nodes read and write (docker hosts)
        self.services = services
        self.checkpoint = Path(checkpoint) if checkpoint else None
        self.transport = transport
        self.server = server  # one server's part of a topology over several (None: the first, which leads)
        self.run_dir = rundir.RUN_DIR
        self.timings: dict[str, float] = {}
        self.state: dict[str, Any] = {}
        self.fabric: Any = None  # testbed.fabric.network.Fabric
        self.cluster: Any = None  # testbed.cluster.processes.Cluster
        self._store: Any = None
        self._owned = True
        self._claimed = False
        self._old_sigterm: Any = None
        self.owner_kind = owner  # "detached": `dualpath down` may stop it; "run": a foreground `dualpath run`

    # -- lifecycle ------------------------------------------------------------------------------
    def up(self) -> "Testbed":
        """Bring everything up; on any failure tear down what was made, then raise."""
        self.claim()
        try:
            self.build()
        except BaseException:
            self.down()
            raise
        return self

    def claim(self) -> None:
        """Take the machine's one run directory (TestbedError if a testbed is already up)."""
        if os.geteuid() != 0:
            raise TestbedError("the testbed needs root (it creates network namespaces and tc qdiscs); "
                               "run with sudo")
        try:
            self.state = rundir.claim(self.owner_kind, self.topo.name, self.run_dir)
        except rundir.RunDirBusy as e:
            raise TestbedError(str(e)) from None
        self._claimed = True
        _live.append(self)

    def build(self) -> None:
        # Not testbed.cluster.processes: it imports torch (2 s here), which a fabric-only bring-up never needs.
        from testbed.fabric.network import (COMPUTE_BRIDGE, COMPUTE_NET, CONDUCTOR_IP, STORAGE_BRIDGE, STORAGE_CLIENT_IP,
                                    STORAGE_NET, Fabric)
        from testbed.fabric.shell import run

        refuse_leftovers()
        self._catch_sigterm()
        t0 = time.monotonic()
        # with hosts: docker, the node processes' run directory and checkpoint are shared into the containers
        shares = (self.run_dir, *self.shares, *((self._checkpoint(),) if self.services else ()))
        self.fabric = Fabric(self.topo, self.transport, shares, server=self.server)  # rdma: an rxe device per namespace
        self.fabric.up()
        # the root namespace's own addresses: the conductor's, and one through which a store client
        # in the caller's process reaches the storage servers (through their shaped NICs). Only
        # the first server's: over several servers the bridges are one L2 network.
        if not self.fabric.is_remote_part:
            run(["ip", "-batch", "-"], stdin=f"addr replace {CONDUCTOR_IP}/{COMPUTE_NET.prefixlen} dev {COMPUTE_BRIDGE}\n"
                                             f"addr replace {STORAGE_CLIENT_IP}/{STORAGE_NET.prefixlen} dev {STORAGE_BRIDGE}\n")
        self.timings["fabric_s"] = round(time.monotonic() - t0, 3)
        self.state.update(self._fabric_state(CONDUCTOR_IP, STORAGE_CLIENT_IP))
        self.state["phase"] = "fabric"
        rundir.write(self.state, self.run_dir)  # from here `dualpath down` knows what to remove
        if self.services:
            t1 = time.monotonic()
            self._start_services()
            self.timings["services_s"] = round(time.monotonic() - t1, 3)
        self.state.update({"phase": "up", "timings": dict(self.timings)})
        rundir.write(self.state, self.run_dir)

    def _start_services(self) -> None:
        from testbed.cluster.processes import CONTROL_PORT, Cluster
        from testbed.cluster.runclock import run_geometry

        ckpt = self._checkpoint()
        geom = run_geometry(ckpt)
        self.cluster = Cluster.for_topology(self.fabric, self.run_dir, ckpt, geom, transport=self.transport)
        self.cluster.start()
        self.cluster.run(self.cluster.connect())
        c = self.cluster
        self.state["store"] = {"endpoints": [s.address_str for s in c.stores], "block_bytes": geom.full_block_bytes,
                               "block_tokens": geom.block_size, "checkpoint": str(ckpt)}
        # What each process is, for `dualpath status` (a `down` after this owner died needs no list:
        # it ends whatever lives in the testbed's namespaces).
        procs = []
        storage = [e.name for e in self.fabric.endpoints if e.kind == "storage"]
        for i, (s, ns) in enumerate(zip(c.stores, storage)):
            procs.append({"name": f"store{i}", "role": "store", "ns": ns, **self._ref(s.proc.pid),
                          "listen": s.address_str})
        for name, p in c.procs.items():
            procs.append({"name": name, "role": p.role, "ns": p.endpoint.name, **self._ref(p.proc.pid),
                          "control": f"tcp://{p.endpoint.ip}:{CONTROL_PORT}", "agent": name,
                          "transport": c.transports.get(name, ""), "log": str(p.log)})
        self.state["processes"] = procs
        self.state["agents"] = {name: name for name in c.procs}  # a node process's NIXL agent is named after it

    def _checkpoint(self) -> Path:
        return self.checkpoint or demo_checkpoint()

    @staticmethod
    def _ref(pid: int) -> dict[str, int]:
        ref = rundir.ProcRef.of(pid)
        return ref.to_dict() if ref else {"pid": pid, "start": -1}

    def _fabric_state(self, conductor_ip: str, storage_ip: str) -> dict[str, Any]:
        return {
            **fabric_record(self.fabric, self.topology_path),
            "services": self.services,
            "root_addresses": {"compute": conductor_ip, "storage": storage_ip},
            "store": None, "processes": [], "agents": {},
        }

    def down(self) -> None:
        """Tear everything down. Safe to call twice, after a partial up, and on an attached view."""
        if not self._owned:
            self._close_store()
            return
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        errors: list[str] = []
        try:
            self._close_store()
            if self.cluster is not None:
                try:
                    self.cluster.stop()
                except Exception as e:  # keep tearing down the rest
                    errors.append(f"services: {e}")
                self.cluster = None
            if self.fabric is not None:
                try:
                    self.fabric.down()
                except Exception as e:
                    errors.append(f"fabric: {e}")
                self.fabric = None
            if self._claimed:
                rundir.release(self.run_dir)
                self._claimed = False
            if self in _live:
                _live.remove(self)
            self._restore_sigterm()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if errors:
            raise TestbedError("teardown: " + "; ".join(errors))

    def __enter__(self) -> "Testbed":
        return self.up() if self._owned else self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _catch_sigterm(self) -> None:
        # SIGTERM would end the process without unwinding, leaving everything behind: make it
        # unwind like Ctrl-C while we are up. Only where a handler can be set (main thread)
        # and nobody else chose one.
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._old_sigterm = signal.signal(signal.SIGTERM, _raise_interrupt)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    # -- attaching to a testbed someone else owns ---------------------------------------------------
    @classmethod
    def attach(cls) -> "Testbed":
        """A view of the testbed that is up on this machine (e.g. `dualpath up --detach`'s).

        It can exec, look up addresses, read counters and use the store; leaving it (or
        `down()`) closes only its own store client: the owner tears the testbed down.
        """
        st = rundir.read()
        if st is None:
            raise TestbedError("no testbed is up here; start one with `dualpath up TOPOLOGY --detach`")
        if not rundir.owner(st).alive():
            raise TestbedError(rundir.describe_busy(st))
        if st.get("phase") != "up":
            raise TestbedError(f"the testbed in {rundir.RUN_DIR} is still starting (phase {st.get('phase')!r}); "
                               f"try again once `dualpath up` has returned")
        from testbed.fabric.network import Fabric

        tb = cls(st["topology"]["path"], services=bool(st.get("services")))
        tb._owned = False
        tb.state = st
        tb.timings = dict(st.get("timings", {}))
        tb.fabric = Fabric(tb.topo)  # not brought up here: its plan names every NIC, for the counters
        if [e.name for e in tb.fabric.endpoints] != tb.nodes:
            raise TestbedError(f"{tb.topology_path} changed since the testbed came up; its NICs are no longer "
                               f"those of the live testbed")
        tb.fabric.qos = st.get("qos", tb.fabric.qos)
        return tb

    # -- what is up ---------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        """Every namespace of the testbed: host sides, engines, storage servers."""
        return [e["name"] for e in self.state.get("endpoints", [])]

    def endpoint(self, node: str) -> dict[str, Any]:
        """The recorded endpoint (name, role, kind, node, nics) of a namespace; "p0e0" or "dpt-p0e0"."""
        return find_endpoint(self.state, node)

    def address(self, node: str, nic: str | None = None) -> str:
        """The address of a node's NIC (default: its first: an engine's CNIC, a host's host port)."""
        return nic_of(self.endpoint(node), nic)["ip"]

    def iface(self, node: str, nic: str | None = None) -> str:
        return nic_of(self.endpoint(node), nic)["dev"]

    @property
    def addresses(self) -> dict[str, dict[str, str]]:
        """Namespace -> NIC kind -> address."""
        return {e["name"]: {n["kind"]: n["ip"] for n in e["nics"]} for e in self.state.get("endpoints", [])}

    @property
    def engines(self) -> list[str]:
        return [e["name"] for e in self.state.get("endpoints", []) if e["kind"] == "engine"]

    @property
    def agents(self) -> dict[str, str]:
        """Node process (namespace) -> the name of its NIXL transport agent (services only)."""
        return dict(self.state.get("agents", {}))

    @property
    def store_endpoints(self) -> list[str]:
        st = self.state.get("store") or {}
        return list(st.get("endpoints", []))

    @property
    def store(self):
        """A store client (dualpath.store.StoreClient) connected to every storage server, from
        this process over the storage network; Full Blocks of the services' block size."""
        if not self.state.get("store"):
            raise TestbedError("this testbed has no store: bring it up with services=True (or --services)")
        if self._store is None:
            from dualpath.store.client import StoreClient

            self._store = StoreClient(self.store_endpoints, int(self.state["store"]["block_bytes"]))
        return self._store

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None

    # -- running things in a namespace --------------------------------------------------------------
    def env(self, node: str, ucx: bool = False, base: Mapping[str, str] | None = None,
            traffic_class: str | None = None) -> dict[str, str]:
        """The environment of a command in `node`: DUALPATH_NODE/IFACE/IP, and with `ucx` the UCX
        settings a NIXL/UCX program needs so that its bytes cross this node's NIC in the kv class
        (UCX_TLS=tcp, UCX_NET_DEVICES, UCX_MODULES, UCX_TCP_PORT_RANGE; see notes/platform-facts);
        with `traffic_class` the same for that class's port range (and DUALPATH_CLASS)."""
        return node_env(self.state, node, ucx, base, traffic_class)

    def ucx_env(self, node: str, traffic_class: str = "kv", base: Mapping[str, str] | None = None) -> dict[str, str]:
        """Only the UCX_* settings of `env(ucx=True)`, for a program that builds its own environment."""
        return ucx_env(self.iface(node), traffic_class, base)

    def exec(self, node: str, argv: Sequence[str] | str, *, timeout: float = 60, check: bool = False,
             input: str | None = None, env: Mapping[str, str] | None = None, ucx: bool = False,
             cwd: str | os.PathLike[str] | None = None,
             traffic_class: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run a command to completion in `node`'s namespace; its output captured as text.
        A string is run by /bin/sh. `check`: raise TestbedError on a non-zero exit.
        `traffic_class` ("kv" or "model"): every packet it sends is marked in that class
        (`class_argv`), and its UCX settings are that class's."""
        full = class_argv(node_argv(self.state, node, argv), traffic_class)
        if traffic_class is not None:
            enable_class_marking(find_endpoint(self.state, node)["name"])
        try:
            p = subprocess.run(full, input=input, capture_output=True, text=True, timeout=timeout,
                               env=self.env(node, ucx, env, traffic_class), cwd=cwd)
        except subprocess.TimeoutExpired:
            raise TestbedError(f"{node}: {short_cmd(argv)} timed out after {timeout:g}s") from None
        if check and p.returncode != 0:
            last = (p.stderr or p.stdout).strip().splitlines()
            raise TestbedError(f"{node}: {short_cmd(argv)} exited with {p.returncode}: {last[-1] if last else ''}")
        return p

    def popen(self, node: str, argv: Sequence[str] | str, *, env: Mapping[str, str] | None = None,
              ucx: bool = False, traffic_class: str | None = None, **kw: Any) -> subprocess.Popen:
        """Start a command in `node`'s namespace and return at once (subprocess.Popen keywords
        apply). It lives in the namespace, so teardown ends it if it is still running.
        `traffic_class`: as for `exec`."""
        if traffic_class is not None:
            enable_class_marking(find_endpoint(self.state, node)["name"])
        return subprocess.Popen(class_argv(node_argv(self.state, node, argv), traffic_class),
                                env=self.env(node, ucx, env, traffic_class), **kw)

    # -- counters -------------------------------------------------------------------------------
    def counters(self):
        """Every NIC's kernel byte counters per traffic class and direction (testbed.fabric.counters.Snapshot)."""
        from testbed.fabric import counters

        return counters.snapshot(self.fabric)

    def class_bytes(self, node: str, nic: str | None = None) -> dict[str, dict[str, int]]:
        """Wire bytes per traffic class ("kv", "model"; "fifo" with QoS off) of one NIC, as
        {"tx": {...}, "rx": {...}}: tx is what the node sent, rx what it received."""
        from emulators.nic import CLASS_IDS, FIFO_CLASS
        from testbed.fabric.counters import class_bytes

        n = nic_of(self.endpoint(node), nic)
        ns = self.endpoint(node)["name"]
        ids = ({name: cid for name, cid in CLASS_IDS.items()} if n["classes"] and self.fabric.qos
               else {"fifo": FIFO_CLASS})
        out = {}
        for direction, dev, where in (("tx", n["dev"], ns), ("rx", n["bridge_dev"], None)):
            stats = class_bytes(dev, where)
            out[direction] = {name: stats.get(cid, 0) for name, cid in ids.items()}
        return out


def _raise_interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@atexit.register
def _down_all() -> None:
    # The last safety net: a testbed brought up without `with` and never downed.
    for tb in list(_live):
        try:
            tb.down()
        except Exception:
            pass
