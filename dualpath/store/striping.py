"""Which storage server holds a block.

Keys are uniform hashes, so the key's leading 64 bits modulo the server count
spread blocks evenly with no state. The order of the server list is therefore
part of the store's configuration (the topology lists storage servers in a fixed
order); addresses may change (a restarted server on a new port) without moving
any block.
"""
from __future__ import annotations

from typing import Iterable

from .keys import check_key


def server_index(key: str, n_servers: int) -> int:
    if n_servers <= 0:
        raise ValueError("need at least one server")
    return int(check_key(key)[:16], 16) % n_servers


def group_by_server(keys: Iterable[str], n_servers: int) -> dict[int, list[int]]:
    """Positions of `keys`, grouped by server index (order kept within a group)."""
    groups: dict[int, list[int]] = {}
    for pos, key in enumerate(keys):
        groups.setdefault(server_index(key, n_servers), []).append(pos)
    return groups
