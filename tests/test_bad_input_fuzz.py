"""A seeded corpus of malformed inputs across every input the testbed takes before bring-up:
topology YAML files, Mooncake trace lines, store wire frames (sent to a live server on
loopback), control-plane messages (RpcServer.handle with the host agent's checks, and the read
queue's ROUTER handling, in-process) and `dualpath topo` / `dualpath run` arguments (the
validation function; a handful through the real CLI in a child process, bring-up guarded).

Every case must get a clear one-line error naming its source (the file and line, the field,
the command or the option), within CASE_SECONDS, within bounded memory, and the service it hit
must answer a valid request afterwards. The corpus is deterministic (SEED). Set DPT_FUZZ_REPORT
to a path to get the per-category counts as JSON.
"""
from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import socket
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import pytest
import typer

from dualpath.store import chain_keys
from dualpath.store.checksum import WRITE_ALGO, checksum
from dualpath.store.protocol import pack_frame, recv_header
from tests.conftest import REPO

SEED = 20260514
CASE_SECONDS = 2.0
CASE_BYTES = 128 << 20  # peak traced Python memory of one in-process case
GOOD_TOPO = (REPO / "topologies" / "1p1d.yaml").read_text()
RESULTS: dict[str, dict[str, int]] = {}


def record(category: str, outcomes: list[tuple[str, str | None]]) -> None:
    """Keep the category's counts; fail listing every case that did not get a clean error."""
    bad = [(name, why) for name, why in outcomes if why is not None]
    RESULTS[category] = {"cases": len(outcomes), "clean": len(outcomes) - len(bad)}
    report = os.environ.get("DPT_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps(RESULTS, indent=2) + "\n")
    assert not bad, f"{len(bad)} of {len(outcomes)} {category} cases without a clean error: {bad[:5]}"


def one_line(msg: str, *must: str, limit: int = 600) -> str | None:
    """None if `msg` is a clean error (one line, bounded, naming each of `must`), else why not."""
    if not msg:
        return "empty message"
    if "\n" in msg or "\r" in msg:
        return f"more than one line: {msg[:200]!r}"
    if len(msg) > limit:
        return f"{len(msg)} characters"
    if "Traceback" in msg:
        return "a traceback"
    for m in must:
        if m not in msg:
            return f"does not name {m!r}: {msg[:200]}"
    return None


def bounded(fn: Callable[[], str | None], trace_memory: bool = True) -> str | None:
    """Run one case: its own verdict, or why it broke the time or memory bound."""
    if trace_memory:
        tracemalloc.start()
    t0 = time.monotonic()
    try:
        why = fn()
    except Exception as e:  # noqa: BLE001 - any escape is a finding
        why = f"raised {type(e).__name__}: {str(e)[:200]}"
    took = time.monotonic() - t0
    peak = 0
    if trace_memory:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    if why is None and took > CASE_SECONDS:
        why = f"took {took:.2f} s"
    if why is None and peak > CASE_BYTES:
        why = f"peak {peak >> 20} MiB"
    return why


# ---- topologies -----------------------------------------------------------
TOPO_FIELDS = ["name", "scale", "prefill_nodes", "decode_nodes", "engines_per_node", "cnic_gbps", "snic_ratio",
               "dram_gbps", "dram_buffer_gib", "hbm_gib_per_engine", "qos", "mtu", "compute"]
BAD_VALUES = ["-1", "0", ".inf", "-.inf", ".nan", "1.0e+308", "1.0e-300", "'str'", "[]", "{}", "null", "true",
              "9" * 40, "9" * 5000, "x" * 5000, "[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]", "!!binary aGk=",
              "2001-01-01", "0x7fffffffffffffffffff", "1e999", "-0.0", "'\\u0000'"]
FIELD_OK = {"name": {"'str'", "1e999"}, "qos": {"true"}, "compute": set()}  # values valid for that field


def topology_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    cases: list[tuple[str, bytes]] = []
    lines = GOOD_TOPO.splitlines()
    for field in TOPO_FIELDS:  # every field with values it cannot take
        for v in rng.sample(BAD_VALUES, 6):
            if v in FIELD_OK.get(field, set()) or (field == "name" and v.startswith("'") and "u0000" not in v):
                continue
            text = "\n".join(f"{field}: {v}" if ln.startswith(f"{field}:") else ln for ln in lines)
            cases.append((f"{field}={v[:20]}", text.encode()))
    for sub in ("servers", "disk_gbps", "nic_gbps"):
        for v in rng.sample(BAD_VALUES[:12], 3):
            text = "\n".join(f"  {sub}: {v}" if ln.startswith(f"  {sub}:") else ln for ln in lines)
            cases.append((f"storage.{sub}={v[:20]}", text.encode()))
    storage_at = GOOD_TOPO.index("storage:")
    for i in range(10):  # cut before storage: a required field is always missing
        cut = rng.randrange(0, storage_at)
        cases.append((f"truncated@{cut}", GOOD_TOPO[:cut].encode()))
    for i in range(10):  # a byte that is not UTF-8
        raw = bytearray(GOOD_TOPO.encode())
        raw[rng.randrange(len(raw))] = rng.choice([0xFF, 0xC3, 0x80, 0xFE])
        cases.append((f"non-utf8-{i}", bytes(raw)))
    for depth in (20, 500, 50_000):
        cases.append((f"nested-{depth}", (GOOD_TOPO + "\ndescription: " + "[" * depth + "]" * depth).encode()))
    bomb = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    bomb += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    cases.append(("alias-bomb", (GOOD_TOPO + "\nb:\n" + "\n".join("  " + x for x in bomb)).encode()))
    cases.append(("recursive-alias", b"a: &a [*a]\n"))
    cases.append(("duplicate", (GOOD_TOPO + "\nscale: 0.5\n").encode()))
    cases.append(("unknown-field", (GOOD_TOPO + "\ncnic_gpbs: 400\n").encode()))
    cases.append(("list", b"- 1\n- 2\n"))
    cases.append(("empty", b""))
    cases.append(("tabs", b"name:\t\t[1p1d\n"))
    cases.append(("big", (GOOD_TOPO + "#" * (1 << 17)).encode()))
    cases.append(("binary", bytes(rng.randrange(256) for _ in range(300))))
    cases.append(("python-tag", (GOOD_TOPO + "\nx: !!python/object/apply:os.system [id]\n").encode()))
    return cases


def test_fuzz_topologies(tmp_path):
    from testbed.topology import TopologyError, load_topology

    rng = random.Random(SEED)
    outcomes = []
    special = [("fifo", None), ("dev-zero", Path("/dev/zero")), ("directory", tmp_path), ("missing", tmp_path / "no")]
    for i, (name, data) in enumerate(topology_cases(rng) + special):  # type: ignore[operator]
        if isinstance(data, bytes):
            path = tmp_path / f"case{i:03d}.yaml"
            path.write_bytes(data)
        elif name == "fifo":
            path = tmp_path / "case.fifo"
            os.mkfifo(path)
        else:
            path = data

        def case(path: Path = path) -> str | None:
            try:
                load_topology(path)
            except TopologyError as e:
                return one_line(str(e), str(path), "fix:")
            return "accepted"

        outcomes.append((name, bounded(case)))
    assert len(outcomes) >= 100
    record("topology files", outcomes)


# ---- traces ---------------------------------------------------------------
TRACE_ROW = {"timestamp": 10, "input_length": 1300, "output_length": 20, "hash_ids": [3, 4, 5]}
TRACE_BAD = {"timestamp": [-1, "0", None, True, 1e300, [], {}], "input_length": [0, -5, 1.5, "7", None, 10**12, True],
             "output_length": [-1, 0.5, "x", None, 10**9], "hash_ids": ["0,1", [-1], [1.5], [2**64], [[1]], None,
                                                                           list(range(10)), {"a": 1}]}


def trace_cases(rng: random.Random) -> list[tuple[str, str]]:
    cases = []
    for field, values in TRACE_BAD.items():
        for v in values:
            cases.append((f"{field}={str(v)[:20]}", json.dumps({**TRACE_ROW, field: v})))
        cases.append((f"no-{field}", json.dumps({k: x for k, x in TRACE_ROW.items() if k != field})))
    good = json.dumps(TRACE_ROW)
    for i in range(20):  # a JSON object cut anywhere is no longer JSON
        cut = rng.randrange(1, len(good) - 1)
        cases.append((f"cut@{cut}", good[:cut]))
    for i in range(10):
        cases.append((f"junk-{i}", "".join(chr(rng.randrange(33, 127)) for _ in range(rng.randrange(1, 80)))))
    cases += [("deep-array", "[" * 100_000), ("deep-object", '{"a":' * 50_000 + "1" + "}" * 50_000),
              ("huge-int", '{"timestamp": 0, "input_length": ' + "9" * 5000 + "}"),
              ("long-line", json.dumps({**TRACE_ROW, "pad": "x" * (2 << 20)})), ("string", '"row"'),
              ("number", "12"), ("nan", '{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}'),
              ("null", "null"), ("array", "[1, 2, 3]")]
    return cases


def test_fuzz_traces(tmp_path):
    from dualpath.workload.mooncake import TraceError, load_mooncake

    rng = random.Random(SEED + 1)
    outcomes = []
    for i, (name, line) in enumerate(trace_cases(rng)):
        path = tmp_path / f"t{i:03d}.jsonl"
        path.write_text(json.dumps(TRACE_ROW) + "\n" + line + "\n")

        def case(path: Path = path) -> str | None:
            try:
                load_mooncake(path)
            except TraceError as e:
                return one_line(str(e), f"{path}:2:")
            return "accepted"

        outcomes.append((name, bounded(case)))
    for name, path in (("binary-lines", tmp_path / "bin.jsonl"), ("dev-zero", Path("/dev/zero"))):
        if name == "binary-lines":
            path.write_bytes(json.dumps(TRACE_ROW).encode() + b"\n\xff\xfe\x00\n")

        def case(path: Path = path) -> str | None:
            try:
                load_mooncake(path)
            except TraceError as e:
                return one_line(str(e), str(path))
            return "accepted"

        outcomes.append((name, bounded(case)))
    assert len(outcomes) >= 70
    record("trace lines", outcomes)


# ---- store frames ---------------------------------------------------------
BB = 4096
KEYS = chain_keys(np.arange(64), 4, namespace=b"fuzz")
BAD_IDS = [None, "1", 1.5, True, -5, 2**63, [1], {"a": 1}]
BAD_KEYS = [None, 5, "", "../../etc/passwd", KEYS[0].upper(), KEYS[0][:-1], KEYS[0] + "0", "/" + KEYS[0][1:],
            "x" * 60_000, [KEYS[0]], b"\x00" * 16, ".tmp-" + KEYS[0][5:]]
BAD_N = [-1, "5", 1.5, True, 2**63, 1 << 40]


def store_cases(rng: random.Random) -> list[tuple[str, bytes]]:
    data = bytes(range(256)) * (BB // 256)
    put = {"op": "put", "id": 1, "key": KEYS[1], "n": BB, "crc": checksum(data), "algo": WRITE_ALGO}
    cases: list[tuple[str, bytes]] = []

    def frame(h: dict, payload: bytes = b"") -> bytes:
        return pack_frame(h) + payload

    for v in BAD_IDS:
        cases.append((f"id={str(v)[:12]}", frame({"op": "stat", "id": v})))
    for op in ("get", "delete"):
        for k in BAD_KEYS:
            cases.append((f"{op} key={str(k)[:12]}", frame({"op": op, "id": 3, "key": k})))
    for k in rng.sample(BAD_KEYS, 6):
        cases.append((f"put key={str(k)[:12]}", frame({**put, "key": k}, data)))
    for n in BAD_N:
        cases.append((f"put n={str(n)[:12]}", frame({**put, "n": n}, data)))
    for n in (0, 1, BB - 1, BB + 1):
        cases.append((f"put size {n}", frame({**put, "n": n}, b"\0" * n)))
    for crc in ("x", -1, 1 << 32, None, 1.0, True, 12345):
        cases.append((f"put crc={crc}", frame({**put, "crc": crc}, data)))
    for algo in (1, 0, 3, None, "crc32c", True):
        cases.append((f"put algo={algo}", frame({**put, "algo": algo}, data)))
    for keys in ([], None, "k", KEYS[:1] * 129, [5], [None, None], ["../x"] * 3):
        cases.append((f"mget keys={str(keys)[:12]}", frame({"op": "mget", "id": 5, "keys": keys})))
    for keys, verify in ((None, False), ("k", False), (KEYS[:1] * 1025, False), (KEYS[:1] * 129, True),
                         (KEYS[:2], "yes"), (KEYS[:2], 1), ([7], False)):
        cases.append((f"has keys={str(keys)[:12]} verify={verify}", frame({"op": "has", "id": 6, "keys": keys, "verify": verify})))
    for op in (None, 5, "", "PUT", "x" * 50_000, ["get"], "stat\n"):
        cases.append((f"op={str(op)[:12]}", frame({"op": op, "id": 7})))
    cases.append(("get with payload", frame({"op": "get", "id": 8, "key": KEYS[0], "n": 10}, b"x" * 10)))
    # Frames that are not frames.
    cases.append(("length 2^31", struct.pack(">I", 1 << 31)))
    cases.append(("length 0", struct.pack(">I", 0)))
    cases.append(("undecodable", struct.pack(">I", 3) + b"\xc1\xc1\xc1"))
    cases.append(("not a map", struct.pack(">I", 1) + b"\x05"))
    cases.append(("a list", pack_frame({"x": 1})[:0] + struct.pack(">I", 3) + msgpack.packb([1, 2])))
    deep = b"\x91" * 20_000 + b"\x00"
    cases.append(("deep nesting", struct.pack(">I", len(deep)) + deep))
    cases.append(("int keys", struct.pack(">I", 3) + msgpack.packb({1: 2})))
    cases.append(("ext type", struct.pack(">I", 5) + msgpack.packb(msgpack.ExtType(1, b"ab"))))
    for i in range(6):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40)))
        cases.append((f"random {i}", struct.pack(">I", len(junk)) + junk if i % 2 else b"\x00\x00" + junk))
    # Stalls (the server's stall / header timeouts are set to 0.5 s for the corpus).
    cases.append(("header cut", pack_frame({"op": "stat", "id": 9})[:-3]))
    cases.append(("length only", struct.pack(">I", 100)))
    cases.append(("payload cut", frame(put, data[: BB // 2])))
    cases.append(("payload missing", frame(put)))
    return cases


def test_fuzz_store_frames(make_server):
    from dualpath.store import StoreClient
    from emulators.kvstore.server import StoreServer

    srv: StoreServer = make_server(block_bytes=BB, stall_timeout_s=0.5, header_timeout_s=0.5, max_conns=16)
    with StoreClient([srv.address], BB) as c:
        c.put(KEYS[0], bytes(BB))
    rng = random.Random(SEED + 2)
    codes = {"bad_request", "bad_key", "protocol", "corrupt", "busy", "full", "io", "missing"}
    outcomes = []
    for name, raw in store_cases(rng):
        def case(raw: bytes = raw) -> str | None:
            with socket.create_connection(srv.address, timeout=CASE_SECONDS) as s:
                s.sendall(raw)
                reply = recv_header(s, eof_ok=True)
            if reply is None:
                return "closed without an error frame"
            if reply.get("ok") is not False or reply.get("err") not in codes:
                return f"not an error reply: {str(reply)[:200]}"
            why = one_line(str(reply.get("msg", "")), limit=300)
            if why:
                return why
            # The service keeps serving: a valid request on a new connection.
            with StoreClient([srv.address], BB, timeout_s=CASE_SECONDS) as c:
                if c.contains([KEYS[0]]) != [True]:
                    return "server no longer serves"
            return None

        outcomes.append((name, bounded(case, trace_memory=False)))
    assert srv.store.stats()["reserved_bytes"] == 0
    assert len(outcomes) >= 80
    record("store frames", outcomes)


# ---- control messages -----------------------------------------------------
def control_cases(rng: random.Random) -> list[tuple[str, str, bytes]]:
    """(target, name, payload): target "rpc" (host agent commands) or "load" (the read queue)."""
    def p(obj: Any) -> bytes:
        return msgpack.packb(obj, use_bin_type=True)

    ok_flush = {"keys": KEYS[:2], "offset": 0, "crcs": [1, 2], "timeout_s": 1.0}
    cases: list[tuple[str, str, bytes]] = []
    for field, values in {"keys": [KEYS[0], [1], ["../x"], [KEYS[0]] * 1000, None],
                          "offset": [-1, 1 << 40, "0", 1.5, None, True],
                          "crcs": [[1], [1, 2, 3], [-1, 0], [1 << 32, 0], "12", [True, 1]],
                          "timeout_s": [math.nan, math.inf, -1.0, 0, 1e12, "nan", None, [1]]}.items():
        for v in values:
            cases.append(("rpc", f"flush {field}={str(v)[:16]}", p({"cmd": "flush", "args": {**ok_flush, field: v}})))
    for args in ({"peer": "", "msgs": ["m"]}, {"peer": "p", "msgs": "m"}, {"peer": "p", "msgs": [""]},
                 {"peer": "p", "msgs": ["m"], "timeout_s": math.nan}, {"peer": "x" * 5000, "msgs": ["m"]},
                 {"peer": None, "msgs": []}, {"msgs": ["m"]}):
        cases.append(("rpc", f"wait_notifs {str(args)[:30]}", p({"cmd": "wait_notifs", "args": args})))
    for args in ({"keys": ["nope"]}, {"keys": "x"}, {"keys": [5]}, {}):
        cases.append(("rpc", f"contains {str(args)[:20]}", p({"cmd": "contains", "args": args})))
    for msg in ({"cmd": "nope"}, {"cmd": 5}, {"args": {}}, {"cmd": "flush", "args": [1]},
                {"cmd": "flush", "args": {1: 2}}, {"cmd": "x" * 100_000}, [1, 2], "flush", None):
        cases.append(("rpc", f"shape {str(msg)[:20]}", p(msg)))
    n = 4_000_000
    bombs = [("empty arrays", b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n), ("deep", b"\x91" * 100_000 + b"\x00"),
             ("claims 4G", b"\xdd\xff\xff\xff\xff"), ("bad byte", b"\xc1"), ("empty", b""),
             ("truncated", p({"cmd": "contains", "args": {"keys": KEYS[:1]}})[:-2])]
    for name, raw in bombs:
        cases.append(("rpc", name, raw))
        cases.append(("load", name, raw))
    ok_load = {"keys": KEYS[:2], "offset": 0}
    for field, values in {"keys": ["k", [5], ["x" * 100], [KEYS[0]] * 70_000, ["../etc"], None],
                          "offset": [-1, "0", 1.5, True, 1 << 40, None]}.items():
        for v in values:
            cases.append(("load", f"load {field}={str(v)[:16]}", p({"cmd": "load", "args": {**ok_load, field: v}, "id": 1})))
    for msg in ({"cmd": "flush", "args": {}}, {"cmd": "load"}, {"cmd": "load", "args": {1: 2}, "id": 2},
                {"cmd": "load", "args": {**ok_load, "extra": 1}, "id": 3}, [1], None):
        cases.append(("load", f"shape {str(msg)[:20]}", p(msg)))
    for i in range(6):
        cases.append(("rpc" if i % 2 else "load", f"random {i}", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))))
    return cases


def test_fuzz_control_messages():
    from dualpath.nodes.host import check_blocks, check_flush, check_wait_notifs
    from dualpath.nodes.read_queue import ReadQueueServer
    from dualpath.control import RpcServer, pack
    from dualpath.store.keys import check_key

    buf, fb = 64 * BB, BB

    # The host agent's commands with its own argument checks (the real ones need a NIXL agent).
    from dualpath.nodes.host import strict

    @strict
    def flush(keys: list[str], offset: int, crcs: list[int], timeout_s: float = 10.0) -> dict:
        check_flush(keys, offset, crcs, timeout_s, buf, fb)
        return {"bytes": len(keys) * fb}

    @strict
    def wait_notifs(peer: str, msgs: list[str], timeout_s: float = 60.0) -> dict:
        check_wait_notifs(peer, msgs, timeout_s)
        return {}

    def contains(keys: list[str]) -> dict:
        return {"present": [bool(check_key(k)) and False for k in keys]}

    rpc = RpcServer("inproc://fuzz-control", {"flush": flush, "wait_notifs": wait_notifs, "contains": contains})
    queue = ReadQueueServer("inproc://fuzz-rq", fb, lambda keys, offset: {"bytes": 0},
                            check=lambda keys, offset: check_blocks("load", keys, offset, buf, fb))
    good_rpc = pack({"cmd": "contains", "args": {"keys": KEYS[:1]}})
    good_load = pack({"cmd": "load", "args": {"keys": KEYS[:1], "offset": 0}, "id": 77})
    outcomes = []
    try:
        for target, name, raw in control_cases(random.Random(SEED + 3)):
            def case(target: str = target, raw: bytes = raw) -> str | None:
                if target == "rpc":
                    reply = rpc.handle(raw)
                    if reply.get("ok") is not False:
                        return f"accepted: {str(reply)[:100]}"
                    why = one_line(reply.get("error", ""), limit=300)
                    if why is None and rpc.handle(good_rpc) != {"ok": True, "present": [False]}:
                        why = "no longer serves"
                    return why
                reply = queue._server._accept(raw, b"ident")
                if reply is None or reply.get("ok") is not False:
                    return f"accepted: {str(reply)[:100]}"
                why = one_line(reply.get("error", ""), limit=300)
                if why is None and queue._server._accept(good_load, b"ident") is not None:
                    why = "no longer queues a valid load"
                return why

            outcomes.append((f"{target}: {name}", bounded(case)))
    finally:
        rpc.sock.close()
        rpc.ctx.term()
    assert queue.pending_bytes == fb * sum(why is None for name, why in outcomes if name.startswith("load"))  # valid loads only
    assert len(outcomes) >= 70
    record("control messages", outcomes)


# ---- CLI arguments --------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    from dualpath.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("fuzzck") / "tiny", seed=0, kind="qwen2", num_hidden_layers=2)


GUARDED_CLI = (
    "import sys, testbed.cli as c\n"
    "def guard(_):\n"
    "    print('dualpath: TEST GUARD: would bring a topology up', file=sys.stderr); sys.exit(99)\n"
    "c._fabric = guard\n"
    "sys.argv = ['dualpath', *sys.argv[1:]]\n"
    "c.main()\n"
)


def test_fuzz_cli_arguments(tmp_path, tiny_ckpt, capsys, monkeypatch):
    from testbed.cli import run as cli

    monkeypatch.setattr("testbed.cli.shared._fabric", lambda _t: pytest.fail("would bring a topology up"))
    monkeypatch.setattr("testbed.experiments.ablation.claimed_fabric", lambda *_a: pytest.fail("would bring a topology up"))
    monkeypatch.setattr(cli, "_testbed_fabric", lambda *_a: pytest.fail("would bring a topology up"))
    rng = random.Random(SEED + 4)
    topo = REPO / "topologies" / "1p1d.yaml"
    good_out = tmp_path / "out"
    cases: list[tuple[str, tuple, tuple[str, ...]]] = []
    for i, (name, data) in enumerate(rng.sample(topology_cases(random.Random(SEED)), 12)):
        p = tmp_path / f"topo{i}.yaml"
        p.write_bytes(data)
        cases.append((f"topology {name}", (p, "basic", tiny_ckpt, good_out), (str(p),)))
    modes = ["basic,basic", "oracle,basic,oracle", "", ",", "nope", "basic;dualpath", "BASIC", "x" * 10_000,
             "dualpath,dualpath-rr,dualpath", " , basic , basic "]
    for m in modes:
        cases.append((f"modes {m[:20]!r}", (topo, m, tiny_ckpt, good_out), ("--modes",)))
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub", Path("/proc/dpt-fuzz"), Path("/dev/null")):
        cases.append((f"out {out}", (topo, "basic", tiny_ckpt, out), ("--out",)))
    raw = (tiny_ckpt / "model.safetensors").read_bytes()
    for i in range(8):
        bad = tmp_path / f"ck{i}"
        shutil.copytree(tiny_ckpt, bad)
        cut = rng.randrange(0, len(raw) - 1)
        (bad / "model.safetensors").write_bytes(raw[:cut])
        cases.append((f"checkpoint cut@{cut}", (topo, "basic", bad, good_out), ("model.safetensors",)))
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    for i, (field, v) in enumerate([("num_hidden_layers", None), ("hidden_size", "128"), ("rms_norm_eps", "small"),
                                    ("vocab_size", 10**40), ("eos_token_id", "x"), ("model_type", "gpt2")]):
        bad = tmp_path / f"cfg{i}"
        shutil.copytree(tiny_ckpt, bad)
        (bad / "config.json").write_text(json.dumps({**cfg, field: v}))
        must = ("config.json", f"'{field}'")
        cases.append((f"config {field}={v!r}"[:40], (topo, "basic", bad, good_out), must))
    cases.append(("no checkpoint", (topo, "basic", tmp_path / "nope", good_out), (str(tmp_path / "nope"),)))
    outcomes = []
    for name, args, must in cases:
        def case(args: tuple = args, must: tuple = must) -> str | None:
            try:
                cli._check_run_args(*args)
            except typer.Exit as e:
                err = capsys.readouterr().err.strip()
                if e.exit_code != 2:
                    return f"exit {e.exit_code}"
                return one_line(err, "dualpath: ", *must)
            return "accepted"

        outcomes.append((name, bounded(case)))
    # A handful through the real command line, in child processes (the bring-up guarded).
    zero_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    sub = [("topo fifo", ["topo", str(fifo)], str(fifo)), ("topo /dev/zero", ["topo", "/dev/zero"], "/dev/zero"),
           ("topo bomb", ["topo", str(tmp_path / "topo0.yaml")], "topo0.yaml")]
    if os.geteuid() == 0:  # `run` checks root before anything else
        sub += [("run modes twice", ["run", str(topo), "--checkpoint", str(tiny_ckpt), "--modes", "basic,basic"], "--modes"),
                ("run bad out", ["run", str(topo), "--checkpoint", str(tiny_ckpt), "--out", "/proc/x"], "--out")]
    for name, argv, must in sub:
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-c", GUARDED_CLI, *argv], cwd=REPO, capture_output=True, text=True,
                           timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
        took = time.monotonic() - t0
        why = None
        if r.returncode != 2 or "TEST GUARD" in r.stderr:
            why = f"rc {r.returncode}: {r.stderr[-200:]}"
        else:
            why = one_line(r.stderr.strip(), must)
        if why is None and took > 30:  # a fresh interpreter imports torch and typer: seconds, not the case
            why = f"took {took:.1f} s"
        outcomes.append((f"cli {name}", why))
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss - zero_rss < 2 << 20  # KiB: < 2 GiB
    assert len(outcomes) >= 40
    record("CLI arguments", outcomes)
