"""The checkpoint preflight refuses what would fail later inside the engines (a truncated or
mismatched safetensors file, config.json fields that are null, non-finite or absurd), in
milliseconds, with one line naming the file and the field, without loading a tensor."""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import time
from pathlib import Path

import pytest

from dualpath.model import CheckpointError, load_config
from dualpath.model.checkpoint import preflight
from dualpath.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0, kind="qwen2", num_hidden_layers=2)


def copy(tiny: Path, tmp_path: Path, **config_changes) -> Path:
    dst = tmp_path / "c"
    shutil.copytree(tiny, dst)
    if config_changes:
        d = json.loads((dst / "config.json").read_text())
        d.update(config_changes)
        (dst / "config.json").write_text(json.dumps(d))
    return dst


def refused(root: Path, *words: str) -> str:
    t0 = time.monotonic()
    with pytest.raises(CheckpointError) as e:
        preflight(root)
    assert time.monotonic() - t0 < 1.0
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400 and str(root) in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_a_good_checkpoint_passes(tiny):
    cfg = preflight(tiny)
    assert cfg.n_layer == 2 and cfg == load_config(tiny)


@pytest.mark.parametrize("cut", [1, 1000, "half", "header", 7, "empty"])
def test_a_truncated_safetensors_file_is_refused_before_anything_loads(tiny, tmp_path, cut):
    root = copy(tiny, tmp_path)
    f = root / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    keep = {"half": len(raw) // 2, "header": 8 + n // 2, 7: 7, "empty": 0}.get(cut)
    keep = len(raw) - cut if keep is None else keep
    f.write_bytes(raw[:keep])
    refused(root, "model.safetensors", "truncated")


def test_garbage_in_place_of_safetensors(tiny, tmp_path):
    root = copy(tiny, tmp_path)
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 30) + b"{not json at all}!!!!!!!!!!!!!" + b"\0" * 100)
    refused(root, "not valid JSON")
    (root / "model.safetensors").write_bytes(b"\xff" * 64)
    refused(root, "does not fit")


def _rewrite_header(f: Path, edit) -> None:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * ((8 - len(new) % 8) % 8)
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])


