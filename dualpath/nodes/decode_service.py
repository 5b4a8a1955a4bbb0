"""A decode engine's loop: control commands, decode requests and the batch, on one thread.

One thread owns the engine's transport agent (NIXL's UCX worker is not shared across threads
here), so one loop does everything: it answers control commands on the REP socket, takes
decode requests on a ROUTER socket (many outstanding, each answered when its request is done,
matched by id as in dualpath/nodes/read_queue.py), starts their loads, runs a decode step
whenever the batch has work and the previous step's window has ended, and progresses the
transport when idle so that peers' endpoints settle.
"""
from __future__ import annotations

import os
import time
from typing import Callable

import numpy as np
import zmq
from pydantic import ValidationError, validate_call

from dualpath.nodes.leader import EngineLoad
from dualpath.kv.buffers import ByteAllocator
from dualpath.control import MAX_MSG_BYTES, REFUSED, Auth, RpcServer, pack, unpack
from dualpath.kv.decode_connector import BufferDecodeConnector, DecodePlan, OracleDecodeConnector
from dualpath.kv.plugin import CheckedDecode, ConnectorPlugin, connector_name
from dualpath.engines.clock import DeviceClock
from dualpath.engines.collective import CollectiveGroup
from dualpath.engines.decode import DecodeBatcher, DecodeJob
from dualpath.kv.spans import Span
from dualpath.kv.layouts import BlockGeometry
from dualpath.model import Transformer
from dualpath.scheduler.cost_model import DecodeCostModel
from dualpath.scheduler.hbm import DecodeHbm

IDLE_POLL_S = 0.01  # how often an idle engine progresses its transport
BUSY_POLL_S = 0.001  # while loads or saves are in flight


@validate_call
def _decode_args(request: str, n_prompt: int, first_token: int, t_first_token: float, gen_len: int,
                 first_new_block: int, src: dict | None = None, wb: dict | None = None,
                 expect_crcs: list[int] | None = None) -> dict:
    if n_prompt < 1 or gen_len < 1 or first_new_block < 0:
        raise ValueError("n_prompt and gen_len must be >= 1, first_new_block >= 0")
    return dict(request=request, n_prompt=n_prompt, first_token=first_token, t_first_token=t_first_token,
                gen_len=gen_len, first_new_block=first_new_block, src=src, wb=wb, expect_crcs=expect_crcs)


