"""The servers of a topology spread over several (DESIGN.md section 12, docs/cluster.md): each
server's entry and the rules `servers:` and `place:` obey together. testbed/placement.py works
out what they imply; testbed/fabric/remote.py reaches the servers."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from testbed.topology_file import _short_name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


SERVER_NAME = r"^[a-z][a-z0-9-]{0,15}$"


class ServerSpec(_Strict):
    """One Linux server of a topology spread over several (DESIGN.md section 12). The first is the
    machine `dualpath` runs on (no `ssh`); the others are reached over SSH as root."""

    name: str = Field(pattern=SERVER_NAME)
    # An SSH destination, [user@]host. No leading '-': the value goes on ssh's command line.
    ssh: str | None = Field(default=None, min_length=1, max_length=255, pattern=r"^[A-Za-z0-9_.@:%\[\]-]+$")
    port: int | None = Field(default=None, ge=1, le=65535)
    identity_file: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^/[^\s]*$")
    # A known_hosts file that holds the server's host key: then ssh checks it strictly (default:
    # root's own, where a first contact adds the key).
    known_hosts: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^/[^\s]*$")
    # The venv's python on that server (default: the same path as here). The checkout must be at
    # the same path on every server.
    python: str | None = Field(default=None, min_length=1, max_length=1024, pattern=r"^/[^\s]*$")
    # The IPv4 address the other servers' tunnels reach it at (default: the ssh host's).
    address: str | None = Field(default=None, pattern=r"^\d{1,3}(\.\d{1,3}){3}$")
    # The physical NIC that carries the tunnels, in Gbit/s (real units, not scaled), and the
    # path MTU between servers on it.
    nic_gbps: float = Field(default=1.0, gt=0, le=1600)
    mtu: int = Field(default=1500, ge=576, le=65535)

    @field_validator("ssh")
    @classmethod
    def _not_an_option(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("-"):
            raise ValueError("an ssh destination cannot start with '-'")
        return v


def unit_names(prefill_nodes: int, decode_nodes: int, storage_servers: int) -> list[str]:
    """What `place:` can put on a server: every node (its host and engine namespaces go
    together) and every storage server, by their short names."""
    return ([f"p{i}" for i in range(prefill_nodes)] + [f"d{i}" for i in range(decode_nodes)]
            + [f"s{i}" for i in range(storage_servers)])


def check_placement(spec: Any) -> None:
    """Raise ValueError (one line) unless a TopologySpec's servers and place agree: this machine
    first and only it without ssh, names and destinations distinct, every placed name a node or
    storage server of the topology and every target a listed server."""
    if not spec.servers:
        if spec.place:
            raise ValueError("place: needs a servers: list")
        return
    names = [v.name for v in spec.servers]
    if len(set(names)) != len(names):
        raise ValueError(f"two servers are named {next(n for n in names if names.count(n) > 1)!r}")
    if spec.servers[0].ssh is not None or any(v.ssh is None for v in spec.servers[1:]):
        raise ValueError("the first server is this machine (no ssh) and every other one has ssh")
    dests = [(v.ssh, v.port) for v in spec.servers[1:]]
    if len(set(dests)) != len(dests):
        raise ValueError("two servers have the same ssh destination and port")
    if spec.hosts != "namespaces":
        raise ValueError("servers: works with hosts: namespaces only")
    units = unit_names(spec.prefill_nodes, spec.decode_nodes, spec.storage.servers)
    for unit, server in spec.place.items():
        if unit not in units:
            raise ValueError(f"place names {_short_name(unit)!r}, which is not a node or storage server here "
                             f"({', '.join(units[:8])}{' ...' if len(units) > 8 else ''})")
        if server not in names:
            raise ValueError(f"place puts {unit} on {_short_name(server)!r}, which is not in servers "
                             f"({', '.join(names)})")
