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
from dataclasses import dataclass
from pathlib import Path

import torch

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
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


def config_from_dict(d: dict, where: str = "config.json") -> ModelConfig:
    """Validate a config.json dict. `where` is the file name used in error messages."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    mt = d.get("model_type")
    if mt is None:
        raise _fail(where, "model_type", "is missing")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise _fail(where, "model_type", f"is {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

    def req_int(key: str) -> int:
        if key not in d:
            raise _fail(where, key, "is missing")
        v = d[key]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise _fail(where, key, f"must be a positive integer, got {v!r}")
        return v

    vocab = req_int("vocab_size")
    hidden = req_int("hidden_size")
    inter = req_int("intermediate_size")
    n_layer = req_int("num_hidden_layers")
    n_heads = req_int("num_attention_heads")
    n_kv = d.get("num_key_value_heads") or n_heads
    if not isinstance(n_kv, int) or n_kv <= 0 or n_heads % n_kv:
        raise _fail(where, "num_key_value_heads", f"must divide num_attention_heads={n_heads}, got {n_kv!r}")
    head_dim = d.get("head_dim") or hidden // n_heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise _fail(where, "head_dim", f"must be a positive even integer, got {head_dim!r}")
    if d.get("head_dim") is None and hidden % n_heads:
        raise _fail(where, "hidden_size", f"{hidden} is not divisible by num_attention_heads={n_heads}")

    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise _fail(where, "hidden_act", f"is {act!r}; only 'silu' (SwiGLU) is supported")
    if d.get("quantization_config"):
        raise _fail(where, "quantization_config", "is set; quantized checkpoints are not supported")
    if d.get("pretraining_tp", 1) not in (1, None):
        raise _fail(where, "pretraining_tp", f"is {d['pretraining_tp']!r}; only 1 is supported")
    if mt == "qwen2":
        if d.get("use_sliding_window"):
            raise _fail(where, "use_sliding_window", "is true; sliding-window attention is not supported")
    for lt in d.get("layer_types") or []:
        if lt != "full_attention":
            raise _fail(where, "layer_types", f"contains {lt!r}; only 'full_attention' is supported")

    rope = _parse_rope(d, where)
    if mt == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    else:
        qkv_bias = o_bias = bool(d.get("attention_bias", False))
        mlp_bias = bool(d.get("mlp_bias", False))

    raw_dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
    try:
        dtype = parse_dtype(raw_dtype)
    except ValueError:
        key = "dtype" if "dtype" in d else "torch_dtype"
        raise _fail(where, key, f"is {raw_dtype!r}; supported: float32, float16, bfloat16") from None

    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))

    return ModelConfig(
        model_type=mt,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        n_layer=n_layer,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=rope,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=mlp_bias,
        max_position_embeddings=int(d.get("max_position_embeddings", 32768)),
        dtype=dtype,
        eos_token_id=eos_ids,
    )


def _parse_rope(d: dict, where: str) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older checkpoints `rope_theta` and `rope_scaling`.
    field = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise _fail(where, field, f"must be an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise _fail(where, field, "is nested per layer type; not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise _fail(where, field, f"has rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    prf = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        raise _fail(where, "partial_rotary_factor", f"is {prf!r}; only 1.0 is supported")
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise _fail(where, "rope_theta", f"must be a positive number, got {theta!r}")

    def num(key: str, default: float) -> float:
        v = params.get(key, default)
        if not isinstance(v, (int, float)) or v <= 0:
            raise _fail(where, f"{field}.{key}", f"must be a positive number, got {v!r}")
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
        or d.get("max_position_embeddings", 8192)
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
        d = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{f}: not valid JSON ({e})") from None
    return config_from_dict(d, where=str(f))
