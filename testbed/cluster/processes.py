"""The node processes of a run: store servers, host agents and engines, each in its namespace.

`Cluster` starts them on a live Fabric, wires their transport agents to each
other (NIXL metadata travels over the control plane), and stops them. The
conductor talks to every process over the emulated compute network from an
address on the compute bridge, so control crosses the same shaped NICs (in
the model class) as it would in a real cluster.

Every control message carries the run's secret (dualpath.control.Auth), drawn here per
cluster and written to each node process's stdin at start: the conductor sits in the root
namespace, so the network cannot tell it from any other local process, and only the secret can.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import select
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import zmq.asyncio

from dualpath.nodes.common import collective_port, jobs_port, load_port
from dualpath.control import SECRET_BYTES, AsyncRpcClient, Auth, RpcClient
from dualpath.kv.layouts import BlockGeometry
from dualpath.model.numerics import PORTABLE_KERNELS
from dualpath.timeouts import scaled
from emulators.kvstore.launch import ServerProcess
from testbed.fabric.cleanup import TMPFS_SOURCE
from testbed.fabric.remote import best_offset
from testbed.fabric.network import COMPUTE_BRIDGE, COMPUTE_NET, CONDUCTOR_IP, Endpoint, Fabric, engine_groups
from testbed.fabric.shell import run
from testbed.paths import REPO

if TYPE_CHECKING:
    from testbed.topology_servers import ServerSpec
    from dualpath.kv.plugin import ConnectorRef

CONTROL_PORT = 5555  # outside the kv port range: control rides the model class
STORE_PORT = 7000


# How long a node process may take to start (import torch, the model, NIXL); in the Soft-RoCE VM
# (DPT_IN_VM) timeouts scale (dualpath/timeouts.py): every process imports torch at once on two
# emulated vCPUs there.
READY_TIMEOUT_S = float(os.environ.get("DPT_READY_TIMEOUT_S") or scaled(120.0))

CLOCK_TRIES = 7  # round trips per other server when aligning its clock with this one's


class ProcessFailed(RuntimeError):
    pass


@dataclass
class NodeProcess:
    """One node process in a namespace, announced by a 'ready' line on stdout."""

    name: str
    role: str  # "host", "prefill", "decode"
    endpoint: Endpoint
    proc: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float | None = None) -> str:
        timeout_s = READY_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buf = b""
        while time.monotonic() < deadline:
            if select.select([fd], [], [], 0.05)[0]:
                buf += os.read(fd, 4096)
                for line in buf.decode(errors="replace").splitlines():
                    if line.startswith("ready"):
                        return line
            if not self.alive():
                raise ProcessFailed(f"{self.name} exited with {self.proc.returncode} while starting: "
                                    f"{_tail(self.log)}")
        raise ProcessFailed(f"{self.name} not ready within {timeout_s:g}s: {_tail(self.log)}")

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def collective_configs(endpoints: list[Endpoint], sizes: dict) -> dict[str, dict]:
    """Engine -> its collective's config: the port, its group's other engines' CNIC addresses and
    the bytes per token. An engine alone in its group has no one to exchange with and none."""
    out = {}
    for members in engine_groups(endpoints).values():
        if len(members) < 2:
            continue
        for e in members:
            out[e.name] = {"port": collective_port(CONTROL_PORT), "peers": [p.ip for p in members if p is not e],
                           "dispatch_per_token": float(sizes["dispatch_per_token"]),
                           "combine_per_token": float(sizes["combine_per_token"])}
    return out


def _tail(path: Path, n: int = 1) -> str:
    try:
        lines = [l for l in path.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return f"(no log at {path})"
    return " | ".join(lines[-n:]) or f"(empty log {path})"


def _remote_env() -> dict[str, str]:
    """What a node process on another server gets set there (here, Popen's env does it): the
    same as here, the run's timeout scale (a slow server's, e.g. a TCG guest's) and its kernel
    choice (dualpath/model/numerics.py: every server computes the same floats)."""
    env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for key in ("DPT_TIMEOUT_SCALE", *PORTABLE_KERNELS):
        if os.environ.get(key):
            env[key] = os.environ[key]
    return env


class Cluster:
    """Node processes on a Fabric. Use as a context manager: stop() always runs."""

    def __init__(self, fab: Fabric, run_dir: Path, checkpoint: Path, geom: BlockGeometry,
                 buffer_bytes: int, hbm_bytes: int, store_capacity: int = 2 << 30, transport: str = "tcp",
                 tmpfs_stores: dict[str, int] | None = None,
                 timing: dict | None = None, collectives: dict | None = None, device: str = "cpu",
                 connector: ConnectorRef | None = None):
        """`timing`: the engines' emulated clock ({dilation, prefill, decode}: the target's cost
        models as dicts); None keeps the host's own time. `collectives`: the per-layer AllToAll's
        bytes ({dispatch_per_token, combine_per_token}, RunClock.engine_collectives); every engine
        of a group of two or more runs it with the group's others; None: no collectives.
        `device`: where the engines compute (cpu, or cuda: dualpath/model/device.py). `connector`:
        a team's ConnectorPlugin, which every engine loads (dualpath/kv/plugin.py)."""
        self.fab, self.run_dir, self.checkpoint, self.geom = fab, run_dir, checkpoint, geom
        self.device = device
        self.connector = connector
        self.timing = timing
        self.collectives = collective_configs(fab.endpoints, collectives) if collectives else {}
        self.buffer_bytes, self.hbm_bytes, self.store_capacity = buffer_bytes, hbm_bytes, store_capacity
        self.transport = transport  # "rdma" without RDMA devices fails at start, never falls back
        self.stores: list[ServerProcess] = []
        self.procs: dict[str, NodeProcess] = {}
        self.clients: dict[str, RpcClient] = {}
        self.loaders: dict[str, AsyncRpcClient] = {}  # host agents' read queues
        # long commands, many outstanding: host agents' flushes and notification waits, DEs' decodes
        self.jobs: dict[str, AsyncRpcClient] = {}
        self.clock_offsets: dict[str, float] = {}  # process -> its clock less this one's (other servers only)
        self.clock_sync: dict[str, dict] = {}  # server -> offset_s, uncertainty_s
        self.transports: dict[str, str] = {}
        self.auth = Auth(secrets.token_bytes(SECRET_BYTES))  # the run's secret, on every control message
        self.tmpfs_stores = dict(tmpfs_stores or {})  # storage server -> bytes of its root's own tmpfs
        self.disk_mounts: dict[Path, int] = {}  # store roots mounted here (unmounted at stop)
        self.remote_roots: dict[Path, tuple[ServerSpec, str]] = {}  # store roots elsewhere: server, namespace
        self.ctx: zmq.asyncio.Context | None = None
        self.loop = asyncio.new_event_loop()  # one loop for every control socket of the run
        self.cost_model = None
        self.prefill_tokens_per_s = 0.0
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    # -- lookup --------------------------------------------------------------------------------
    def control_bytes(self) -> int:
        """Control-plane bytes the conductor has sent and received so far."""
        return sum(c.sent_bytes + c.recv_bytes
                   for c in (*self.clients.values(), *self.loaders.values(), *self.jobs.values()))

    def pids(self) -> dict[int, str]:
        """Every process of the run by pid: the node processes, the storage servers and this one."""
        return {os.getpid(): "conductor", **{p.proc.pid: n for n, p in self.procs.items()},
                **{s.proc.pid: f"store{i}" for i, s in enumerate(self.stores) if s.proc is not None}}

    def engines(self, role: str) -> list[str]:
        return [n for n, p in self.procs.items() if p.role == role]

    def host_of(self, engine: str) -> str:
        return self.procs[engine].endpoint.node

    # -- lifecycle -----------------------------------------------------------------------------
    @classmethod
    def for_topology(cls, fab: Fabric, run_dir: Path, checkpoint: Path, geom: BlockGeometry, *,
                     buffer_bytes: int | None = None, hbm_bytes: int | None = None, **kw) -> "Cluster":
        """The one way a run builds its cluster (a Testbed's services, `dualpath run`, isolation):
        the DRAM buffers and engine HBM the topology gives (unless named), and the engines' clock and
        collectives from its target (testbed/cluster/runclock.py). `kw` goes to the constructor."""
        from testbed.cluster.runclock import RunClock

        if getattr(fab, "is_remote_part", False):  # a stand-in fabric has no servers
            raise ValueError(f"topology {fab.topo.name}: node processes start from the first server's fabric, "
                             f"not from server {fab.server}'s part")
        spec, clock = fab.topo.spec, RunClock.of(fab.topo, geom)
        return cls(fab, run_dir, checkpoint, geom,
                   buffer_bytes if buffer_bytes is not None else int(spec.dram_buffer_gib * 2**30),
                   hbm_bytes if hbm_bytes is not None else int(spec.hbm_gib_per_engine * 2**30),
                   timing=clock.engine_timing(), collectives=clock.engine_collectives(), **kw)

    def start(self) -> "Cluster":
        if self.transport in ("rdma", "mooncake-rdma"):  # both pin what they register
            from dualpath.transport.env import RdmaUnavailableError
            from dualpath.transport.rdma import pinned_memory_problem

            kinds = [e.kind for e in self.fab.endpoints]
            why = pinned_memory_problem(kinds.count("host") * self.buffer_bytes + kinds.count("engine") * self.hbm_bytes)
            if why:
                raise RdmaUnavailableError(why)
        store_addrs = []
        for ep in (e for e in self.fab.endpoints if e.kind == "storage"):
            sp = self._store_process(ep, store_addrs)
            self.stores.append(sp)
            sp.start()
            store_addrs.append(sp.address_str)
        mooncake = self.fab.topo.spec.store == "mooncake"
        for ep in self.fab.endpoints:
            if ep.kind == "host":
                nic = ep.nic("host_port")
                self._spawn(ep, "host", "dualpath.nodes.host", nic.dev, nic.ip, [
                    "--buffer-bytes", str(self.buffer_bytes), "--block-bytes", str(self.geom.full_block_bytes),
                    "--store", store_addrs[0] if mooncake else ",".join(store_addrs), "--snic", ep.nic("snic").dev,
                    "--store-kind", self.fab.topo.spec.store])
            elif ep.kind == "engine":
                nic = ep.nic("cnic")
                self._spawn(ep, ep.role, "dualpath.nodes.engine", nic.dev, nic.ip, [
                    "--role", ep.role, "--checkpoint", str(self.checkpoint),
                    "--hbm-bytes", str(self.hbm_bytes), "--block-size", str(self.geom.block_size),
                    "--device", self.device, *(self.connector.engine_args() if self.connector else []),
                    *(["--timing", json.dumps(self.timing)] if self.timing else []),
                    *(["--collectives", json.dumps(self.collectives[ep.name])] if ep.name in self.collectives else [])])
        for p in self.procs.values():
            self.transports[p.name] = p.wait_ready().split(" ", 2)[2]
        # The conductor's own address on the compute bridge (removed with the bridge).
        run(["ip", "addr", "replace", f"{CONDUCTOR_IP}/{COMPUTE_NET.prefixlen}", "dev", COMPUTE_BRIDGE])
        return self

    def _store_process(self, ep: Endpoint, started: list[str]) -> ServerProcess:
        """A storage host's server, not yet started. Its folder is run_dir/store/NAME on the server
        that holds the storage host: on another server the store makes it there (the same path,
        on that server's own disk) and stop() removes it."""
        root = self.run_dir / "store" / ep.name
        remote = self.fab.server_of(ep.name)
        if ep.name in self.tmpfs_stores:  # a disk of its own, which a fault can fill
            if remote is not None or ep.name in self.fab.containers:  # mounted here, seen only here
                raise ValueError(f"a disk-full fault on {ep.name} needs it on this server in hosts: namespaces: "
                                 "the store's own tmpfs is mounted in this machine's root namespace")
            root.mkdir(parents=True, exist_ok=True)
            run(["mount", "-t", "tmpfs", "-o", f"size={self.tmpfs_stores[ep.name]},mode=0700", TMPFS_SOURCE,
                 str(root)])
            self.disk_mounts[root] = self.tmpfs_stores[ep.name]
        if remote is not None:
            self.remote_roots[root] = (remote, ep.name)
        return ServerProcess(root, self.store_capacity, log_path=self.run_dir / "logs" / f"{ep.name}.log",
                             wrap=lambda argv: self.fab.exec_argv(ep.name, argv, env=_remote_env()),
                             root_here=remote is None, startup_timeout_s=scaled(30.0),
                             **self._store_server(ep.nic("storage_nic").ip, started))

    def _store_server(self, ip: str, started: list[str]) -> dict:
        """How a storage host's server starts: the 3FS-like store's on its port, refusing any block
        but a Full Block; or a Mooncake Store segment, the first one with the master, the others
        joining it (its address is what the host agents are given)."""
        if self.fab.topo.spec.store != "mooncake":
            return {"listen": f"{ip}:{STORE_PORT}", "block_bytes": self.geom.full_block_bytes}
        return {"listen": f"{ip}:0", "module": "emulators.mooncake_store",
                "extra_args": ["--master", started[0]] if started else []}

    def _spawn(self, ep: Endpoint, role: str, module: str, iface: str, ip: str, extra: list[str]) -> None:
        """Start one node process (here, or over SSH on the server that holds its namespace)."""
        log = self.run_dir / "logs" / f"{ep.name}.log"
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        if self.transport in ("rdma", "mooncake-rdma"):  # NIXL's bundled libibverbs cannot drive rxe (transport/rdma.py); Mooncake loads the system one anyway
            from dualpath.transport.rdma import preload_env

            env = preload_env(env)
        argv = self.fab.exec_argv(ep.name, [sys.executable, "-m", module, "--name", ep.name, "--iface", iface,
                                 "--ip", ip, "--control-port", str(CONTROL_PORT), "--transport", self.transport,
                                 *extra], env=_remote_env())
        with open(log, "ab") as lf:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=lf, stdin=subprocess.PIPE,
                                    cwd=REPO, env=env)
        try:  # the secret goes down a pipe only this process and the child hold
            proc.stdin.write(self.auth.secret.hex().encode() + b"\n")
            proc.stdin.close()
        except BrokenPipeError:
            pass  # it died at once: wait_ready says why
        self.procs[ep.name] = NodeProcess(ep.name, role, ep, proc, log)

    async def connect(self) -> None:
        """Control clients for every process, then every transport agent learns every other."""
        self.ctx = zmq.asyncio.Context()
        for name, p in self.procs.items():
            self.clients[name] = RpcClient(self.ctx, name, f"tcp://{p.endpoint.ip}:{CONTROL_PORT}", p.alive,
                                           auth=self.auth)
            if p.role == "host":
                self.loaders[name] = AsyncRpcClient(self.ctx, name, f"tcp://{p.endpoint.ip}:{load_port(CONTROL_PORT)}",
                                                    p.alive, auth=self.auth)
            if p.role in ("host", "decode"):
                self.jobs[name] = AsyncRpcClient(self.ctx, name, f"tcp://{p.endpoint.ip}:{jobs_port(CONTROL_PORT)}",
                                                 p.alive, auth=self.auth)
        hellos = {n: await c.call("hello", timeout_s=30) for n, c in self.clients.items()}
        metas = {n: h["metadata"] for n, h in hellos.items()}
        rates = [h["prefill_tokens_per_s"] for h in hellos.values() if "prefill_tokens_per_s" in h]
        self.prefill_tokens_per_s = min(rates) if rates else 0.0
        # The compute-quota cost model, fitted on the engines' own prefill loop.
        fits = [h["cost_model"] for h in hellos.values() if "cost_model" in h]
        from dualpath.scheduler.cost_model import AttentionCostModel

        self.cost_model = AttentionCostModel.from_dict(fits[0]) if fits else None
        for name, c in self.clients.items():
            await c.call("add_peers", metadata=[m for n, m in metas.items() if n != name], timeout_s=30)
        hosts = [n for n, p in self.procs.items() if p.role == "host"]
        engines = [n for n, p in self.procs.items() if p.role != "host"]
        for name, c in self.clients.items():  # wire up now, both ways, not during a transfer
            await c.call("connect", peers=engines if name in hosts else hosts, timeout_s=30)
        await self._align_clocks()

    async def _align_clocks(self, tries: int = CLOCK_TRIES) -> None:
        """Each other server's CLOCK_MONOTONIC against this one's: the times its processes report
        (a pass's end, a token's, a store read's) are shifted by it. Cristian's method over the
        control channel (testbed/fabric/remote.py's best_offset), on one process of the server."""
        for server in self.fab.remotes:
            names = [n for n, p in self.procs.items() if self.fab.server_of(p.endpoint.name) is server]
            if not names:
                continue
            readings = []
            for _ in range(tries):
                t0 = time.monotonic()
                there = (await self.clients[names[0]].call("clock", timeout_s=30))["monotonic"]
                readings.append((t0, there, time.monotonic()))
            best = best_offset(readings)
            self.clock_sync[server.name] = {"offset_s": round(best[0], 6), "uncertainty_s": round(best[1], 6)}
            for n in names:
                self.clock_offsets[n] = best[0]

    def clock_offset(self, name: str) -> float:
        """How far process `name`'s monotonic clock is ahead of this one's (0 on this server)."""
        return self.clock_offsets.get(name, 0.0)

    def run(self, coro):
        """Run a coroutine of the conductor on the cluster's event loop. On Ctrl-C its tasks are
        cancelled and drained before the cluster goes down, so that none is left to fail later
        against a torn-down cluster and print a traceback when it is collected."""
        task = self.loop.create_task(coro)
        try:
            return self.loop.run_until_complete(task)
        except BaseException:
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                try:
                    self.loop.run_until_complete(asyncio.wait(pending, timeout=5))
                except BaseException:  # a second Ctrl-C: go down now
                    pass
            for t in pending:
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: its error is the interrupt's consequence, not news
            raise

    def stop(self) -> None:
        """Every step runs even if one before it raised; the first error is raised after. A
        Ctrl-C that a request task caught comes back out of the loop's drain (asyncio re-raises
        KeyboardInterrupt), and must not leave the store's tmpfs mounted."""
        first: BaseException | None = None
        for step in (self._close_clients, self._drain_loop, self._close_loop, self._stop_processes, self._unmount,
                     self._remove_remote_roots):
            try:
                step()
            except BaseException as e:
                first = first or e
        if first is not None:
            raise first

    def _close_clients(self) -> None:
        for c in (*self.clients.values(), *self.loaders.values(), *self.jobs.values()):
            c.close()
        self.clients.clear()
        self.loaders.clear()
        self.jobs.clear()

    def _drain_loop(self) -> None:
        if not self.loop.is_closed():  # whatever still runs on the loop (reply readers, a failed
            pending = asyncio.all_tasks(self.loop)  # run's requests) ends before the loop goes
            for t in pending:
                t.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.wait(pending, timeout=5))

    def _close_loop(self) -> None:
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if not self.loop.is_closed():
            self.loop.close()

    def _stop_processes(self) -> None:
        for p in self.procs.values():
            p.stop()
        for s in self.stores:
            s.stop()

    def _unmount(self) -> None:
        for root in list(self.disk_mounts):
            run(["umount", "-l", str(root)], check=False)
            del self.disk_mounts[root]

    def _remove_remote_roots(self) -> None:
        """A store's folder on another server goes with the run, as the run's scratch folder does
        here. Its server goes first: SIGTERM to the SSH client here does not reach it, so what
        lives in its namespace there (the store alone) is ended by pid, then the folder removed
        (and its parents, when empty: make cluster-test's `clean` found the run's folder left)."""
        from testbed.fabric.remote import run_on

        for root, (server, ns) in list(self.remote_roots.items()):
            script = (f"for p in $(ip netns pids {shlex.quote(ns)}); do kill $p; done; sleep 0.5; "
                      f"for p in $(ip netns pids {shlex.quote(ns)}); do kill -9 $p; done; rm -rf -- {shlex.quote(str(root))} && "
                      # store/ and the run's folder, each only if nothing else is in it
                      f"{{ rmdir -- {shlex.quote(str(root.parent))} {shlex.quote(str(root.parent.parent))} 2>/dev/null; true; }}")
            p = run_on(server, ["bash", "-c", script])
            if p.returncode != 0:
                raise RuntimeError(f"server {server.name}: could not remove the store folder {root}: "
                                   f"{(p.stderr or p.stdout).strip()[-200:]}")
            del self.remote_roots[root]

    def __enter__(self) -> "Cluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
