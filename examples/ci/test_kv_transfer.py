"""An example of testing your own KV-transfer code on the DualPath testbed in CI.

It moves a user buffer between two engines (p0e0 -> d0e0) with NIXL WRITE, READs it back,
and checks three things: the bytes are exact, they crossed the shaped compute NICs in the
kv traffic class (the kernel's HTB class counters of both CNICs grew by the buffer's size),
and the WRITE took at least as long as the CNIC's emulated rate allows.

    sudo .venv/bin/python -m pytest -q examples/ci          # from the testbed's clone

The `dualpath_testbed` fixture comes with the package (its pytest plugin): it brings the
module's topology up before the first test and tears it down after the last, and skips when
not root.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

PEER = Path(__file__).with_name("kv_peer.py")
NBYTES = 16 << 20  # 16 MiB: about 0.14 s at the 1 Gbit/s CNIC of 1p1d

pytestmark = pytest.mark.dualpath_topology("1p1d")


def _start(tb, node: str, role: str) -> subprocess.Popen:
    return tb.popen(node, [sys.executable, str(PEER), role, "--bytes", str(NBYTES)], text=True,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)


def _line(p: subprocess.Popen) -> str:
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"peer exited with {p.wait(10)} before answering")
    return line


def test_user_buffer_crosses_the_shaped_cnic_in_the_kv_class(dualpath_testbed):
    tb = dualpath_testbed
    before = {n: tb.class_bytes(n, "cnic") for n in ("p0e0", "d0e0")}
    tgt, ini = _start(tb, "d0e0", "target"), _start(tb, "p0e0", "initiator")
    try:
        # relay the NIXL metadata: each side's `md <hex>` line to the other's stdin
        tgt_md, ini_md = _line(tgt), _line(ini)
        ini.stdin.write(tgt_md)
        ini.stdin.flush()
        tgt.stdin.write(ini_md)
        tgt.stdin.flush()
        ini_res, tgt_res = json.loads(_line(ini)), json.loads(_line(tgt))
        assert ini.wait(60) == 0 and tgt.wait(60) == 0
    finally:
        for p in (tgt, ini):
            if p.poll() is None:
                p.kill()
                p.wait()
    after = {n: tb.class_bytes(n, "cnic") for n in ("p0e0", "d0e0")}

    # the bytes: what the target received is what the initiator sent, and the READ got it back
    assert ini_res["exact"], "READ back differs from what was written"
    assert tgt_res["received_sha256"] == ini_res["sent_sha256"]
    assert ini_res["transport"].startswith("ucx/tcp via dpt-p0e0-cnic")

    # the class counters: WRITE leaves p0e0 and enters d0e0, READ's data the other way, all kv
    def grew(node: str, direction: str, cls: str) -> int:
        return after[node][direction][cls] - before[node][direction][cls]

    for node, direction in (("p0e0", "tx"), ("d0e0", "rx"), ("d0e0", "tx"), ("p0e0", "rx")):
        kv = grew(node, direction, "kv")
        assert NBYTES <= kv < NBYTES * 1.10, f"{node} {direction}: {kv} kv-class bytes for {NBYTES}"
        assert grew(node, direction, "model") < NBYTES * 0.01, f"{node} {direction}: KV leaked into model"

    # the shaping: no faster than the CNIC's rate (HTB lets 1 ms of burst through)
    rate = next(n["rate_bps"] for n in tb.endpoint("p0e0")["nics"] if n["kind"] == "cnic")
    floor_s = NBYTES * 8 / rate
    assert ini_res["write_s"] >= 0.9 * floor_s, f"WRITE took {ini_res['write_s']:.3f}s, the CNIC allows {floor_s:.3f}s"
