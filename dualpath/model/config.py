"""Model configuration, read from a Hugging Face `config.json`.

Only what the testbed's transformer implements is accepted: decoder-only GQA models of the
Qwen2 and Llama families (RMSNorm, RoPE, SwiGLU MLP). Anything else is refused with one line
that names the file and the field, so a user pointing the testbed at the wrong checkpoint learns
why at once instead of getting wrong tokens later.

Both config dialects are read: transformers >= 5 (`rope_parameters`, `dtype`) and the older one
(`rope_theta` + `rope_scaling`, `torch_dtype`) that most checkpoints on disk still use.
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
MAX_CONFIG_BYTES = 16 << 20  # a config.json is a few KiB
# Upper bounds that keep a (mis)typed config finite: far above any model this testbed can run
# (SmolLM2: vocab 49152, hidden 576, 30 layers, 9 heads), and the safetensors check catches the rest.
_MAX = {"vocab_size": 1 << 24, "hidden_size": 1 << 20, "intermediate_size": 1 << 22,
        "num_hidden_layers": 1024, "num_attention_heads": 4096, "num_key_value_heads": 4096,
        "head_dim": 1 << 16, "max_position_embeddings": 1 << 30}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded. The message is one line naming file and field."""


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`torch.float32`, "float32", "torch.float32", "bfloat16", ... -> a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype} (supported: float32, float16, bfloat16)")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r} (supported: float32, float16, bfloat16)")
    return _DTYPES[name]


def dtype_size(dtype: str | torch.dtype) -> int:
    """Bytes per element of a KV dtype."""
    return torch.empty((), dtype=parse_dtype(dtype)).element_size()


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear and llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192  # llama3


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "qwen2" or "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layer: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: always; Llama: attention_bias
    o_bias: bool  # Llama attention_bias only
    mlp_bias: bool  # Llama mlp_bias
    max_position_embeddings: int
    dtype: torch.dtype  # the checkpoint's declared dtype (the default load dtype)
    eos_token_id: tuple[int, ...] = ()

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (the GQA group size)."""
        return self.n_heads // self.n_kv_heads


def bytes_per_token_per_layer(config: ModelConfig, dtype: str | torch.dtype | None = None) -> int:
    """KV bytes one token occupies in one layer: 2 (K and V) * n_kv_heads * head_dim * dtype size.

    `dtype` defaults to the checkpoint's dtype; pass the dtype the model runs in if it differs.
    """
    return 2 * config.n_kv_heads * config.head_dim * dtype_size(dtype if dtype is not None else config.dtype)


def _fail(where: str, field: str, why: str) -> CheckpointError:
    return CheckpointError(f"{where}: field '{field}' {why}")


def _short(v: object, limit: int = 60) -> str:
    """A bounded repr of a value read from a config file (never the whole of a huge one)."""
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > 64:
        return f"an integer of {len(str(v)) if v.bit_length() < 14000 else 'many'} digits"
    if isinstance(v, (list, dict, str)) and len(v) > limit:
        v = v[:limit] if not isinstance(v, dict) else dict(list(v.items())[:4])
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def config_from_dict(d: dict, where: str = "config.json") -> ModelConfig:
    """Validate a config.json dict. `where` is the file name used in error messages."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    mt = d.get("model_type")
    if mt is None:
        raise _fail(where, "model_type", "is missing")
    if not isinstance(mt, str) or mt not in SUPPORTED_MODEL_TYPES:
        raise _fail(where, "model_type", f"is {_short(mt)}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

    def req_int(key: str) -> int:
        if key not in d:
            raise _fail(where, key, "is missing")
        return pos_int(key, d[key])

    def pos_int(key: str, v: object) -> int:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= _MAX.get(key, 1 << 30):
            raise _fail(where, key, f"must be a positive integer at most {_MAX.get(key, 1 << 30)}, got {_short(v)}")
        return v

    def opt_num(key: str, default: float) -> float:
        """A positive finite number; null or absent: the default."""
        v = d.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise _fail(where, key, f"must be a positive finite number, got {_short(v)}")
        return float(v)

    vocab = req_int("vocab_size")
    hidden = req_int("hidden_size")
    inter = req_int("intermediate_size")
    n_layer = req_int("num_hidden_layers")
    n_heads = req_int("num_attention_heads")
    n_kv = d.get("num_key_value_heads") or n_heads
    if not isinstance(n_kv, int) or isinstance(n_kv, bool) or n_kv <= 0 or n_heads % n_kv:
        raise _fail(where, "num_key_value_heads", f"must divide num_attention_heads={n_heads}, got {_short(n_kv)}")
    head_dim = d.get("head_dim") or hidden // n_heads
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or not 0 < head_dim <= _MAX["head_dim"] \
            or head_dim % 2:
        raise _fail(where, "head_dim", f"must be a positive even integer, got {_short(head_dim)}")
    if d.get("head_dim") is None and hidden % n_heads:
        raise _fail(where, "hidden_size", f"{hidden} is not divisible by num_attention_heads={n_heads}")

    _refuse_unsupported(d, where, mt)
    rope = _parse_rope(d, where)
    if mt == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False))

    dtype = _config_dtype(d, where)
    eos_ids = _eos_ids(d, where, vocab)
    rms_eps = opt_num("rms_norm_eps", 1e-6)
    mpe = d.get("max_position_embeddings")
    max_pos = 32768 if mpe is None else pos_int("max_position_embeddings", mpe)

    return ModelConfig(
        model_type=mt,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        n_layer=n_layer,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=rms_eps,
        rope=rope,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        max_position_embeddings=max_pos,
        dtype=dtype,
        eos_token_id=eos_ids,
    )


