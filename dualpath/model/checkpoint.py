"""Reading the weights of a Hugging Face checkpoint directory (safetensors only).

A directory holds either `model.safetensors` or `model.safetensors.index.json` plus the shards it
names. Tensor names are the standard ones of `Qwen2ForCausalLM` / `LlamaForCausalLM`
(`model.layers.{i}.self_attn.q_proj.weight`, ...). Every expected tensor must be present with the
expected shape; a tensor we do not know is an error too, because it means a feature this
transformer would silently ignore.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from .config import CheckpointError, ModelConfig, load_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers that some old checkpoints saved and that carry no information we need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors dtypes and their bytes per element (the format's own list).
_ST_DTYPES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
              "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_ST_FLOATS = {"F64", "F32", "F16", "BF16"}
MAX_ST_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
MAX_INDEX_BYTES = 64 << 20


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the transformer needs, with its shape."""
    h, kv, hd = cfg.hidden_size, cfg.n_kv_heads * cfg.head_dim, cfg.head_dim
    q = cfg.n_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.n_layer):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        if cfg.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for name, shape in (("gate_proj", (cfg.intermediate_size, h)), ("up_proj", (cfg.intermediate_size, h)),
                            ("down_proj", (h, cfg.intermediate_size))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    return shapes


def _tensor_files(root: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file holding it."""
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: field 'weight_map' unreadable ({e!r})") from None
        files = {}
        for name, fname in weight_map.items():
            f = root / fname
            if Path(fname).name != fname or not f.is_file():
                raise CheckpointError(f"{index}: field 'weight_map' names shard {fname!r}, which is not in {root}")
            files[name] = f
        return files
    if single.is_file():
        with safe_open(str(single), framework="pt") as sf:
            return {name: single for name in sf.keys()}
    extra = " (pytorch_model.bin is not supported; convert to safetensors)" if (root / "pytorch_model.bin").exists() else ""
    raise CheckpointError(f"{root}: missing {SINGLE_FILE} or {INDEX_FILE}{extra}")


def _check_names(root: Path, files: dict[str, Path], want: dict, cfg: ModelConfig) -> None:
    """Every tensor the config needs is there and none it does not use (`files`: name -> the
    file holding it; a tied checkpoint's stored lm_head is dropped from it, as HF does)."""
    if cfg.tie_word_embeddings:
        files.pop("lm_head.weight", None)  # some tied checkpoints still store it; the embedding wins
    unknown = sorted(n for n in files if n not in want and not n.endswith(_IGNORED_SUFFIXES))
    if unknown:
        more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(f"{files[unknown[0]]}: unexpected tensors {unknown[:3]}{more}; "
                              f"this {cfg.model_type} config does not use them")
    missing = [n for n in want if n not in files]
    if missing:
        where = root / (INDEX_FILE if (root / INDEX_FILE).is_file() else SINGLE_FILE)
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise CheckpointError(f"{where}: missing tensors {missing[:3]}{more}")


def load_weights(root: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu"
                 ) -> dict[str, torch.Tensor]:
    """Load and check every tensor `cfg` needs, cast to `dtype` on `device`."""
    root = Path(root)
    files = _tensor_files(root)
    want = expected_shapes(cfg)
    _check_names(root, files, want, cfg)

    by_file: dict[Path, list[str]] = {}
    for name in want:
        by_file.setdefault(files[name], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as sf:
            for name in names:
                t = sf.get_tensor(name)
                if tuple(t.shape) != want[name]:
                    raise CheckpointError(f"{f}: tensor '{name}' has shape {tuple(t.shape)}, "
                                          f"config.json implies {want[name]}")
                if not t.is_floating_point():
                    raise CheckpointError(f"{f}: tensor '{name}' has dtype {t.dtype}; expected floating point")
                out[name] = t.to(device=device, dtype=dtype).contiguous()
    return out


def preflight(root: str | Path) -> ModelConfig:
    """Check a checkpoint directory without loading a tensor: config.json (load_config), then every
    safetensors file's header (its length, JSON, dtypes, shapes) and every tensor's byte range
    against the file's size, and the tensor names and shapes against what config.json implies.
    Reads a few KiB per file, so a truncated or mismatched checkpoint is refused in milliseconds,
    before anything starts, instead of failing later inside the engines. Returns the config."""
    root = Path(root)
    cfg = load_config(root)
    if root.is_file():  # load_config accepts config.json itself; the weights sit beside it
        root = root.parent
    tensors = _preflight_files(root)  # name -> (file, dtype, shape)
    want = expected_shapes(cfg)
    _check_names(root, {n: t[0] for n, t in tensors.items()}, want, cfg)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, shape in want.items():
        f, dtype, got = tensors[name]
        if got != shape:
            raise CheckpointError(f"{f}: tensor '{name}' has shape {got}, config.json implies {shape}")
        if dtype not in _ST_FLOATS:
            raise CheckpointError(f"{f}: tensor '{name}' has dtype {dtype}; expected floating point")
    return cfg


def _preflight_files(root: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(_read_small(index, MAX_INDEX_BYTES))["weight_map"]
        except CheckpointError:
            raise
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: field 'weight_map' unreadable ({type(e).__name__})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: field 'weight_map' must map tensor names to shard files")
        shards: dict[str, set[str]] = {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or Path(fname).name != fname or not (root / fname).is_file():
                raise CheckpointError(f"{index}: field 'weight_map' names shard {str(fname)[:80]!r}, "
                                      f"which is not in {root}")
            shards.setdefault(fname, set()).add(name)
        out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
        for fname, names in shards.items():
            found = _check_safetensors(root / fname)
            absent = sorted(names - set(found))
            if absent:
                raise CheckpointError(f"{index}: field 'weight_map' puts tensor {absent[0]!r} in {fname}, "
                                      "which does not hold it")
            out.update({n: found[n] for n in names})
        return out
    if single.is_file():
        return _check_safetensors(single)
    extra = " (pytorch_model.bin is not supported; convert to safetensors)" if (root / "pytorch_model.bin").exists() else ""
    raise CheckpointError(f"{root}: missing {SINGLE_FILE} or {INDEX_FILE}{extra}")


def _read_small(path: Path, most: int) -> bytes:
    """A regular file of at most `most` bytes, whole."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file")
        if st.st_size > most:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than {most} for this kind of file")
        return os.pread(fd, most + 1, 0)
    finally:
        os.close(fd)


def _check_safetensors(f: Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Tensors of one safetensors file from its header, every byte range checked against the
    file: u64 header length N, N bytes of JSON, then the data, each tensor [begin, end) of it."""
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{f}: not a regular file")
        size = st.st_size
        if size < 8:
            raise CheckpointError(f"{f}: truncated: {size} bytes, not even a safetensors header length; "
                                  "fix: copy or convert the checkpoint again")
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if n > MAX_ST_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{f}: safetensors header of {n} bytes does not fit the file's {size} bytes "
                                  "(truncated or not safetensors); fix: copy or convert the checkpoint again")
        raw = os.pread(fd, n, 8)
    except OSError as e:
        raise CheckpointError(f"{f}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CheckpointError(f"{f}: safetensors header is not valid JSON (truncated or not safetensors)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{f}: safetensors header is not a JSON object")
    data = size - 8 - n
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{f}: tensor {name[:80]!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: header entry is not an object")
        dtype, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in _ST_DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {str(dtype)[:20]!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape):
            raise CheckpointError(f"{where}: shape {str(shape)[:60]} is not a list of dimensions")
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs) and 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{where}: data_offsets {str(offs)[:60]} are not [begin, end]")
        nbytes = math.prod(shape) * _ST_DTYPES[dtype]
        if offs[1] - offs[0] != nbytes:
            raise CheckpointError(f"{where}: {offs[1] - offs[0]} bytes for shape {tuple(shape)} of {dtype} "
                                  f"({nbytes} bytes)")
        if offs[1] > data:
            raise CheckpointError(f"{where}: bytes [{offs[0]}, {offs[1]}) run past the file's {data} data bytes "
                                  f"(truncated: the file is {size} bytes, it needs {8 + n + offs[1]}); fix: copy or convert "
                                  "the checkpoint again")
        spans.append((offs[0], offs[1], name))
        out[name] = (f, dtype, tuple(shape))
    spans.sort()
    for (b0, e0, n0), (b1, _e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{f}: tensors {n0[:60]!r} and {n1[:60]!r} overlap in the file")
    return out
