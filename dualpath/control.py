"""The control plane: request/reply over ZeroMQ with msgpack messages.

Every node process (host agent, engine) serves one REP socket on its own
address in the emulated compute network; the conductor holds one REQ client
per process. A request is {"cmd": name, "args": {...}}; a reply is
{"ok": true, ...result} or {"ok": false, "error": "..."}. Arguments are
validated against the handler's type hints (pydantic), so a malformed message
gets an error reply naming the field, never a crash. No pickle crosses a socket.

Authentication: in a run every control message carries the run's secret (`Auth`): the frames
of a message are [secret, payload], and a server refuses anything else before it unpacks a
byte of it. The conductor draws the secret per run and hands it to each node process on its
stdin, so it is never on a command line, in an environment or on disk.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from pydantic import ValidationError, validate_call

from dualpath.timeouts import scaled

CALL_TIMEOUT_S = scaled(120.0)  # a command's reply; longer in the VM (dualpath/timeouts.py)

MAX_MSG_BYTES = 64 << 20
# What one request may build when unpacked (replies are ours and unbounded here). Without a
# bound a 64 MiB request of empty arrays builds 64 M Python lists (about 4 GB, a minute);
# with it a request builds at most about 2 * MAX_REQUEST_ITEMS objects (~130 MB, < 1 s).
# The largest real request, a prefill_batch of long prompts, is some 10^5 token ids.
MAX_REQUEST_ITEMS = 1 << 20  # elements and containers in all, nested ones included
MAX_REQUEST_STR = 1 << 20  # bytes of one string
MAX_REQUEST_BIN = 16 << 20  # bytes of one binary (transport metadata is a few KiB)
MAX_ERROR_CHARS = 300  # an error reply is one line of at most this many characters


class ControlError(RuntimeError):
    """A remote command failed, timed out, or its process died."""


REFUSED = "refused: the message does not carry this run's secret"
SECRET_BYTES = 32


class Auth:
    """The run's secret on the wire: a message is the frames [secret, payload]; without a
    secret (None: tests and tools outside a run) it is [payload] alone."""

    def __init__(self, secret: bytes | None = None) -> None:
        if secret is not None and (not isinstance(secret, bytes) or len(secret) < 16):
            raise ValueError("a run secret is at least 16 bytes")
        self.secret = secret
        self.refused = 0  # messages refused so far

    def frames(self, payload: bytes) -> list[bytes]:
        return [self.secret, payload] if self.secret is not None else [payload]

    def payload(self, frames: list[bytes]) -> bytes | None:
        """The payload of a message that carries the secret; None (and counted) otherwise."""
        if self.secret is None:
            if len(frames) == 1:
                return frames[0]
        elif len(frames) == 2 and hmac.compare_digest(bytes(frames[0]), self.secret):
            return frames[1]
        self.refused += 1
        return None


def read_secret(stream) -> bytes:
    """A node process's run secret: one line of hex on `stream` (its stdin), then EOF.
    ValueError if there is none: a node never serves without one."""
    line = stream.readline(4 * SECRET_BYTES + 2).strip()
    try:
        secret = bytes.fromhex(line.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) < 16:
        raise ValueError("no run secret on stdin (one line of at least 32 hex digits): a node process "
                         "serves only the conductor that started it")
    return secret


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class RequestError(ValueError):
    """A request that cannot be unpacked within the bounds above, or is not a request."""


def unpack_request(data: bytes) -> Any:
    """Unpack a request (server side) within MAX_REQUEST_* bounds; RequestError otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) > MAX_MSG_BYTES:
        raise RequestError(f"a request is at most {MAX_MSG_BYTES} bytes of msgpack")
    items = [0]

    def count(obj: Any) -> Any:
        items[0] += len(obj) + 1
        if items[0] > MAX_REQUEST_ITEMS:
            raise RequestError(f"more than {MAX_REQUEST_ITEMS} items")
        return obj

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, list_hook=count, object_hook=count,
                               max_array_len=MAX_REQUEST_ITEMS, max_map_len=MAX_REQUEST_ITEMS,
                               max_str_len=MAX_REQUEST_STR, max_bin_len=MAX_REQUEST_BIN,
                               max_ext_len=0)
    except RequestError as e:
        raise RequestError(f"not a request within bounds: {e}") from None
    except Exception as e:  # msgpack raises several unrelated types (StackError on deep nesting)
        raise RequestError(f"not a msgpack message: {type(e).__name__}: {one_line(str(e), 120)}") from None


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line, at most `limit` characters (an error reply never echoes a whole request)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def short(value: Any, limit: int = 60) -> str:
    """A bounded repr of a value taken from a request."""
    from dualpath.store.errors import short_repr

    return short_repr(value, limit)


