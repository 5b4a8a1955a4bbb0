"""Fault injection's pure parts (issue 14): --fault parsing against a topology, attribution of
what requests met to the fault that explains it, the per-fault summary, and the block checks."""
from __future__ import annotations

import os
import random
import subprocess
from pathlib import Path

import pytest

from dualpath.store.checksum import WRITE_ALGO, checksum
from emulators.kvstore.blockfile import encode_header
from dualpath.lifecycle.record import RequestRecord
from testbed.fabric.network import plan
from testbed.cluster.faults import (
    FaultError, FaultLog, block_intact, fill_disk, flip_bit, free_disk, lost_blocks, parse_fault, parse_faults,
    topology_names,
)
from testbed.topology import load_topology
from tests.conftest import REPO, needs_root

NAMES = topology_names(plan(load_topology(REPO / "topologies" / "1p2d.yaml")))


def test_the_topology_names_faults_may_target():
    assert NAMES == {"prefill_nodes": ["dpt-p0"], "decode_nodes": ["dpt-d0", "dpt-d1"],
                     "prefill_engines": ["dpt-p0e0", "dpt-p0e1"],
                     "decode_engines": ["dpt-d0e0", "dpt-d0e1", "dpt-d1e0", "dpt-d1e1"], "servers": ["dpt-s0"]}


@pytest.mark.parametrize("text, kind, target, at", [
    ("snic-down@1", "snic-down", "dpt-p0", 1.0),
    ("snic-down:d1@2.5", "snic-down", "dpt-d1", 2.5),
    ("snic-up:dpt-p0@3", "snic-up", "dpt-p0", 3.0),
    ("host-kill@0", "host-kill", "dpt-p0", 0.0),
    ("pe-kill@1", "pe-kill", "dpt-p0e0", 1.0),
    ("pe-kill:p0e1@1", "pe-kill", "dpt-p0e1", 1.0),
    ("de-kill@1", "de-kill", "dpt-d0e0", 1.0),
    ("de-kill:d1e1@1e0", "de-kill", "dpt-d1e1", 1.0),
    ("store-crash@1", "store-crash", "dpt-s0", 1.0),
    ("corrupt-block:s0@0.5", "corrupt-block", "dpt-s0", 0.5),
    ("disk-full@2", "disk-full", "dpt-s0", 2.0),
])
def test_faults_parse_with_their_defaults(text, kind, target, at):
    f = parse_fault(text, NAMES)
    assert (f.kind, f.target, f.at_s) == (kind, target, at)
    assert f.label == f"{kind}:{target}@{at:g}"


@pytest.mark.parametrize("text, says", [
    ("pe-kill", "KIND[:TARGET]@T"),
    ("nic-down@1", "unknown kind"),
    ("pe-kill@-1", "T must be"),
    ("pe-kill@nan", "T must be"),
    ("pe-kill@inf", "T must be"),
    ("pe-kill@1e9", "T must be"),
    ("pe-kill:d0e0@1", "is not a prefill engine"),  # a decode engine is no prefill engine
    ("de-kill:p0e0@1", "is not a decode engine"),
    ("snic-down:p0e0@1", "is not a node"),
    ("store-crash:s1@1", "is not a storage server"),
    ("host-kill:../etc@1", "KIND[:TARGET]@T"),
    ("x" * 10_000, "KIND[:TARGET]@T"),
])
def test_a_bad_fault_is_one_line_naming_it_and_the_fix(text, says):
    with pytest.raises(FaultError) as e:
        parse_fault(text, NAMES)
    msg = str(e.value)
    assert says in msg and "\n" not in msg and len(msg) < 400 and msg.startswith("--fault")


def test_faults_are_ordered_by_time_and_bounded_in_number():
    fs = parse_faults(["snic-up@3", "snic-down@1"], NAMES)
    assert [f.kind for f in fs] == ["snic-down", "snic-up"]
    with pytest.raises(FaultError, match="at most"):
        parse_faults(["pe-kill@1"] * 33, NAMES)


def _rec(name: str, error: str = "", t_done: float = 10.0) -> RequestRecord:
    r = RequestRecord(name, 0, 0, "dualpath", "de")
    r.error, r.t_done = error, t_done
    return r


def _log(*texts: str, at: dict[str, float]) -> FaultLog:
    log = FaultLog(parse_faults(list(texts), NAMES))
    for f in log.faults:
        f.t_injected = at[f.spec.kind]
    return log