class DecodeService:
    def __init__(self, model: Transformer, agent, hbm: np.ndarray, alloc: ByteAllocator, geom: BlockGeometry,
                 load: EngineLoad, clock: DeviceClock, cost: DecodeCostModel | None, control: str, decode: str,
                 handlers: dict[str, Callable[..., dict | None]], max_seconds: float = 24 * 3600,
                 collective: CollectiveGroup | None = None, auth: Auth | None = None,
                 plugin: type[ConnectorPlugin] | None = None, hbm_budget: DecodeHbm | None = None) -> None:
        self.agent, self.hbm, self.alloc, self.geom, self.load = agent, hbm, alloc, geom, load
        self.plugin = plugin  # a team's decode connector, if it has one (dualpath/kv/plugin.py)
        self.auth = auth or Auth()
        self.batcher = DecodeBatcher(model, geom, clock, cost, collective, hbm_budget)
        self.rpc = RpcServer(control, {**handlers, "steps": self._steps}, auth=self.auth)
        self.ctx = zmq.Context()
        self.jobs = self.ctx.socket(zmq.ROUTER)
        self.jobs.setsockopt(zmq.LINGER, 0)
        self.jobs.setsockopt(zmq.MAXMSGSIZE, MAX_MSG_BYTES)
        self.jobs.bind(decode)
        self.max_seconds = max_seconds

    def _steps(self) -> dict:
        """The decode steps run since the last call (the conductor collects them per mode)."""
        out, self.batcher.step_log = self.batcher.step_log, []
        return {"steps": out}

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.rpc.sock, zmq.POLLIN)
        poller.register(self.jobs, zmq.POLLIN)
        b = self.batcher
        if b.wake_fd is not None:  # a step whose collectives ended
            poller.register(b.wake_fd, zmq.POLLIN)
        deadline = time.monotonic() + self.max_seconds
        try:
            while time.monotonic() < deadline:
                if b.wants_step():
                    timeout = 0.0
                else:  # loads and saves progress only when polled
                    timeout = BUSY_POLL_S if (b.loading or b.finishing) else IDLE_POLL_S
                    due = b.step_due_in()
                    if due is not None:
                        timeout = min(timeout, due)
                events = dict(poller.poll(int(timeout * 1000)))
                if b.wake_fd is not None and b.wake_fd in events:
                    os.read(b.wake_fd, 64)
                if self.rpc.sock in events:
                    reply = self.rpc.handle_frames(self.rpc.sock.recv_multipart())
                    self.rpc.sock.send(pack(reply))
                    if reply.get("ok") and reply.get("shutdown"):
                        return
                while self.jobs.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._accept(self.jobs.recv_multipart())
                for job in b.poll():
                    self._answer(job)
                if b.wants_step():
                    b.begin_step()
                elif b.idle:
                    self.agent.progress()
        finally:
            self.jobs.close()
            self.ctx.term()

    def _accept(self, frames: list[bytes]) -> None:
        ident = frames[0]
        body = frames[2:] if len(frames) > 1 and frames[1] == b"" else frames[1:]
        payload = self.auth.payload(body)
        if payload is None:
            self.jobs.send_multipart([ident, b"", pack({"ok": False, "id": None, "error": REFUSED})])
            return
        try:
            msg = unpack(payload)
        except Exception as e:
            self.jobs.send_multipart([ident, b"", pack({"ok": False, "id": None, "error": f"not msgpack: {e}"})])
            return
        rid = msg.get("id") if isinstance(msg, dict) else None
        try:
            if not isinstance(msg, dict) or msg.get("cmd") != "decode" or not isinstance(msg.get("args"), dict):
                raise ValueError("the decode socket serves {'cmd': 'decode', 'args': {...}, 'id': ...}")
            a = _decode_args(**msg["args"])
            plan = DecodePlan(a["request"], a["n_prompt"], a["gen_len"], a["first_new_block"],
                              Span.from_msg(a["src"]) if a["src"] else None,
                              Span.from_msg(a["wb"]) if a["wb"] else None,
                              tuple(a["expect_crcs"]) if a["expect_crcs"] is not None else None)
        except (ValidationError, ValueError, TypeError, KeyError) as e:
            why = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
            self.jobs.send_multipart([ident, b"", pack({"ok": False, "id": rid, "error": f"decode: {why}"})])
            return
        try:
            conn = self._connector(plan)
        except Exception as e:  # a plug-in's constructor: the request fails, the engine serves on
            self.jobs.send_multipart([ident, b"", pack({"ok": False, "id": rid, "error": (
                f"request {plan.request}: decode connector: {type(e).__name__}: {' '.join(str(e).split())[:200]}")})])
            return
        self.batcher.admit(DecodeJob(plan, a["first_token"], a["t_first_token"], conn, reply=(ident, rid)))

    def _connector(self, plan: DecodePlan):
        args = (self.agent, self.hbm, self.alloc, self.geom)
        device = self.batcher.model.device
        if plan.src is None:
            return OracleDecodeConnector(*args, device=device)
        if self.plugin is not None and self.plugin.decode is not None:
            return CheckedDecode(self.plugin.decode(*args, device=device), self.geom)
        return BufferDecodeConnector(*args, device=device)

    def _answer(self, job: DecodeJob) -> None:
        ident, rid = job.reply
        self.load.finished(job.plan.request)
        if job.error:
            reply = {"ok": False, "id": rid, "error": f"request {job.plan.request}: {job.error}"}
        else:
            s = job.conn.stats
            reply = {"ok": True, "id": rid, "tokens": job.tokens, "token_times": job.token_times,
                     "written_blocks": s.written_blocks, "block_crcs": s.block_crcs,
                     "layer_hashes": s.layer_hashes, "read_bytes": s.read_bytes,
                     "written_bytes": s.written_bytes, "reread_bytes": s.reread_bytes,
                     "connector": connector_name(job.conn)}
        self.jobs.send_multipart([ident, b"", pack(reply)])