class RpcServer:
    """Serves named commands on a REP socket until `shutdown` (or a deadline)."""

    def __init__(self, endpoint: str, handlers: dict[str, Callable[..., dict | None]],
                 auth: Auth | None = None):
        self.auth = auth or Auth()
        # A handler that already validates its arguments (e.g. validate_call in strict mode, so "0"
        # or true is no int) keeps its own validation; the others get pydantic's lax one.
        self.handlers = {name: fn if hasattr(fn, "raw_function") else validate_call(fn) for name, fn in handlers.items()}
        # every process's clock, for a leader whose processes sit on several servers (each with
        # its own CLOCK_MONOTONIC): testbed/cluster/processes.py aligns them with it
        self.handlers.setdefault("clock", validate_call(lambda: {"monotonic": time.monotonic()}))
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        self.sock.bind(endpoint)

    def handle_frames(self, frames: list[bytes]) -> dict[str, Any]:
        """The reply to one message as received (its frames): refused unless it carries the
        run's secret, else `handle` of its payload."""
        payload = self.auth.payload(frames)
        if payload is None:
            return {"ok": False, "error": REFUSED}
        return self.handle(payload)

    def handle(self, payload: bytes) -> dict[str, Any]:
        """The reply to one request: never raises, and an error is one line naming the
        command and the field (bounded in length: nothing of the request is echoed whole)."""
        try:
            msg = unpack_request(payload)
        except RequestError as e:
            return {"ok": False, "error": one_line(str(e))}
        if not isinstance(msg, dict) or not isinstance(msg.get("cmd"), str):
            return {"ok": False, "error": "a request is a map with a string field 'cmd'"}
        cmd = msg["cmd"]
        fn = self.handlers.get(cmd)
        if fn is None:
            return {"ok": False, "error": one_line(f"unknown command {short(cmd)}; known: {sorted(self.handlers)}")}
        args = msg.get("args", {})
        if not isinstance(args, dict):
            return {"ok": False, "error": f"{cmd}: field 'args' must be a map, got {short(args)}"}
        bad = [k for k in args if not isinstance(k, str)]
        if bad:
            return {"ok": False, "error": f"{cmd}: argument names must be strings, got {short(bad[0])}"}
        try:
            out = fn(**args)
            if out is not None and not isinstance(out, dict):
                raise TypeError(f"handler returned {type(out).__name__}, not a map")
            return {"ok": True, **(out or {})}
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"])
            return {"ok": False, "error": one_line(f"{cmd}: field '{one_line(field, 80)}': {err['msg']}")}
        except Exception as e:  # a failed command must not take the process down
            return {"ok": False, "error": one_line(f"{cmd}: {type(e).__name__}: {e}")}

    def serve(self, max_seconds: float = 24 * 3600, idle: Callable[[], None] | None = None,
              idle_every_s: float = 0.01) -> None:
        """Serve until `shutdown` or the deadline; call `idle()` about every `idle_every_s`
        while no request is waiting (the owner's housekeeping, e.g. progressing its transport)."""
        deadline = time.monotonic() + max_seconds
        timeout_ms = max(1, int(idle_every_s * 1000)) if idle else 1000
        while time.monotonic() < deadline:
            if not self.sock.poll(timeout_ms):
                if idle:
                    idle()
                continue
            reply = self.handle_frames(self.sock.recv_multipart())
            self.sock.send(pack(reply))
            if reply.get("ok") and reply.get("shutdown"):
                break
        self.sock.close()
        self.ctx.term()