@pytest.mark.parametrize("edit, words", [
    (lambda h: h["model.norm.weight"].update(dtype="I32"), ["'model.norm.weight'", "floating point"]),
    (lambda h: h["model.norm.weight"].update(dtype="F7"), ["unknown dtype"]),
    (lambda h: h["model.norm.weight"].update(shape=[-1]), ["shape"]),
    (lambda h: h["model.norm.weight"].update(shape=[3]), ["bytes for shape"]),
    (lambda h: h["model.norm.weight"].update(data_offsets=[0, 10**15]), ["bytes"]),
    (lambda h: h["model.norm.weight"].update(data_offsets="x"), ["data_offsets"]),
    (lambda h: h.update({"model.extra.weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}),
     ["overlap"]),
    (lambda h: h.update({"model.extra.weight": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}),
     ["unexpected tensors"]),
    (lambda h: h.pop("model.norm.weight"), ["missing tensors"]),
    (lambda h: h.update({"model.norm.weight": [1, 2]}), ["not an object"]),
])
def test_a_bad_header_is_refused(tiny, tmp_path, edit, words):
    root = copy(tiny, tmp_path)
    _rewrite_header(root / "model.safetensors", edit)
    refused(root, *words)


def test_shapes_are_checked_against_config_json(tiny, tmp_path):
    refused(copy(tiny, tmp_path, intermediate_size=512), "has shape", "config.json implies")


def test_a_shard_index_that_lies_is_refused(tiny, tmp_path):
    root = copy(tiny, tmp_path)
    names = list(json.loads((root / "model.safetensors").read_bytes()[8:8 + struct.unpack("<Q", (root / "model.safetensors").read_bytes()[:8])[0]]))
    names = [n for n in names if n != "__metadata__"]
    (root / "model.safetensors").rename(root / "shard-1.safetensors")
    wm = {n: "shard-1.safetensors" for n in names}
    wm["model.norm.weight"] = "shard-2.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    refused(root, "shard-2.safetensors")
    (root / "shard-2.safetensors").write_bytes((root / "shard-1.safetensors").read_bytes())
    wm["model.nonexistent.weight"] = "shard-1.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    refused(root, "does not hold it")
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": 5}}))
    refused(root, "weight_map")
    (root / "model.safetensors.index.json").write_text("[" * 100_000)
    refused(root, "weight_map")


# ---- config.json ----------------------------------------------------------
def _fields(tiny: Path) -> list[str]:
    return sorted(json.loads((tiny / "config.json").read_text()))


def test_every_field_set_to_null_is_a_clean_error_or_a_default(tiny, tmp_path):
    for field in _fields(tiny):
        root = tmp_path / field
        shutil.copytree(tiny, root)
        d = json.loads((root / "config.json").read_text())
        d[field] = None
        (root / "config.json").write_text(json.dumps(d))
        try:
            preflight(root)
        except CheckpointError as e:
            assert "\n" not in str(e) and f"'{field}'" in str(e) or "tensors" in str(e), (field, str(e))
        shutil.rmtree(root)


@pytest.mark.parametrize("field, value, words", [
    ("num_hidden_layers", None, ["'num_hidden_layers'"]),
    ("hidden_size", 10**30, ["'hidden_size'", "integer"]),
    ("vocab_size", True, ["'vocab_size'"]),
    ("rms_norm_eps", math.nan, ["'rms_norm_eps'", "finite"]),
    ("rms_norm_eps", math.inf, ["'rms_norm_eps'"]),
    ("rms_norm_eps", "1e-6", ["'rms_norm_eps'"]),
    ("rope_parameters", {"rope_type": "default", "rope_theta": math.inf}, ["'rope_theta'"]),
    ("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4, "factor": math.nan}, ["'rope_parameters.factor'"]),
    ("max_position_embeddings", -1, ["'max_position_embeddings'"]),
    ("max_position_embeddings", "x", ["'max_position_embeddings'"]),
    ("eos_token_id", "x", ["'eos_token_id'"]),
    ("eos_token_id", [1, None], ["'eos_token_id'"]),
    ("eos_token_id", 10**9, ["'eos_token_id'"]),
    ("dtype", ["float32"], ["'dtype'"]),
    ("rope_parameters", [1, 2], ["'rope_parameters'"]),
    ("rope_parameters", {"rope_type": ["x"]}, ["'rope_parameters'"]),
    ("layer_types", "full_attention", ["'layer_types'"]),
    ("hidden_act", {"a": 1}, ["'hidden_act'"]),
    ("model_type", ["qwen2"], ["'model_type'"]),
])
def test_bad_config_values_are_one_line(tiny, tmp_path, field, value, words):
    root = copy(tiny, tmp_path)
    d = json.loads((root / "config.json").read_text())
    d[field] = value
    (root / "config.json").write_text(json.dumps(d))
    refused(root, "config.json", *words)


@pytest.mark.parametrize("text, words", [
    ('{"model_type": "qwen2", "vocab_size": ' + "9" * 5000 + "}", ["not valid JSON"]),
    ("[" * 100_000, ["not valid JSON"]),
    ('{"a": "\udcff"}', ["not valid JSON"]),
])
def test_unreadable_config_json_is_one_line(tiny, tmp_path, text, words):
    root = copy(tiny, tmp_path)
    (root / "config.json").write_text(text, errors="surrogateescape")
    refused(root, *words)


def test_a_fifo_config_does_not_hang(tiny, tmp_path):
    root = copy(tiny, tmp_path)
    (root / "config.json").unlink()
    os.mkfifo(root / "config.json")
    refused(root, "config.json")