def test_events_are_charged_to_the_fault_that_explains_them():
    log = _log("pe-kill@1", "snic-down:d0@1", "store-crash@2", "corrupt-block@1", "disk-full@3",
               at={"pe-kill": 3.0, "snic-down": 3.0, "store-crash": 6.0, "corrupt-block": 3.0, "disk-full": 9.0})
    by = {f.kind: f for f in log.faults}
    a, b, c, d, e, x = (_rec(n) for n in "abcdex")
    log.process_died(a, "dpt-p0e0", 4.0, "dpt-p0e0 exited during the request: retried")
    log.load_failed(b, "dpt-d0", {"connection"}, 4.0, "unreadable", host_dead=False)
    log.load_failed(c, "dpt-d1", {"connection"}, 7.0, "unreadable", host_dead=False)  # not d0's link: the crash
    log.load_failed(d, "dpt-p0", {"corrupt"}, 4.0, "unreadable", host_dead=False)
    log.flush_failed(e, "dpt-d1", {"full"}, 9.5, "not persisted")
    log.avoided(x, "dpt-d0", 4.0)
    assert list(by["pe-kill"].affected) == ["a"]
    assert sorted(by["snic-down"].affected) == ["b", "x"]
    assert list(by["store-crash"].affected) == ["c"]
    assert list(by["corrupt-block"].affected) == ["d"]
    assert list(by["disk-full"].affected) == ["e"]
    assert a.faults == ["pe-kill:dpt-p0e0@1: dpt-p0e0 exited during the request: retried"]
    assert log.label_of(a) == "pe-kill:dpt-p0e0@1"
    # nothing is charged to a fault before it struck, and a fault of another target explains nothing
    y = _rec("y")
    log.process_died(y, "dpt-p0e0", 2.0, "early")
    log.process_died(y, "dpt-p0e1", 4.0, "another engine")
    assert "y" not in by["pe-kill"].affected and len(log.unattributed) == 2


def test_the_summary_counts_per_fault():
    log = _log("de-kill@1", "snic-up@2", at={"de-kill": 3.0, "snic-up": 6.0})
    de, up = log.faults
    ok, bad, later = _rec("ok", t_done=7.0), _rec("bad", error="request bad: no DE", t_done=8.0), _rec("later", t_done=12.0)
    log.process_died(ok, "dpt-d0e0", 4.0, "retried")
    log.process_died(bad, "dpt-d0e0", 4.0, "retried")
    log.load_ok("dpt-p0", 7.5)
    log.load_ok("dpt-p0", 9.0)
    rows = log.summary([ok, bad, later], wrong={"later": 2}, lost={de.label: 1}, dilation=2.0)
    r = rows[0]
    assert (r["affected"], r["completed"], r["failed"], r["lost_blocks"]) == (2, 1, 1, 1)
    assert r["wrong_tokens"] == 2  # every request that finished after the fault is checked
    assert r["recovery_s"] == (8.0 - 3.0) / 2.0 and r["injected_at_s"] == 1.5
    assert r["errors"] == ["request bad: no DE"]
    assert rows[1]["recovery_s"] == (7.5 - 6.0) / 2.0 and rows[1]["affected"] == 0
    never = FaultLog(parse_faults(["pe-kill@99"], NAMES))
    assert never.summary([], {}, {}, 1.0)[0]["injected"] is False


def _block(root: Path, key: str, payload: bytes) -> Path:
    p = root / "blocks" / key[:2] / key
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(encode_header(key, len(payload), checksum(payload, WRITE_ALGO), WRITE_ALGO) + payload)
    return p


def test_lost_blocks_are_those_that_do_not_read_back_whole(tmp_path):
    roots = [tmp_path / "s0", tmp_path / "s1"]
    keys = [f"{i:032x}" for i in range(1, 9)]
    from testbed.cluster.faults import server_of
    for k in keys:
        _block(roots[server_of(k, 2)], k, os.urandom(512))
    assert lost_blocks(roots, frozenset(keys)) == []
    flip_bit(roots[server_of(keys[0], 2)], keys[0], random.Random(1))
    (roots[server_of(keys[1], 2)] / "blocks" / keys[1][:2] / keys[1]).unlink()
    p = roots[server_of(keys[2], 2)] / "blocks" / keys[2][:2] / keys[2]
    p.write_bytes(p.read_bytes()[:-1])  # truncated
    assert lost_blocks(roots, frozenset(keys)) == sorted(keys[:3])
    assert not block_intact(roots[0], "f" * 32)


def test_disk_full_fills_only_a_tmpfs_of_its_own(tmp_path):
    with pytest.raises(RuntimeError, match="not a tmpfs mount point"):
        fill_disk(tmp_path)  # never the shared disk


@needs_root
def test_a_filled_tmpfs_refuses_writes_until_freed(tmp_path):
    m = tmp_path / "disk"
    m.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "dpt-test", str(m)], check=True)
    try:
        assert fill_disk(m) > 900_000
        with pytest.raises(OSError) as e:
            (m / "x").write_bytes(b"y" * 8192)
        assert e.value.errno == 28  # ENOSPC
        free_disk(m)
        (m / "x").write_bytes(b"y" * 8192)
    finally:
        subprocess.run(["umount", "-l", str(m)], check=True)
