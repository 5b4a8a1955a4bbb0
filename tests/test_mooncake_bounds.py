"""Malformed Mooncake traces and arguments: one line naming file, line and field, in bounded time
and memory, whatever the file holds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.workload import load_mooncake, prefix_hit_rate
from dualpath.workload.mooncake import MAX_LINE_BYTES, TraceError
from dualpath.workload.mooncake import main as mooncake_main
from tests.conftest import REPO, raises_bounded

ROW = {"timestamp": 0, "input_length": 700, "output_length": 10, "hash_ids": [0, 1]}


def write(tmp_path: Path, *lines: str | bytes, name: str = "t.jsonl") -> Path:
    p = tmp_path / name
    p.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return p


def refused(path: Path, *words: str, **kw) -> TraceError:
    err = raises_bounded(TraceError, load_mooncake, path, **kw)
    msg = str(err)
    assert msg.startswith(str(path)) and "\n" not in msg and len(msg) < 400, msg
    for w in words:
        assert w in msg, msg
    return err


@pytest.mark.parametrize("line, field, words", [
    ("[" * 100_000 + "]" * 100_000, None, "nested too deeply"),
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, None, "nested too deeply"),
    (json.dumps({**ROW, "hash_ids": [[[[[[[[[[0]]]]]]]]]]}), "hash_ids", "entry 0"),
    ('{"timestamp": 0, "input_length": ' + "9" * 5000 + ', "output_length": 1, "hash_ids": []}', None, "digits"),
    (json.dumps({**ROW, "input_length": 10**12}), "input_length", "at most"),
    (json.dumps({**ROW, "output_length": 10**9}), "output_length", "at most"),
    (json.dumps({**ROW, "timestamp": 1e300}), "timestamp", "at most"),
    ('{"timestamp": 1e999, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp", "number"),
    ('{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": []}', "timestamp", "number"),
    (json.dumps({**ROW, "hash_ids": [2**64]}), "hash_ids", "2**63"),
    (json.dumps({**ROW, "hash_ids": list(range(100_000))}), "hash_ids", "spans only"),
    (json.dumps({**ROW, "hash_ids": {"a": 1}}), "hash_ids", "list"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [], "x": "' + "y" * (MAX_LINE_BYTES + 10) + '"}',
     None, "longer than"),
    ("\x00\x01", None, "not valid JSON"),
    ('"just a string"', None, "expected a JSON object"),
])
def test_bad_lines_are_one_line_errors(tmp_path, line, field, words):
    e = refused(write(tmp_path, json.dumps(ROW), line), words)
    assert e.line == 2 and e.field == field


def test_fifos_devices_directories_and_missing_files(tmp_path):
    fifo = tmp_path / "t.fifo"
    os.mkfifo(fifo)
    refused(fifo, "is a FIFO, not a regular file")
    refused(Path("/dev/zero"), "not a regular file")
    refused(tmp_path, "is a directory")
    refused(tmp_path / "nope.jsonl", "cannot read")


def test_max_requests_stops_the_read_before_later_junk(tmp_path):
    p = write(tmp_path, json.dumps(ROW), json.dumps(ROW), "{broken")
    assert len(load_mooncake(p, max_requests=2)) == 2
    refused(p, ":3:", "not valid JSON")
    with pytest.raises(ValueError, match="max_requests"):
        load_mooncake(p, max_requests=-1)


def test_block_size_zero_is_a_clear_error(tmp_path, capsys):
    p = write(tmp_path, json.dumps(ROW))
    reqs = load_mooncake(p)
    with pytest.raises(ValueError, match="block_size"):
        prefix_hit_rate(reqs, 0)
    for args in (["--block-size", "0"], ["--block-size", "x"], ["--scale", "-4"], ["--max-requests", "-1"]):
        with pytest.raises(SystemExit) as e:
            mooncake_main([str(p), *args])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: argument --") and args[0] in err[0], err
    assert mooncake_main([str(p), "--scale", "3"]) == 2  # must divide 512
    assert "scale" in capsys.readouterr().err


def test_the_command_line_prints_one_line_for_a_deep_trace(tmp_path):
    p = write(tmp_path, "[" * 100_000)
    r = subprocess.run([sys.executable, "-m", "dualpath.workload.mooncake", str(p)], cwd=REPO,
                       capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if "RuntimeWarning" not in x and "runpy" not in x]
    assert len(lines) == 1 and lines[0].startswith(f"error: {p}:1:") and "Traceback" not in r.stderr, r.stderr