class RpcClient:
    """One REQ connection to a node process, one command at a time (asyncio)."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str, endpoint: str,
                 alive: Callable[[], bool] = lambda: True, auth: Auth | None = None):
        self.name = name
        self.endpoint = endpoint
        self.alive = alive
        self.auth = auth or Auth()
        self.lock = asyncio.Lock()
        self.sent_bytes = 0
        self.recv_bytes = 0
        self._ctx = ctx
        self._sock = self._new_socket()
        self.dead: str | None = None

    def _new_socket(self) -> zmq.asyncio.Socket:
        s = self._ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        return s

    async def call(self, cmd: str, timeout_s: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Run `cmd` remotely; raise ControlError on an error reply, a timeout or a dead process."""
        async with self.lock:
            if self.dead:
                raise ControlError(f"{self.name}: {self.dead}")
            payload = pack({"cmd": cmd, "args": args})
            self.sent_bytes += len(payload)
            await self._sock.send_multipart(self.auth.frames(payload))
            deadline = time.monotonic() + timeout_s
            while True:
                if await self._sock.poll(100):
                    data = await self._sock.recv()
                    break
                if not self.alive():
                    self._fail(f"process exited during '{cmd}'")
                if time.monotonic() > deadline:
                    self._fail(f"no reply to '{cmd}' within {timeout_s:g}s")
            self.recv_bytes += len(data)
            reply = unpack(data)
            if not reply.get("ok"):
                raise ControlError(f"{self.name}: {reply.get('error', 'unknown error')}")
            return reply

    def _fail(self, why: str) -> None:
        # A REQ socket that lost its reply can never send again: retire it.
        self.dead = why
        self._sock.close()
        raise ControlError(f"{self.name}: {why}")

    def close(self) -> None:
        if not self.dead:
            self._sock.close()


class AsyncRpcClient:
    """Many outstanding commands on one DEALER socket, replies matched by their "id" (asyncio).

    For a server that queues work itself (dualpath.nodes.read_queue): every request reaches it
    at once instead of waiting here for the one before it.
    """

    def __init__(self, ctx: zmq.asyncio.Context, name: str, endpoint: str,
                 alive: Callable[[], bool] = lambda: True, auth: Auth | None = None):
        self.name, self.endpoint, self.alive = name, endpoint, alive
        self.auth = auth or Auth()
        self.sent_bytes = 0
        self.recv_bytes = 0
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    async def call(self, cmd: str, timeout_s: float = CALL_TIMEOUT_S, **args: Any) -> dict[str, Any]:
        """Run `cmd` remotely; raise ControlError on an error reply, a timeout or a dead process."""
        if self._reader is None:
            self._reader = asyncio.ensure_future(self._read())
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = fut
        payload = pack({"cmd": cmd, "args": args, "id": rid})
        self.sent_bytes += len(payload)
        await self._sock.send_multipart([b"", *self.auth.frames(payload)])
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    reply = await asyncio.wait_for(asyncio.shield(fut), 0.1)
                    break
                except asyncio.TimeoutError:
                    if not self.alive():
                        raise ControlError(f"{self.name}: process exited during '{cmd}'") from None
                    if time.monotonic() > deadline:
                        raise ControlError(f"{self.name}: no reply to '{cmd}' within {timeout_s:g}s") from None
        finally:
            self._waiting.pop(rid, None)
        if not reply.get("ok"):
            raise ControlError(f"{self.name}: {reply.get('error', 'unknown error')}")
        return reply

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            self.recv_bytes += len(frames[-1])
            try:
                reply = unpack(frames[-1])
            except Exception:
                continue  # not ours to answer; the caller's timeout covers it
            fut = self._waiting.get(reply.get("id")) if isinstance(reply, dict) else None
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close()


