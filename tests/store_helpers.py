"""What the store's tests share: servers on loopback, and raw access to their files and wire."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from dualpath.store.protocol import pack_frame, recv_header
from emulators.kvstore.server import StoreServer


@pytest.fixture
def make_server(tmp_path: Path):
    """Start store servers under tmp_path; all are stopped at the end of the test."""
    started: list[StoreServer] = []

    def make(name: str = "s0", capacity: int = 1 << 30, **kw) -> StoreServer:
        srv = StoreServer(tmp_path / name, capacity, ("127.0.0.1", 0), **kw)
        srv.start()
        started.append(srv)
        return srv

    try:
        yield make
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture
def server(make_server) -> StoreServer:
    return make_server()


def block_path(srv: StoreServer, key: str) -> Path:
    return srv.store.blocks_dir / key[:2] / key


def raw_request(addr, header: dict, payload: bytes = b"") -> dict:
    with socket.create_connection(addr, timeout=10) as s:
        s.sendall(pack_frame(header) + payload)
        reply = recv_header(s)
        assert reply is not None
        return reply
