"""Malformed topology files: every one gets one line naming the file, the field and the fix, in
bounded time and memory, and nothing the emulation cannot carry gets through `dualpath topo`."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from testbed.topology import MAX_BPS, MIN_BPS, TopologyError, load_topology, parse_topology
from tests.conftest import REPO, dualpath, raises_bounded

GOOD_TEXT = (REPO / "topologies" / "1p1d.yaml").read_text()
GOOD = yaml.safe_load(GOOD_TEXT)


def write(tmp_path: Path, text: str | bytes, name: str = "bad.yaml") -> Path:
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


def refused(path: Path, *words: str) -> str:
    """load_topology's one-line error, checked for the file, the words, a fix, and bounds."""
    msg = str(raises_bounded(TopologyError, load_topology, path))
    assert "\n" not in msg and len(msg) < 600, msg
    assert str(path) in msg and "fix:" in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def doc(**changes) -> str:
    d = {**GOOD}
    for k, v in changes.items():
        if "." in k:
            outer, inner = k.split(".")
            d[outer] = {**d[outer], inner: v}
        else:
            d[k] = v
    return yaml.safe_dump(d)


# ---- rates and sizes ------------------------------------------------------
@pytest.mark.parametrize("field, value, words", [
    ("cnic_gbps", ".inf", ["'cnic_gbps'", "finite"]),
    ("cnic_gbps", ".nan", ["'cnic_gbps'"]),
    ("cnic_gbps", "1.0e+300", ["'cnic_gbps'"]),
    ("dram_gbps", ".inf", ["'dram_gbps'"]),
    ("snic_ratio", "1.0e+12", ["'snic_ratio'"]),
    ("storage.nic_gbps", ".inf", ["'storage.nic_gbps'"]),
    ("storage.disk_gbps", "-.inf", ["'storage.disk_gbps'"]),
    ("dram_buffer_gib", ".inf", ["'dram_buffer_gib'", "fix: set dram_buffer_gib"]),
    ("dram_buffer_gib", "1.0e+6", ["'dram_buffer_gib'"]),
    ("dram_buffer_gib", "1.0e-300", ["'dram_buffer_gib'"]),
    ("hbm_gib_per_engine", ".inf", ["'hbm_gib_per_engine'"]),
    ("scale", "1.0e-12", ["'cnic_gbps'", "outside"]),  # every rate rounds to ~0 bit/s
    ("scale", "1", ["'cnic_gbps'", "400 Gbit/s", "outside"]),  # 400 Gbit/s unscaled: beyond any veth here
    ("cnic_gbps", "1.0e-7", ["'cnic_gbps'", "outside"]),  # rounds to 0 bit/s after scale
    ("snic_ratio", "1.0e-6", ["'snic_ratio'", "the SNIC"]),
    ("prefill_nodes", "100", ["'prefill_nodes'"]),
    ("storage.servers", "1000", ["'storage.servers'"]),
    ("name", "x" * 100, ["'name'"]),
    ("target.gpu", "h" * 5000, ["'target.gpu'"]),
])
def test_rates_and_sizes_the_emulation_cannot_carry_are_refused(tmp_path, field, value, words):
    text = doc(**{field: "@@"}).replace("'@@'", value).replace("@@", value)
    refused(write(tmp_path, text), *words)


def test_the_bounds_themselves_are_accepted():
    lo = parse_topology({**GOOD, "scale": MIN_BPS / 400e9 * 4})  # the SNIC at s = 0.25 is exactly 1 Mbit/s
    assert lo.snic_bps == MIN_BPS
    hi = parse_topology({**GOOD, "scale": 1.0, "cnic_gbps": 25.0, "dram_gbps": 50.0,
                         "storage": {**GOOD["storage"], "nic_gbps": 100.0, "disk_gbps": 100.0}})
    assert hi.storage_nic_bps == MAX_BPS


def test_too_many_engines_in_all_are_refused():
    with pytest.raises(TopologyError, match=r"'engines_per_node' .*297 engines in all"):
        parse_topology({**GOOD, "engines_per_node": 99, "decode_nodes": 2}, source="t.yaml")


def test_buffers_must_fit_this_machines_memory():
    with pytest.raises(TopologyError, match=r"'dram_buffer_gib' .*8 GiB is more than this machine's 4 GiB"):
        parse_topology({**GOOD, "dram_buffer_gib": 8}, source="t.yaml", memory_bytes=4 << 30)
    parse_topology({**GOOD, "dram_buffer_gib": 8}, source="t.yaml", memory_bytes=16 << 30)