class RouterServer:
    """Many outstanding commands on one ROUTER socket, answered by id when each is done.

    For work that takes long and must not block a node's other requests (a store read, a wait
    for a peer's notifications, a write-back): each command is checked as it arrives (`admit`,
    if given, may refuse it or count it), queued, run by one of `workers` threads in arrival
    order, and answered with its request's "id" (dualpath.control.AsyncRpcClient matches them).
    One worker keeps commands strictly in order, as a node's one SNIC reads them.
    """

    def __init__(self, endpoint: str, handlers: dict[str, Callable[..., dict | None]], workers: int = 1,
                 admit: Callable[[str, dict], None] | None = None,
                 done: Callable[[str, dict], None] | None = None, name: str = "router",
                 auth: Auth | None = None) -> None:
        """`admit(cmd, args)` runs on arrival (raise ValueError to refuse); `done(cmd, args)` after
        the command ran, whatever its outcome."""
        self.endpoint, self.name = endpoint, name
        self.auth = auth or Auth()
        self.handlers = {cmd: fn if hasattr(fn, "raw_function") else validate_call(fn)  # as RpcServer does
                         for cmd, fn in handlers.items()}
        self.workers, self._admit, self._done = workers, admit, done
        self._work: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._done_ep = f"inproc://{name}-{id(self)}"

    def start(self, max_seconds: float = 24 * 3600) -> "RouterServer":
        self._ctx = zmq.Context()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(max_seconds, ready), name=self.name, daemon=True).start()
        ready.wait(10)
        for i in range(self.workers):
            threading.Thread(target=self._worker, name=f"{self.name}-worker{i}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for _ in range(self.workers):
            self._work.put(None)

    # -- serving thread: owns the ROUTER socket ------------------------------------------------
    def _serve(self, max_seconds: float, ready: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        sock.bind(self.endpoint)
        done = self._ctx.socket(zmq.PULL)
        done.bind(self._done_ep)
        ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(done, zmq.POLLIN)
        deadline = time.monotonic() + max_seconds
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                events = dict(poller.poll(200))
                while done in events and done.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    ident, reply = unpack(done.recv())
                    sock.send_multipart([ident, b"", pack(reply)])
                while sock in events and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = sock.recv_multipart()
                    body = frames[2:] if len(frames) > 1 and frames[1] == b"" else frames[1:]
                    payload = self.auth.payload(body)
                    reply = (self._accept(payload, frames[0]) if payload is not None
                             else {"ok": False, "id": None, "error": REFUSED})
                    if reply is not None:  # refused at once; accepted commands reply from a worker
                        sock.send_multipart([frames[0], b"", pack(reply)])
        finally:
            sock.close()
            done.close()

    def _accept(self, payload: bytes, ident: bytes) -> dict | None:
        """Queue a command, or the one-line error reply to send at once."""
        try:
            msg = unpack_request(payload)
        except RequestError as e:
            return {"ok": False, "id": None, "error": one_line(str(e))}
        rid = msg.get("id") if isinstance(msg, dict) else None
        if type(rid) is not int:  # replies are matched by an integer id; echo nothing else
            rid = None
        cmd = msg.get("cmd") if isinstance(msg, dict) else None
        if not isinstance(cmd, str) or cmd not in self.handlers or not isinstance(msg.get("args", {}), dict):
            return {"ok": False, "id": rid, "error": one_line(f"this socket serves {{'cmd': one of "
                                                              f"{sorted(self.handlers)}, 'args': {{...}}, 'id': ...}}")}
        args = msg.get("args", {})
        if any(not isinstance(k, str) for k in args):
            return {"ok": False, "id": rid, "error": f"{cmd}: argument names must be strings"}
        try:
            if self._admit is not None:
                self._admit(cmd, args)
        except (ValueError, TypeError) as e:
            return {"ok": False, "id": rid, "error": one_line(f"{cmd}: {e}")}
        self._work.put((ident, rid, cmd, args))
        return None

    # -- workers: commands in arrival order ------------------------------------------------------
    def _worker(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._done_ep)
        try:
            while (item := self._work.get()) is not None:
                ident, rid, cmd, args = item
                try:
                    reply = {"ok": True, "id": rid, **(self.handlers[cmd](**args) or {})}
                except ValidationError as e:
                    err = e.errors()[0]
                    field = one_line(".".join(map(str, err["loc"])), 80)
                    reply = {"ok": False, "id": rid, "error": one_line(f"{cmd}: field '{field}': {err['msg']}")}
                except Exception as e:  # a failed command must not take the server down
                    reply = {"ok": False, "id": rid, "error": one_line(f"{cmd}: {type(e).__name__}: {e}")}
                finally:
                    if self._done is not None:
                        self._done(cmd, args)
                push.send(pack([ident, reply]))
        finally:
            push.close()
