"""A node's read queue: loads counted on arrival, run in order, errors answered (loopback)."""
import asyncio
import socket
import threading

import pytest
import zmq.asyncio

from dualpath.nodes.read_queue import ReadQueueServer
from dualpath.control import AsyncRpcClient, ControlError

BLOCK = 1000


def _endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
def queue_server():
    gate = threading.Event()
    order: list[str] = []

    def load(keys: list[str], offset: int) -> dict:
        gate.wait(10)  # the SNIC is busy until the test lets it go
        if keys[0] == "bad":
            raise FileNotFoundError(f"no block {keys[0]}")
        order.append(keys[0])
        return {"bytes": len(keys) * BLOCK}

    server = ReadQueueServer(_endpoint(), BLOCK, load).start()
    yield server, gate, order
    gate.set()
    server.stop()


def test_waiting_loads_count_in_read_q_and_run_in_arrival_order(queue_server):
    server, gate, order = queue_server

    async def go():
        ctx = zmq.asyncio.Context()
        client = AsyncRpcClient(ctx, "host", server.endpoint)
        calls = [asyncio.ensure_future(client.call("load", keys=[f"k{i}"] * (i + 1), offset=0, timeout_s=10))
                 for i in range(3)]
        for _ in range(100):  # all three arrive although none has finished
            if server.pending_bytes == 6 * BLOCK:
                break
            await asyncio.sleep(0.01)
        seen = server.pending_bytes
        gate.set()
        replies = await asyncio.gather(*calls)
        client.close()
        ctx.term()
        return seen, replies

    seen, replies = asyncio.run(go())
    assert seen == 6 * BLOCK
    assert [r["bytes"] for r in replies] == [1000, 2000, 3000]  # each caller got its own reply
    assert order == ["k0", "k1", "k2"]
    assert server.pending_bytes == 0


def test_bad_requests_and_failed_loads_get_errors_and_free_the_queue(queue_server):
    server, gate, _ = queue_server
    gate.set()

    async def go():
        ctx = zmq.asyncio.Context()
        client = AsyncRpcClient(ctx, "host", server.endpoint)
        errors = []
        for args in ({"keys": "k0", "offset": 0}, {"keys": ["k0"]}, {"keys": ["bad"], "offset": 0}):
            with pytest.raises(ControlError) as e:
                await client.call("load", timeout_s=5, **args)
            errors.append(str(e.value))
        with pytest.raises(ControlError, match="serves"):
            await client.call("flush", timeout_s=5)
        ok = await client.call("load", keys=["k1"], offset=0, timeout_s=5)
        client.close()
        ctx.term()
        return errors, ok

    errors, ok = asyncio.run(go())
    assert "field 'keys'" in errors[0]
    assert "offset" in errors[1]
    assert "no block bad" in errors[2]
    assert ok["bytes"] == BLOCK
    assert server.pending_bytes == 0


def test_a_router_server_answers_each_command_when_it_is_done_not_in_order():
    from dualpath.control import RouterServer

    release = {name: threading.Event() for name in ("slow", "fast")}

    def wait_for(name: str) -> dict:
        release[name].wait(10)
        return {"name": name}

    server = RouterServer(_endpoint(), {"wait_for": wait_for}, workers=2).start()

    async def go():
        ctx = zmq.asyncio.Context()
        client = AsyncRpcClient(ctx, "host", server.endpoint)
        slow = asyncio.ensure_future(client.call("wait_for", name="slow", timeout_s=10))
        fast = asyncio.ensure_future(client.call("wait_for", name="fast", timeout_s=10))
        await asyncio.sleep(0.05)
        release["fast"].set()
        first = (await asyncio.wait_for(fast, 5))["name"]
        assert not slow.done()  # the slow one does not hold up the fast one
        release["slow"].set()
        second = (await slow)["name"]
        with pytest.raises(ControlError, match="field 'name'"):
            await client.call("wait_for", name=3, timeout_s=5)
        with pytest.raises(ControlError, match="serves"):
            await client.call("nope", timeout_s=5)
        client.close()
        ctx.term()
        return first, second

    try:
        assert asyncio.run(go()) == ("fast", "slow")
    finally:
        server.stop()


def test_many_waiters_on_one_inbox_get_their_own_notifications():
    from dualpath.transport.base import NotificationInbox, TransferTimeout
    from dualpath.transport.waiter import NotificationWaiter

    class Inbox(NotificationInbox):
        name, timeout_s = "host", 5.0

        def __init__(self):
            self._notifs, self.arrived, self.lock = {}, [], threading.Lock()

        def _pull_notifs(self):
            with self.lock:
                for peer, msg in self.arrived:
                    self._notifs.setdefault(peer, []).append(msg)
                self.arrived.clear()

    inbox = Inbox()
    waiter = NotificationWaiter(inbox)
    got: dict[str, bool] = {}

    def wait(peer, msg):
        waiter.wait(peer, msg, 5.0)
        got[msg] = True

    threads = [threading.Thread(target=wait, args=("pe", f"r{i}/L0")) for i in range(8)]
    for t in threads:
        t.start()
    with inbox.lock:
        inbox.arrived += [("pe", f"r{i}/L0".encode()) for i in reversed(range(8))]
    for t in threads:
        t.join(5)
    assert sorted(got) == sorted(f"r{i}/L0" for i in range(8))
    with pytest.raises(TransferTimeout, match="r9/L0"):
        waiter.wait("pe", "r9/L0", 0.05)
    waiter.close()