# ---- the file itself ------------------------------------------------------
def test_a_yaml_alias_bomb_is_refused_in_bounded_time_and_memory(tmp_path):
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 12):  # 10^12 strings once expanded
        lines.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    bomb = GOOD_TEXT + "\n" + "description: " + "\n".join(lines)  # inside a field's value
    refused(write(tmp_path, GOOD_TEXT + "\nbomb:\n" + "\n".join("  " + x for x in lines)), "YAML nodes once aliases")
    refused(write(tmp_path, bomb, "bomb2.yaml"), "bomb2.yaml")


def test_an_alias_bomb_in_a_known_field_never_reaches_the_message(tmp_path):
    value = "[&x0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1], *x0, *x0, *x0, *x0, *x0, *x0, *x0, *x0, *x0]"
    text = GOOD_TEXT.replace("prefill_nodes: 1", "prefill_nodes: " + value)
    msg = refused(write(tmp_path, text), "'prefill_nodes'")  # 111 nodes: composed, then refused by type
    assert len(msg) < 400


def test_a_fifo_does_not_hang(tmp_path):
    fifo = tmp_path / "topo.fifo"
    os.mkfifo(fifo)
    refused(fifo, "is a FIFO, not a regular file")


def test_devices_directories_and_huge_files_are_refused(tmp_path):
    refused(Path("/dev/zero"), "is a device")
    refused(tmp_path, "is a directory")
    refused(write(tmp_path, GOOD_TEXT + "#" * (1 << 20)), "larger than 64 KiB")
    refused(tmp_path / "missing.yaml", "cannot read")


def test_non_utf8_deep_nesting_and_huge_integers_name_the_file_and_field(tmp_path):
    refused(write(tmp_path, GOOD_TEXT.encode() + b"\ndescription: caf\xe9\n"), "line 26", "not UTF-8", "0xe9")
    refused(write(tmp_path, GOOD_TEXT + "\ndescription: " + "[" * 5000 + "]" * 5000 + "\n"),
            "field 'description", "nesting deeper than 16")
    refused(write(tmp_path, GOOD_TEXT + "\ndescription: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n"), "nesting")
    refused(write(tmp_path, GOOD_TEXT.replace("prefill_nodes: 1", "prefill_nodes: " + "9" * 5000)),
            "field 'prefill_nodes'", "integer of 5000 digits")
    refused(write(tmp_path, GOOD_TEXT.replace("prefill_nodes: 1", "prefill_nodes: " + "9" * 30)),
            "field 'prefill_nodes'")
    refused(write(tmp_path, GOOD_TEXT.replace("cnic_gbps: 400", "cnic_gbps: 1" + "0" * 400 + ".0")), "'cnic_gbps'")


def test_odd_yaml_gets_one_line(tmp_path):
    refused(write(tmp_path, GOOD_TEXT + "\nprefill_nodes: 2\n"), "field 'prefill_nodes' has appears twice")
    refused(write(tmp_path, "a: &a [*a]\n"), "field 'a.[0]' has an alias that refers to itself")
    refused(write(tmp_path, GOOD_TEXT + "\nx: !!python/object:os.system echo\n"), "not valid YAML")
    refused(write(tmp_path, "\x00\x01\x02"), "not valid YAML")
    refused(write(tmp_path, ""), "expected a mapping")
    refused(write(tmp_path, "- 1\n- 2\n"), "expected a mapping")
    refused(write(tmp_path, GOOD_TEXT + "\n? [a, b]\n: 1\n"), "not valid YAML")
    refused(write(tmp_path, GOOD_TEXT.replace("name: 1p1d", "name: !!binary aGVsbG8=")), "'name'")
    refused(write(tmp_path, GOOD_TEXT.replace("qos: on", "qos: 2001-01-01")), "'qos'")
    refused(write(tmp_path, GOOD_TEXT + "\ndescription: " + "x" * 5000 + "\n"), "5000 characters")


def test_a_name_with_a_newline_stays_one_line(tmp_path):
    p = write(tmp_path, "- 1\n", "we\nird.yaml")
    with pytest.raises(TopologyError) as e:
        load_topology(p)
    assert "\n" not in str(e.value) and "we\\nird.yaml" in str(e.value)


# ---- through the CLI ------------------------------------------------------
@pytest.mark.parametrize("make", ["bomb", "fifo", "zero", "inf_buffer"])
def test_cli_topo_refuses_with_one_line(tmp_path, make):
    if make == "bomb":
        lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
        lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 12)]
        path = write(tmp_path, GOOD_TEXT + "\nbomb:\n" + "\n".join("  " + x for x in lines))
    elif make == "fifo":
        path = tmp_path / "t.fifo"
        os.mkfifo(path)
    elif make == "zero":
        path = Path("/dev/zero")
    else:
        path = write(tmp_path, GOOD_TEXT.replace("dram_buffer_gib: 4", "dram_buffer_gib: .inf"))
    t0 = time.monotonic()
    r = dualpath("topo", str(path))
    assert time.monotonic() - t0 < 30
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and "fix:" in lines[0], r.stderr