def _refuse_unsupported(d: dict, where: str, model_type: str) -> None:
    """One line for each architecture feature the layerwise model does not implement."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(where, "hidden_act", f"is {_short(act)}; only 'silu' (SwiGLU) is supported")
    if d.get("quantization_config"):
        raise _fail(where, "quantization_config", "is set; quantized checkpoints are not supported")
    if d.get("pretraining_tp", 1) not in (1, None) or isinstance(d.get("pretraining_tp"), bool):
        raise _fail(where, "pretraining_tp", f"is {_short(d['pretraining_tp'])}; only 1 is supported")
    if model_type == "qwen2" and d.get("use_sliding_window"):
        raise _fail(where, "use_sliding_window", "is true; sliding-window attention is not supported")
    layer_types = d.get("layer_types") or []
    if not isinstance(layer_types, list):
        raise _fail(where, "layer_types", f"must be a list, got {_short(layer_types)}")
    for lt in layer_types:
        if lt != "full_attention":
            raise _fail(where, "layer_types", f"contains {_short(lt)}; only 'full_attention' is supported")


def _config_dtype(d: dict, where: str) -> torch.dtype:
    raw_dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    try:
        if not isinstance(raw_dtype, str):
            raise ValueError
        return parse_dtype(raw_dtype)
    except ValueError:
        key = "dtype" if "dtype" in d else "torch_dtype"
        raise _fail(where, key, f"is {_short(raw_dtype)}; supported: float32, float16, bfloat16") from None


def _eos_ids(d: dict, where: str, vocab: int) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    eos_list = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    if len(eos_list) > 64 or not all(isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab
                                     for e in eos_list):
        raise _fail(where, "eos_token_id", f"must be a token id in [0, vocab_size) or a list of them, got {_short(eos)}")
    return tuple(eos_list)


def _parse_rope(d: dict, where: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` and `rope_scaling`.
    field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _fail(where, field, f"must be an object, got {_short(params)}")
    if any(isinstance(v, dict) for v in params.values()):
        raise _fail(where, field, "is nested per layer type; not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise _fail(where, field, f"has rope_type {_short(rope_type)}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if isinstance(prf, (list, dict)) or prf not in (None, 1, 1.0) or isinstance(prf, bool):
        raise _fail(where, "partial_rotary_factor", f"is {_short(prf)}; only 1.0 is supported")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise _fail(where, "rope_theta", f"must be a positive number, got {_short(theta)}")

    def num(key: str, default: float) -> float:
        v = params.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise _fail(where, f"{field}.{key}", f"must be a positive number, got {_short(v)}")
        return float(v)

    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        if "factor" not in params:
            raise _fail(where, f"{field}.factor", "is missing")
        return RopeConfig(theta=float(theta), rope_type="linear", factor=num("factor", 1.0))
    for key in ("factor", "low_freq_factor", "high_freq_factor"):
        if key not in params:
            raise _fail(where, f"{field}.{key}", "is missing (needed by rope_type 'llama3')")
    omp = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") \
        or d.get("max_position_embeddings") or 8192
    if not isinstance(omp, int) or isinstance(omp, bool) or not 0 < omp <= 1 << 30:
        raise _fail(where, "original_max_position_embeddings", f"must be a positive integer, got {_short(omp)}")
    return RopeConfig(
        theta=float(theta),
        rope_type="llama3",
        factor=num("factor", 8.0),
        low_freq_factor=num("low_freq_factor", 1.0),
        high_freq_factor=num("high_freq_factor", 4.0),
        original_max_position_embeddings=int(omp),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read and validate `<path>/config.json` (or `path` itself if it is the file)."""
    p = Path(path)
    f = p if p.is_file() else p / "config.json"
    if not p.exists():
        raise CheckpointError(f"{p}: checkpoint directory does not exist")
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (a checkpoint directory needs config.json)")
    try:
        fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{f}: not a regular file")
            raw = os.pread(fd, MAX_CONFIG_BYTES + 1, 0)
        finally:
            os.close(fd)
        if len(raw) > MAX_CONFIG_BYTES:
            raise CheckpointError(f"{f}: larger than {MAX_CONFIG_BYTES >> 20} MiB; not a config.json")
        d = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, too-long integers
        raise CheckpointError(f"{f}: not valid JSON ({' '.join(str(e).split())[:120]})") from None
    except RecursionError:
        raise CheckpointError(f"{f}: not valid JSON (nested too deeply)") from None
    return config_from_dict(d, where=str(f))
